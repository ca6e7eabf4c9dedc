"""The house's rules that a reader relies on: backends use the face only, the face is the stable list and lazy, no
function is too long to read. (The rooms' import order is `nox -s lint`'s import contracts.)"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import verl_remote
from conftest import python

ROOT = Path(__file__).resolve().parents[1]
# What backend authors write: the examples and the three in-tree backends.
BACKENDS = [
    *sorted((ROOT / "examples").glob("*/src/*")),
    ROOT / "src" / "verl_arctic",
    ROOT / "src" / "verl_remote_tinker",
    ROOT / "src" / "verl_remote" / "backends",
]
# The face, the conformance kit, and the built-in demo's assets (a backend's test server may serve its model).
AUTHOR_MODULES = ("verl_remote", "verl_remote.testing", "verl_remote.demo")


def _imports(folder: Path) -> list[tuple[str, str]]:
    """(file, module) for every import of verl_remote's in the Python files under ``folder``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [(str(path.relative_to(ROOT)), name) for name in names if name.split(".")[0] == "verl_remote"]
    return found


def test_the_examples_and_the_in_tree_backends_import_only_the_face_and_the_conformance_kit() -> None:
    allowed = [module.split(".") for module in AUTHOR_MODULES]
    seen = {folder.name: _imports(folder) for folder in BACKENDS}
    assert all(seen.values()), seen  # each of them imports verl-remote: the check looked
    wrong = [
        (path, module)
        for imports in seen.values()
        for path, module in imports
        if module.split(".")[:2] not in allowed
        # the local backend's own modules
        and not (path.startswith("src/verl_remote/backends") and module.startswith("verl_remote.backends"))
    ]
    assert wrong == []


def test_the_face_is_the_stable_list_and_loads_nothing_until_asked() -> None:
    assert set(verl_remote.__all__) == {"__version__", *verl_remote._EXPORTS}
    out = python(
        "import json, sys\n"
        "import verl_remote\n"
        "heavy = lambda m: m.split('.')[0] in ('verl', 'torch') or m.startswith('verl_remote.')\n"
        "before = sorted(filter(heavy, sys.modules))\n"
        "verl_remote.RemoteBackend\n"
        "after = sorted(m for m in ('verl', 'torch', 'verl_remote.kit.backend') if m in sys.modules)\n"
        "print(json.dumps([before, after]))\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = json.loads(out.stdout)
    assert before == [] and after == ["verl_remote.kit.backend"]
    for name in verl_remote.__all__:  # each resolves (the classes verl runs import verl)
        assert getattr(verl_remote, name) is not None


def test_no_function_in_src_is_longer_than_150_lines() -> None:
    long = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                lines = node.end_lineno - node.lineno + 1
                if lines > 150:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
