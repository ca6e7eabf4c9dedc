"""`verl-remote check`: the conformance checks pass for in-tree backends and name the defect of broken ones.

The command itself is run once, on the local backend (its lines, summary and exit code, and that nothing of it
is left); the other backends are checked through :func:`verl_remote.testing.check_backend`, as a backend's own
tests call it, on one Ray instance in this process, or as pytest items (:func:`verl_remote.testing.
parametrize_checks`) in a pytest of their own, as an author's suite runs them.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

from conftest import ROOT, cli, left_behind, live_actors, run

pytestmark = pytest.mark.train  # a check starts the demo's model in Ray workers (seconds to a minute)

CHECK_NAMES = [
    "spec", "contract", "from_config", "reconnect_handle", "worker_reattaches", "sampler_reattaches",
    "log_prob_layout", "reference", "sampler", "training_step", "weight_sync", "checkpoint", "export", "gradient",
    "overlap", "destroy",
]  # fmt: skip


def _marks(stdout: str) -> dict[str, str]:
    return dict((name, mark.strip()) for mark, name in re.findall(r"^\[(ok  |FAIL|skip)\] (\w+)", stdout, re.M))


def _checked(name: str, *overrides: str) -> str:
    """The check lines of ``check_backend(name, overrides)``, as ``verl-remote check`` prints them."""
    from verl_remote.testing import check_backend

    lines = "\n".join(result.line() for result in check_backend(name, overrides))
    assert live_actors() == []
    return lines


def test_the_local_backend_passes_every_check_under_every_loss_and_leaves_nothing(
    tmp_path: Path, ray_left_behind: Any
) -> None:
    out = cli("check", "local", "--losses", "all", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Token authentication" not in out.stdout + out.stderr  # Ray's notice is not one of the results
    assert _marks(out.stdout) == dict.fromkeys(CHECK_NAMES, "ok")
    # The checkpoint the check saved, exported: transformers loads it, with the engine's log-probs at the save.
    assert re.search(r"^\[ok  \] export: max difference \S+$", out.stdout, re.M), out.stdout
    # Every policy loss verl has, every other aggregation, the KL loss: each update verl's.
    count = len(POLICY_LOSS_REGISTRY) + 4 + 1
    assert re.search(
        rf"^\[ok  \] gradient: {count} losses: verl's update within \d+\.\d% of its move", out.stdout, re.M
    )
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
        # Every check ran at temperature 1: a sampler that ignores the temperature passed them all.
        ("temperature_ignored", "weight_sync", "sample from the logits divided by the temperature"),
        # With quirks that are no defects (verl never reads a row's last position, nor a metric named 'loss'): the
        # checks before pass it.
        ("[pad_log_prob_at_end,no_loss_key,load_nothing]", "checkpoint", "restore the weights"),
        # The weights restored, the optimizer not: a resumed run would take other steps.
        ("optimizer_not_saved", "checkpoint", "save and restore the optimizer's state with the weights"),
        # A job left on its service, which no local process or actor shows: the backend's left_on_service says.
        ("leaves_a_job", "destroy", "release in destroy everything the backend made on its service"),
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
    if failing != "destroy":
        assert marks["destroy"] == "ok"  # the backend is destroyed whatever failed
        assert "[ok  ] destroy: twice, nothing left here nor on the service" in out  # the local engine's answer
    failure = out.split(f"[FAIL] {failing}")[1].split("\n[")[0]  # its line and its fix
    assert "fix: " in failure and fix in failure
    if defect == "leaves_a_job":
        assert "[FAIL] destroy: left on the service: faulty job 1 (RUNNING)\n" in out
    if "pad_log_prob_at_end" in defect:
        assert "the last positions hold [-2.5], which verl never reads" in out
        assert re.search(
            r"\[ok  \] training_step: (actor/)?pg_loss \S+, grad_norm .*; no 'loss' among its \d+ metrics", out
        )


def _pytest(folder: Path, *test_files: Path) -> str:
    """``pytest`` of ``test_files`` as a backend's author runs it (an ini of its own, nothing of this suite's): its
    report, a line per item (``PASSED path::test[check]``, ``XFAIL ...``) with the reasons of its expected
    failures."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    out = run(
        sys.executable, "-m", "pytest", *map(str, test_files), "-q", "-rA", "-p", "no:cacheprovider",
        "-c", str(folder / "pytest.ini"), "--rootdir", str(folder),
        timeout=900, cwd=folder,
    )  # fmt: skip
    assert left_behind(folder) == {}  # its Ray and the checks' services ended with it
    return out.stdout + out.stderr


def _outcomes(report: str, test: str) -> dict[str, int]:
    """The items of the test function ``test`` by outcome, e.g. ``{"passed": 12, "failed": 1, "xfailed": 1}``."""
    words = {"PASSED": "passed", "FAILED": "failed", "XFAIL": "xfailed", "XPASS": "xpassed", "SKIPPED": "skipped"}
    found: dict[str, int] = {}
    for line in report.splitlines():
        word, _, item = line.partition(" ")
        if word in words and item.split(" ")[0].split("::")[-1].startswith(f"{test}["):
            found[words[word]] = found.get(words[word], 0) + 1
    return found


CLIP = ("ignores_clip", "vanilla", "it does not clip the ratio")
PER_SEQUENCE = ("per_sequence", "vanilla", "it aggregates as loss_agg_mode=seq-mean-token-mean does")
VANILLA = ("vanilla_always", "gspo", "it trains verl's vanilla loss whatever loss_mode says")


@pytest.mark.faults
@pytest.mark.parametrize(
    ("precision", "defect", "mode", "mistake", "probed"),
    [
        ("fp32", *CLIP, "by the norm; 5% allowed for fp32"),
        ("fp32", *PER_SEQUENCE, "by the norm; 5% allowed for fp32"),
        # bf16: the probe on the update's own rows, summed over tokens.
        ("bf16", *CLIP, "by the norm, the probe on the update's own rows; 5% allowed for bf16"),
        ("bf16", *VANILLA, "by the norm, the probe on the update's own rows; 5% allowed for bf16"),
        ("bf16", *PER_SEQUENCE, "by the norm, the probe on the update's own rows; 5% allowed for bf16"),
    ],
)
def test_the_gradient_check_names_the_loss_and_the_mistake_of_a_backend_that_trains_another(
    ray_cluster: Any, precision: str, defect: str, mode: str, mistake: str, probed: str
) -> None:
    """Only what the gradient check needs runs before it (the config, the backend, its forwarder and sampler).
    With bf16's probe (on the update's own rows) too, each mistake is named."""
    from verl_remote.testing import Conformance
    from verl_remote.testing.checks import CheckFailed

    loss = f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"
    conformance = Conformance("faulty", (f"remote_backend.defect={defect}", loss), losses=[{}], precision=precision)
    try:
        for needed in ("check_spec", "check_from_config", "check_worker_reattaches", "check_sampler_reattaches"):
            getattr(conformance, needed)()
        with pytest.raises(CheckFailed) as failed:
            conformance.check_gradient()
    finally:
        conformance.close()
    assert live_actors() == []
    # The configured loss, named (the checks' config has a KL term), how far off, and which mistake.
    label = f"loss_mode={mode}, loss_agg_mode=token-mean, kl_loss_type=low_var_kl"
    said = str(failed.value)
    off = re.fullmatch(
        rf"{re.escape(label)}: the update is not verl's: the log-probs after it are (\d+)% of verl's update away "
        rf"from those after verl's gradient \({re.escape(probed)}\); {re.escape(mistake)}",
        said,
    )
    assert off is not None, said
    assert "actor_loss_gradient" in failed.value.hint


def _gradient(*overrides: str, losses: Any = None) -> tuple[str, list[str]]:
    """The gradient check of the faulty backend with ``overrides`` (only what it needs runs before it): its line,
    or its failure's, and the progress lines it gave, one per loss."""
    from verl_remote.testing import Conformance
    from verl_remote.testing.checks import CheckFailed

    progress: list[str] = []
    conformance = Conformance("faulty", overrides, losses=losses, on_progress=progress.append)
    try:
        for needed in ("check_spec", "check_from_config", "check_worker_reattaches", "check_sampler_reattaches"):
            getattr(conformance, needed)()
        try:
            said = conformance.check_gradient()
        except CheckFailed as exc:
            said = f"FAIL {exc}"
    finally:
        conformance.close()
    assert live_actors() == []
    return said, progress


@pytest.mark.faults
def test_the_gradient_check_covers_every_loss_mode_the_backend_claims_by_default(ray_cluster: Any) -> None:
    """Configured with the vanilla loss, a backend that trains vanilla whatever loss_mode says passed when only the
    configured loss was compared; by default each policy loss mode the backend claims is, the configured first.
    One that claims the vanilla loss only (its preflight refuses the others, naming loss_mode) passes, saying
    which it refuses."""
    modes = sorted(POLICY_LOSS_REGISTRY, key=lambda mode: (mode != "vanilla", mode))
    said, progress = _gradient("remote_backend.defect=vanilla_always")
    assert said.startswith("FAIL loss_mode=") and "it trains verl's vanilla loss whatever loss_mode says" in said
    assert progress[0].startswith(f"gradient 1/{len(modes)}: loss_mode=vanilla: within "), progress
    assert all(re.fullmatch(r"gradient \d+/\d+: .*: within \d+\.\d% of verl's move \(\d+\.\d s\)", p) for p in progress)
    failed = said.removeprefix("FAIL loss_mode=").split(":")[0]
    assert failed != "vanilla" and modes.index(failed) == len(progress)  # the first mode that is not vanilla's

    said, progress = _gradient("remote_backend.defect=[vanilla_always,claims_vanilla_only]")
    refused = ", ".join(mode for mode in modes if mode != "vanilla")
    assert said.startswith("loss_mode=vanilla: verl's update within ")
    assert said.endswith(f"; not claimed (its preflight refuses them): {refused}"), said
    assert len(progress) == 1


@pytest.mark.faults
def test_a_backend_that_fixes_its_loss_when_it_is_made_passes_each_loss_on_a_backend_made_for_it(
    ray_cluster: Any,
) -> None:
    """Its engine trains the loss of the config it was made with, whatever the forwarder's says: right in a run,
    whose configs agree. Each loss other than the configured one is compared on a backend made for it."""
    losses = [{"policy_loss.loss_mode": "vanilla"}, {"policy_loss.loss_mode": "gspo"}, {"loss_agg_mode": "token-sum"}]
    said, progress = _gradient("remote_backend.defect=loss_fixed_at_creation", losses=losses)
    assert said.startswith("3 losses: verl's update within "), said
    assert said.endswith(
        "; the backend takes its loss from the config it is made with: each loss on a backend made for it"
    )
    assert progress[0].endswith(" s)") and [p.endswith(", on a backend made for it)") for p in progress] == [
        False,
        True,
        True,
    ], progress


def test_authors_test_files_check_as_pytest_items_and_a_declared_expected_failure_that_passes_fails(
    tmp_path: Path,
) -> None:
    """Two authors' test files in one pytest run (one Ray each would be one more start-up: the run is the point).

    examples/bigram-backend: a third party's backend, checked by its author's own test file, one item per check.

    A backend whose sampler reads the live training weights, its author having declared that it fails `overlap`
    (and, wrongly, `destroy`): overlap is an expected failure with the check's own line and fix, the checks after it
    run, and destroy, which passes, fails, saying to remove the declaration."""
    example = ROOT / "examples" / "bigram-backend" / "tests" / "test_conformance.py"
    faulty = tmp_path / "test_faulty_conformance.py"
    faulty.write_text(
        "from verl_remote.testing import parametrize_checks\n\n\n"
        '@parametrize_checks("faulty", ["remote_backend.defect=samples_live_weights"], expected_failures={\n'
        '    "overlap": "our sampler reads the live weights", "destroy": "declared by mistake"})\n'
        "def test_faulty(check):\n"
        "    check()\n"
    )
    report = _pytest(tmp_path, example, faulty)
    assert _outcomes(report, "test_the_bigram_backend") == {"passed": len(CHECK_NAMES)}, report[-3000:]
    expected = {"failed": 1, "passed": len(CHECK_NAMES) - 2, "xfailed": 1}
    assert _outcomes(report, "test_faulty") == expected, report[-3000:]
    [xfailed] = [line for line in report.splitlines() if line.startswith("XFAIL")]
    assert "test_faulty[overlap]" in xfailed and "our sampler reads the live weights: [FAIL] overlap:" in xfailed
    assert " fix: " in xfailed and "sample from the weights of the last update_weights" in xfailed, xfailed
    [failed] = [line for line in report.splitlines() if line.startswith("FAILED")]
    assert "test_faulty[destroy]" in failed, failed
    assert "Failed: destroy passed, but it is declared an expected failure (declared by mistake): remove it" in report


def test_a_third_partys_backend_frozen_at_the_0_1_0_contract_passes_every_check(ray_cluster: Any) -> None:
    """tests/packages/frozen-backend: written from 0.1.0's face and author guide only, never edited since; a change
    of verl-remote that would break a published backend fails here."""
    from verl_remote.testing import check_backend  # 0.1.0's way: all the checks in one call

    results = check_backend("frozen")
    assert [r.name for r in results if r.ok] == CHECK_NAMES, "\n".join(r.line() for r in results)
    # Export is optional: a backend of 0.1.0's contract without it passes, with a note.
    said = {r.name: r.line() for r in results}
    assert said["export"].startswith("[ok  ] export: not declared (optional)"), said["export"]
    assert live_actors() == []


def test_a_backend_without_verl_remotes_bases_fails_the_contract_check_and_the_command_exits_1(
    ray_cluster: Any, cli_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The echo test backend is a lifecycle stub: its worker is not a forwarder, so it cannot train.

    The command runs in this process, on the module's Ray instance; its watchdog, which ends every process this
    one started when it exits, is left out here (it would end the module's Ray too)."""
    monkeypatch.setattr("verl_remote.runtime.watchdog.start_watchdog", lambda: os.open(os.devnull, os.O_RDONLY))
    code, out, _err = cli_main("check", "echo")
    assert code == 1, out
    assert live_actors() == []
    marks = _marks(out)
    assert marks["spec"] == "ok" and marks["contract"] == "FAIL"
    assert "EchoWorker'> is not a subclass of verl_remote.integration.worker.RemoteForwarderWorker" in out
    assert marks["destroy"] == "skip"  # no backend was made
    assert out.splitlines()[-1] == f"check echo: 1 passed, 1 failed, {len(CHECK_NAMES) - 2} not run"
