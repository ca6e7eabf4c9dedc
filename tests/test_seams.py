"""The inventory of verl's names verl-remote relies on (verl_remote.integration.seams), both ways: every verl name the
code imports, or overrides in a subclass of one of verl's classes, is on it, read from the code; every entry holds in
the installed verl; and a verl without its V1 trainer is named in one line."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT

SOURCES = sorted((ROOT / "src").rglob("*.py"))


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def relied_on(paths: list[Path]) -> dict[str, set[str]]:
    """``module:name`` of every verl name the files import (a module's attributes as they are used), and of every
    method a class of theirs overrides on a verl base class, with where."""
    from verl_remote.integration.seams import resolve

    found: dict[str, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        where = path.name
        names: dict[str, str] = {}
        modules: dict[str, str] = {}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.level == 0
                and node.module.split(".")[0] == "verl"
            ):
                for alias in node.names:
                    if _is_module(f"{node.module}.{alias.name}"):
                        modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    else:
                        names[alias.asname or alias.name] = f"{node.module}:{alias.name}"
                        found.setdefault(f"{node.module}:{alias.name}", set()).add(where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                found.setdefault(f"{modules[node.value.id]}:{node.attr}", set()).add(where)
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in names:
                    target = names[base.id]
                elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in names:
                    target = f"{names[base.value.id]}.{base.attr}"
                else:
                    continue
                verl_class = resolve(target)
                for item in node.body:
                    overrides = isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and hasattr(
                        verl_class, item.name
                    )
                    if overrides and (not item.name.startswith("__") or item.name == "__init__"):
                        found.setdefault(f"{target}.{item.name}", set()).add(f"{where} ({node.name})")
    return found


def missing_from_inventory(relied: dict[str, set[str]]) -> list[str]:
    """What the code relies on that no entry of the inventory names (compared as the objects they resolve to, so that
    a method inherited through a subclass matches the entry of the class that defines it)."""
    from verl_remote.integration.seams import SEAMS, resolve

    listed: list[Any] = []
    for seam in SEAMS:
        if seam.set_in is None:
            listed.append(resolve(seam.target))
    missing = []
    for target, where in sorted(relied.items()):
        obj = resolve(target)
        func = getattr(obj, "__func__", obj)  # a classmethod resolves to a new bound method each time
        if not any(obj is entry or func is getattr(entry, "__func__", entry) for entry in listed):
            missing.append(f"{target} ({', '.join(sorted(where))})")
    return missing


def test_every_verl_name_the_code_relies_on_is_in_the_inventory() -> None:
    relied = relied_on(SOURCES)
    # The reading finds what it must: imports, a module's attributes, overridden private methods.
    for expected in (
        "verl.workers.utils.losses:ppo_loss",
        "verl.utils.tensordict_utils:make_iterator",
        "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync._consume_sync_metrics",
        "verl.trainer.main_ppo:TaskRunnerV1.__ray_actor_class__.run",
    ):
        assert expected in relied, expected
    assert missing_from_inventory(relied) == []


def test_a_verl_name_off_the_inventory_is_found(tmp_path: Path) -> None:
    code = tmp_path / "uses_more.py"
    code.write_text(
        "from verl.utils.fs import copy_to_local\n"
        "from verl.workers.utils.losses import ppo_loss\n"
        "from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync\n"
        "class Mine(PPOTrainerSync):\n"
        "    def _update_actor(self, batch, metrics): ...\n"
        "    def _compute_advantage(self, batch, metrics): ...\n"
    )
    missing = missing_from_inventory(relied_on([code]))
    assert [line.split(" (")[0] for line in missing] == [
        "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync._compute_advantage",
        "verl.utils.fs:copy_to_local",
    ]


def test_every_entry_holds_in_the_installed_verl() -> None:
    from verl_remote.integration.seams import SEAMS, Seam, problems, verl_problem

    assert problems() == []
    assert verl_problem() is None and verl_problem(everything=False) is None
    assert len(SEAMS) >= 70
    gone = (
        Seam("verl.trainer.main_ppo:TaskRunnerV1.no_such_method", "x"),
        Seam("verl.workers.utils.losses:ppo_loss", "x", ("config", "data")),
    )
    assert [line.split(":")[1] for line in problems(gone)] == ["TaskRunnerV1.no_such_method", "ppo_loss"]


def test_a_verl_without_its_v1_trainer_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_remote.integration import seams

    monkeypatch.setattr(seams, "SEAMS", (seams.Seam("verl.trainer.main_ppo:TaskRunnerV1", "x"),))
    real_source = seams.inspect.getsource
    disabled = "def main(config):\n    raise NotImplementedError('TrainerV1 is disabled')\n"
    monkeypatch.setattr(
        seams.inspect,
        "getsource",
        lambda obj: disabled if getattr(obj, "__name__", "") == "verl.trainer.main_ppo" else real_source(obj),
    )
    line = seams.verl_problem()
    assert (
        line is not None
        and "has its V1 trainer switched off (verl.trainer.main_ppo says 'TrainerV1 is disabled')" in line
    )
    monkeypatch.setattr(seams.inspect, "getsource", real_source)
    monkeypatch.setattr(seams, "SEAMS", (seams.Seam("verl.trainer.main_ppo:TaskRunnerV1Gone", "x"),))
    line = seams.verl_problem()
    assert line is not None and line.startswith("verl 0.9.1 lacks what verl-remote relies on (its V1 trainer")
    assert "verl.trainer.main_ppo:TaskRunnerV1Gone: AttributeError" in line and "\n" not in line
