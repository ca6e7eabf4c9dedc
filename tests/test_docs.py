"""Every ``verl-remote`` command and every recipe the README and docs/ show composes, as written: a documented key
that does not exist (``remote_backend.url`` for ``remote_backend.comms.url``), a misspelt one or a value of the wrong
type fails here, naming the file and the line.

Commands are read from code blocks (fenced, or indented by four spaces); a command continues on the next line after
a backslash. Words that stand for the reader's own value (``<name>``, ``...``, ``$(...)``) are left out; a command
for a backend that exists only in the text (the author guide's ``my``) is counted, not composed.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT

DOCS = [
    ROOT / "README.md",
    ROOT / "configs" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
]
#: Backends the docs name as examples of one's own, which no wheel provides.
HYPOTHETICAL = {"my", "mybackend"}
_COMMAND = re.compile(r"(?:^|\s|--\s)(?:\S*/)?verl-remote (train|config|check)(?=\s|$)")
_PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\$\(|\$\{(?!oc\.)")


@dataclass(frozen=True)
class Command:
    where: str
    verb: str
    words: list[str]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


def _code_lines(text: str) -> Iterator[tuple[int, str]]:
    """The lines of a markdown text's code blocks, with their line numbers."""
    fence = None
    previous_blank = True
    indented = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            else:
                yield number, line
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            continue
        if line.startswith("    ") and (previous_blank or indented):
            indented = True
            yield number, line
        else:
            indented = False
        previous_blank = not stripped


def commands(path: Path) -> Iterator[Command]:
    lines = list(_code_lines(path.read_text()))
    index = 0
    while index < len(lines):
        number, line = lines[index]
        while line.rstrip().endswith("\\") and index + 1 < len(lines):
            index += 1
            line = line.rstrip()[:-1] + " " + lines[index][1].strip()
        index += 1
        found = _COMMAND.search(line.split(" #")[0])
        if found is None or line.strip().startswith(("verl-remote train:", "verl-remote config:", "verl-remote:")):
            continue
        rest = line.split(" #")[0][found.end() :]
        try:
            words = shlex.split(rest)
        except ValueError:  # a quote the line does not close: prose, not a command
            continue
        words = words[: next((i for i, w in enumerate(words) if w in ("&&", "|", ";", ">")), len(words))]
        yield Command(f"{_name(path)}:{number}", found.group(1), words)


def recipes(path: Path) -> Iterator[tuple[str, str]]:
    """The YAML blocks that are recipes (their defaults start from verl-remote's config)."""
    text = path.read_text()
    for match in re.finditer(r"```ya?ml\n(.*?)```", text, re.DOTALL):
        body = match.group(1)
        if re.search(r"^defaults:\n\s+- (verl_remote|verl_remote_demo)\b", body, re.MULTILINE):
            yield f"{_name(path)}:{text[: match.start()].count(chr(10)) + 2}", body


def _compose(command: Command) -> str | None:
    """Compose ``command``'s config as the CLI would; what was skipped, or None."""
    from verl_remote.cli.preflight import check_numbers
    from verl_remote.demo import DEMO_RECIPE, recipe_for
    from verl_remote.discovery.compose import compose_config

    recipe = None
    overrides: list[str] = []
    words = list(command.words)
    if command.verb == "check":
        name = words.pop(0)
        if name in HYPOTHETICAL:
            return name
        overrides.append(f"remote_backend={name}")
        recipe = DEMO_RECIPE
    while words:
        word = words.pop(0)
        if word == "--recipe":
            recipe = words.pop(0)
            if not recipe.startswith(("/", "demo")):
                recipe = str(ROOT / recipe)
        elif word.startswith("--"):
            continue
        elif "=" in word and not _PLACEHOLDER.search(word):
            overrides.append(word)
        elif word.startswith("remote_backend="):
            return word
    for word in overrides:
        if word.partition("=")[0].lstrip("+") == "remote_backend" and word.partition("=")[2] in HYPOTHETICAL:
            return word.partition("=")[2]
    chosen = recipe_for(overrides, recipe)
    config = compose_config(overrides, recipe=chosen)
    check_numbers(config, _defaults(str(config.remote_backend.name), chosen))
    return None


@functools.cache
def _defaults(backend: str, recipe: str | None) -> Any:
    from verl_remote.discovery.compose import compose_config

    return compose_config([f"remote_backend={backend}"], recipe=recipe)


def _all_commands() -> list[Command]:
    return [command for path in DOCS for command in commands(path)]


def test_every_documented_command_composes() -> None:
    found = _all_commands()
    # The reader is shown many; a parser that found few would pass vacuously.
    assert len(found) >= 35, [c.where for c in found]
    wheres = {c.where.split(":")[0] for c in found}
    assert {"README.md", "docs/user-guide.md", "docs/arctic-backend.md", "docs/tinker-backend.md"} <= wheres
    problems = []
    skipped = set()
    for command in found:
        try:
            left_out = _compose(command)
        except Exception as exc:
            problems.append(f"{command.where}: verl-remote {command.verb} {' '.join(command.words)}: {exc}")
            continue
        if left_out is not None:
            skipped.add(left_out)
    assert problems == []
    assert skipped <= HYPOTHETICAL | {"remote_backend=<name>", "remote_backend=mybackend"}, skipped


@pytest.mark.parametrize("path", [p for p in DOCS if list(recipes(p))], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_recipe_composes(path: Path, tmp_path: Path) -> None:
    from verl_remote.discovery.compose import compose_config

    for where, body in recipes(path):
        if _PLACEHOLDER.search(body):  # a backend of the reader's choice
            body = re.sub(r"override remote_backend: <[^>]*>", "override remote_backend: local", body)
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(body)
        try:
            compose_config([], recipe=recipe)
        except Exception as exc:
            pytest.fail(f"{where}: the recipe does not compose: {exc}")


@pytest.mark.faults
def test_a_documented_key_that_does_not_exist_fails_the_check(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nverl-remote train remote_backend=arctic remote_backend.url=http://arctic:8000 \\\n"
        "    trainer.total_training_steps=2\n```\n"
    )
    [command] = list(commands(page))
    assert command.words == [
        "remote_backend=arctic",
        "remote_backend.url=http://arctic:8000",
        "trainer.total_training_steps=2",
    ]
    with pytest.raises(Exception, match=r"unknown key remote_backend.url; did you mean remote_backend.comms.url\?"):
        _compose(command)


#: A test the docs cite: a module of tests/, with a test's name after ``::`` where the row names one.
_CITED_TEST = re.compile(r"(?<![\w/.-])tests/[\w/]+\.py(?:::\w+)?")


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_test_the_docs_cite_exists(page: str) -> None:
    """A claim names the test that shows it (CONTRIBUTING.md): a module renamed or a test merged away leaves
    the claim without one, which this names."""
    text = (ROOT / "docs" / page).read_text()
    missing = []
    for cited in sorted(set(_CITED_TEST.findall(text))):
        module, _, name = cited.partition("::")
        path = ROOT / module
        if not path.is_file() or (
            name and not re.search(rf"^(async )?def {re.escape(name)}\(", path.read_text(), re.M)
        ):
            missing.append(cited)
    assert missing == [], f"docs/{page} cites tests that are not there: {missing}"


def _faults_marks(path: Path) -> tuple[bool, set[str]]:
    """Whether the test module at ``path`` is marked ``faults`` as a whole (its ``pytestmark``), and the names of its
    functions marked ``@pytest.mark.faults`` one by one; read, not imported."""

    def is_faults(node: ast.expr) -> bool:
        return ast.unparse(node) == "pytest.mark.faults"

    whole, marked = False, set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in targets):
                value = node.value
                marks = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
                whole = whole or any(is_faults(mark) for mark in marks)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
            is_faults(decorator) for decorator in node.decorator_list
        ):
            marked.add(node.name)
    return whole, marked


def test_every_test_the_reliability_page_cites_runs_under_the_faults_mark() -> None:
    """docs/reliability.md says `pytest -m faults` runs every test it cites: each citation names its test
    (``tests/path.py::test_name``, not a whole module), and that test is marked ``faults``, by itself or by its
    module's ``pytestmark``."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    cited = sorted(set(_CITED_TEST.findall(text)))
    assert len(cited) > 20, cited  # the page's tables were read
    offenders = []
    for citation in cited:
        module, _, name = citation.partition("::")
        path = ROOT / module
        if not name:
            offenders.append(f"{citation}: a whole module; cite the test that shows the row (::test_name)")
        elif not path.is_file():
            offenders.append(f"{citation}: no such module")
        else:
            whole, marked = _faults_marks(path)
            if not (whole or name in marked):
                offenders.append(f"{citation}: not marked faults; add @pytest.mark.faults to it")
    assert offenders == [], "docs/reliability.md cites tests that `pytest -m faults` does not run:\n" + "\n".join(
        offenders
    )
