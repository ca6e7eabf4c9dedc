"""The house's rules that a reader relies on: backends use the face only, the face is the stable list and lazy, no
function is too long to read, the rooms said once. (The rooms' import order is `nox -s lint`'s import contracts in
pyproject.toml; the tests here read those contracts rather than restating them.)"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import tomllib

import verl_remote
from conftest import python

ROOT = Path(__file__).resolve().parents[1]
# What backend authors write: the examples, the third party's backend frozen at 0.1.0 and the three in-tree backends.
BACKENDS = [
    *sorted((ROOT / "examples").glob("*/src/*")),
    ROOT / "tests" / "packages" / "frozen-backend" / "src" / "verl_remote_frozen_backend",
    ROOT / "src" / "verl_arctic",
    ROOT / "src" / "verl_remote_tinker",
    ROOT / "src" / "verl_remote" / "backends",
]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
#: verl-remote's rooms, top floor first: the layers contract.
[ROOMS] = [c["layers"] for c in CONTRACTS if c["type"] == "layers" and c["containers"] == ["verl_remote"]]
#: What a backend may import: the face and every room the contract on backends does not forbid (the conformance
#: kit, the built-in demo's assets that a backend's test server may serve; the local backend its own room).
[FORBIDDEN] = [c["forbidden_modules"] for c in CONTRACTS if "verl_remote.backends" in c.get("source_modules", [])]
AUTHOR_MODULES = ("verl_remote", *(f"verl_remote.{room}" for room in ROOMS if f"verl_remote.{room}" not in FORBIDDEN))


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
    assert set(AUTHOR_MODULES) == {"verl_remote", "verl_remote.testing", "verl_remote.backends", "verl_remote.demo"}
    allowed = [module.split(".") for module in AUTHOR_MODULES]
    seen = {folder.name: _imports(folder) for folder in BACKENDS}
    assert all(seen.values()), seen  # each of them imports verl-remote: the check looked
    wrong = [
        (path, module)
        for imports in seen.values()
        for path, module in imports
        if module.split(".")[:2] not in allowed
        # another backend's modules: only the local backend's own
        or (module.startswith("verl_remote.backends") and not path.startswith("src/verl_remote/backends"))
    ]
    assert wrong == []


def test_the_rooms_are_said_once_the_architecture_page_and_the_faces_docstring_list_the_contracts() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page[page.index("## The code: its rooms") :].split("```text\n", 1)[1].split("```", 1)[0]
    drawn = [m.group(1) for m in re.finditer(r"^  (\w+)/ ", block, flags=re.MULTILINE)]
    assert drawn == [*ROOMS, "config"]  # config/ holds YAML, no code
    said = re.findall(r"^- ``(\w+)``: ", verl_remote.__doc__ or "", flags=re.MULTILINE)
    assert said == ROOMS
    # Every package of code is a room of the contract (config/ is a package of YAML files only).
    code = [
        p.name for p in (ROOT / "src" / "verl_remote").iterdir() if {f.name for f in p.rglob("*.py")} - {"__init__.py"}
    ]
    assert sorted(code) == sorted(ROOMS)


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
