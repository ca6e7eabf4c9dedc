"""`verl-remote check`: the conformance checks pass for in-tree backends and name the defect of broken ones.

The command itself is run once, on the local backend (its lines, summary and exit code, and that nothing of it
is left); the other backends are checked through :func:`verl_remote.testing.check_backend`, as a backend's own
tests call it, on one Ray instance in this process.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, cli, live_actors

pytestmark = pytest.mark.train  # a check starts the demo's model in Ray workers (seconds to a minute)

CHECK_NAMES = [
    "spec", "contract", "from_config", "reconnect_handle", "worker_reattaches", "sampler_reattaches",
    "log_prob_layout", "reference", "sampler", "training_step", "weight_sync", "checkpoint", "overlap", "destroy",
]  # fmt: skip


def _marks(stdout: str) -> dict[str, str]:
    return dict((name, mark.strip()) for mark, name in re.findall(r"^\[(ok  |FAIL|skip)\] (\w+)", stdout, re.M))


def _checked(name: str, *overrides: str) -> str:
    """The check lines of ``check_backend(name, overrides)``, as ``verl-remote check`` prints them."""
    from verl_remote.testing import check_backend

    lines = "\n".join(result.line() for result in check_backend(name, overrides))
    assert live_actors() == []
    return lines


def test_the_local_backend_passes_every_check_and_leaves_nothing(tmp_path: Path, ray_left_behind: Any) -> None:
    out = cli("check", "local", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Token authentication" not in out.stdout + out.stderr  # Ray's notice is not one of the results
    assert _marks(out.stdout) == dict.fromkeys(CHECK_NAMES, "ok")
    assert out.stdout.splitlines()[-1] == f"check local: {len(CHECK_NAMES)} passed, 0 failed"
    assert ray_left_behind() == {}


def test_check_of_an_unknown_backend_exits_2_naming_the_installed_ones(cli_main: Any) -> None:
    code, _out, err = cli_main("check", "nope")
    assert code == 2
    assert "nope" in err and "local" in err


@pytest.mark.faults
@pytest.mark.parametrize(
    ("defect", "failing", "fix"),
    [
        ("shifted_log_probs", "log_prob_layout", "these are shifted 1 position(s) early"),
        ("greedy_ignored", "sampler", "temperature 0 (verl's validation default) means greedy decoding"),
        # With a quirk that is no defect (verl never reads a row's last position): the checks before pass it.
        ("[pad_log_prob_at_end,load_nothing]", "checkpoint", "restore the weights"),
        ("samples_live_weights", "overlap", "sample from the weights of the last update_weights"),
    ],
)
def test_a_broken_backend_fails_the_check_that_names_its_defect(
    ray_cluster: Any, defect: str, failing: str, fix: str
) -> None:
    out = _checked("faulty", f"remote_backend.defect={defect}")
    marks = _marks(out)
    position = CHECK_NAMES.index(failing)
    assert [marks[n] for n in CHECK_NAMES[:position]] == ["ok"] * position  # everything before it passes
    assert marks[failing] == "FAIL"
    assert all(marks[n] == "skip" for n in CHECK_NAMES[position + 1 : -1])
    assert marks["destroy"] == "ok"  # the backend is destroyed whatever failed
    failure = out.split(f"[FAIL] {failing}")[1].split("\n[")[0]  # its line and its fix
    assert "fix: " in failure and fix in failure
    if "pad_log_prob_at_end" in defect:
        assert "the last positions hold [-2.5], which verl never reads" in out


def test_the_example_backend_passes_every_check_from_its_own_test_file(ray_cluster: Any) -> None:
    """examples/bigram-backend: a third party's backend, checked by its author's own test function."""
    path = ROOT / "examples" / "bigram-backend" / "tests" / "test_conformance.py"
    spec = importlib.util.spec_from_file_location("bigram_conformance", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.test_the_bigram_backend_conforms()
    assert live_actors() == []


def test_a_backend_without_verl_remotes_bases_fails_the_contract_check_and_the_command_exits_1(
    ray_cluster: Any, cli_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The echo test backend is a lifecycle stub: its worker is not a forwarder, so it cannot train.

    The command runs in this process, on the module's Ray instance; its watchdog, which ends every process this
    one started when it exits, is left out here (it would end the module's Ray too)."""
    monkeypatch.setattr("verl_remote.integration.watchdog.start_watchdog", lambda: os.open(os.devnull, os.O_RDONLY))
    code, out, _err = cli_main("check", "echo")
    assert code == 1, out
    assert live_actors() == []
    marks = _marks(out)
    assert marks["spec"] == "ok" and marks["contract"] == "FAIL"
    assert "EchoWorker'> is not a subclass of verl_remote.integration.worker.RemoteForwarderWorker" in out
    assert marks["destroy"] == "skip"  # no backend was made
    assert out.splitlines()[-1] == f"check echo: 1 passed, 1 failed, {len(CHECK_NAMES) - 2} not run"
