"""Where verl-remote-tinker's sources are, for hatch: one place to look in a checkout, another in an sdist.

In a checkout the code lives in the repository's src/verl_remote_tinker (one tree, one test suite and one type
check for every distribution); the sdist carries a copy under its own src/, from which pip builds the
wheel. The version is verl_remote_tinker.__version__, read from whichever of the two is there.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent.parent / "src" / "verl_remote_tinker"
UNPACKED = HERE / "src" / "verl_remote_tinker"
SOURCES = UNPACKED if UNPACKED.is_dir() else CHECKOUT


def _version() -> str:
    for node in ast.parse((SOURCES / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            return str(ast.literal_eval(node.value))
    raise RuntimeError(f"no __version__ in {SOURCES / '__init__.py'}")


VERSION = _version()


class SourcesHook(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if SOURCES == UNPACKED:
            return  # an unpacked sdist: the wheel's `packages` setting finds src/verl_remote_tinker
        target = "verl_remote_tinker" if self.target_name == "wheel" else "src/verl_remote_tinker"
        build_data["force_include"][os.fspath(CHECKOUT)] = target
