"""The build hook of every distribution under dists/: where its sources are, one place in a checkout, another in
an sdist.

Each folder under dists/ packages one distribution whose code lives in the repository's src/<package> (one tree,
one test suite and one type check for every distribution); its own hatch_build.py runs this file with ``HERE``,
its folder. The package is the distribution's name (``[project] name`` in HERE/pyproject.toml) with dashes as
underscores. The sdist carries a copy of the sources under its own src/ and of this file, from which pip builds
the wheel. The version is the package's ``__version__``, read from whichever of the two is there.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

HERE: Path = globals()["HERE"]  # given by the distribution's hatch_build.py
_NAME = re.search(r'^name = "([^"]+)"', (HERE / "pyproject.toml").read_text(), re.MULTILINE)
if _NAME is None:
    raise RuntimeError(f"no [project] name in {HERE / 'pyproject.toml'}")
PACKAGE = _NAME.group(1).replace("-", "_")
CHECKOUT = HERE.parent.parent / "src" / PACKAGE
UNPACKED = HERE / "src" / PACKAGE
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
            return  # an unpacked sdist: the wheel's `packages` setting finds src/<package>
        target = PACKAGE if self.target_name == "wheel" else f"src/{PACKAGE}"
        build_data["force_include"][os.fspath(CHECKOUT)] = target
