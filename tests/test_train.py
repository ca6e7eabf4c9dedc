"""verl-remote train end to end: real verl, Ray, Hydra and PyTorch, the local backend on CPU.

Each run starts its own local Ray cluster (about 40 s here) and stops it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT, cli, faulty_calls, run, steps
from verl_remote.watchdog import BOUND_S

pytestmark = pytest.mark.train

# Small and quick: 8 prompts x 4 samples of at most 8 tokens per step.
QUICK = ["trainer.val_before_train=false", "trainer.test_freq=-1"]


def _train(tmp_path: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    args = ["train", *overrides, f"trainer.default_local_dir={tmp_path / 'ckpt'}", *QUICK]
    return cli(*args, cwd=tmp_path, timeout=timeout)


def _checkpoint_checksum(actor_dir: Path) -> str:
    """The same digest as LocalEngine.weights_checksum, read from a saved checkpoint."""
    state = torch.load(actor_dir / "local_engine" / "local_engine.pt", map_location="cpu", weights_only=True)["model"]
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_grpo_runs_end_to_end_and_writes_verls_jsonl_metrics(tmp_path: Path, ray_left_behind: Any) -> None:
    out = _train(tmp_path, "trainer.total_training_steps=2", "trainer.logger=[console,file]")
    assert out.returncode == 0, out.stderr[-3000:]
    assert steps(out.stdout)[-2:] == [1, 2]
    assert "actor/pg_loss:" in out.stdout and "perf/mfu/actor:" in out.stdout
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("verl-remote: 2 steps (1-2); mean reward "), summary
    records = [json.loads(line) for line in (tmp_path / "verl_remote" / "demo.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all("critic/score/mean" in r["data"] and "actor/grad_norm" in r["data"] for r in records)
    assert ray_left_behind() == {}

    # The console: the step lines and a handful of ours; the full output of every process in the log file.
    console = (out.stdout + out.stderr).splitlines()
    assert all(line.startswith(("verl-remote", "step:")) for line in console), console
    # (this environment also has the test suite's broken backends installed, which verl-remote names: 4 lines)
    assert len(console) <= 2 + 4 + 4, console
    logs = list((tmp_path / "ckpt" / "logs").glob("train-*.log"))
    assert len(logs) == 1 and f"verl-remote: the full output goes to {logs[0]}" in out.stdout
    log = logs[0].read_text()
    assert log.count("\n") > 500 and "Started a local Ray instance" in log and "'actor_rollout_ref'" in log


def test_save_then_resume_continues_at_the_next_step_with_the_saved_weights(tmp_path: Path) -> None:
    first = _train(tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=2")
    assert first.returncode == 0, first.stderr[-3000:]
    step2 = tmp_path / "ckpt" / "global_step_2"
    assert (step2 / "data.pt").is_file()
    saved = _checkpoint_checksum(step2 / "actor")

    second = _train(tmp_path, "--verbose", "trainer.total_training_steps=3", "trainer.resume_mode=auto")
    assert second.returncode == 0, second.stderr[-3000:]
    assert steps(second.stdout) == [3]
    assert "Started a local Ray instance" in second.stderr  # --verbose: every process's output on the console
    assert (
        f"verl-remote: local engine loaded {step2 / 'actor' / 'local_engine'} (weights sha256 {saved})" in second.stdout
    )


@pytest.mark.faults
@pytest.mark.parametrize(
    ("stop", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_and_sigterm_destroy_the_backend_once_and_the_run_resumes_from_the_last_checkpoint(
    stop: signal.Signals, code: int, said: str, tmp_path: Path, ray_left_behind: Any
) -> None:
    calls = tmp_path / "calls.txt"
    args = [
        "remote_backend=faulty",
        f"remote_backend.calls_log={calls}",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "remote_backend.hold_after_save_s=30",  # the steps after the save are slow: the signal lands in the run
    ]
    script = str(Path(sys.executable).parent / "verl-remote")
    command = [script, "train", f"trainer.default_local_dir={tmp_path / 'ckpt'}", *QUICK, *args]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 400
    for line in proc.stdout:  # step 2 is logged after its checkpoint is written; then step 3 runs
        seen.append(line)
        if "step:2 " in line or time.monotonic() > deadline:
            break
    time.sleep(1.0)
    proc.send_signal(stop)
    rest, _ = proc.communicate(timeout=300)
    output = "".join(seen) + rest
    assert proc.returncode == code, output[-3000:]
    assert f"verl-remote: {said}; destroying the backend" in output
    assert "logging.cc" not in output and "SIGABRT" not in output  # no native crash on the way out
    # Weights sync after init and after each step, the step-2 checkpoint before step 2's sync.
    assert faulty_calls(calls)[:4] == ["update_weights", "update_weights", "save_checkpoint 2", "update_weights"]
    assert faulty_calls(calls)[-1] == "destroy" and faulty_calls(calls).count("destroy") == 1
    assert ray_left_behind() == {}
    assert not (tmp_path / "ckpt" / "global_step_4").exists()

    calls.unlink()
    resumed = _train(tmp_path, *args[:2], "trainer.total_training_steps=4", "trainer.save_freq=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(resumed.stdout) == [3, 4]
    assert faulty_calls(calls) == [
        "load_checkpoint 2",
        "update_weights",
        "update_weights",
        "save_checkpoint 4",
        "update_weights",
        "destroy",
    ]


@pytest.mark.faults
def test_a_backend_failure_in_update_actor_fails_the_run_and_destroys_the_backend(
    tmp_path: Path, ray_left_behind: Any
) -> None:
    calls = tmp_path / "calls.txt"
    out = _train(
        tmp_path,
        "remote_backend=faulty",
        "remote_backend.fail_in=forward_backward",
        f"remote_backend.calls_log={calls}",
        "trainer.total_training_steps=2",
    )
    assert out.returncode == 1
    assert (
        "verl-remote train: the run failed: InjectedFailure: faulty backend: injected failure in forward_backward"
        in out.stderr
    )
    assert faulty_calls(calls).count("destroy") == 1
    assert ray_left_behind() == {}


@pytest.mark.faults
def test_a_sampler_failure_stops_that_step_with_the_samplers_own_error(tmp_path: Path, ray_left_behind: Any) -> None:
    """verl's agent loop logs a failed request and goes on; the run stops instead, in the backend's words."""
    calls = tmp_path / "calls.txt"
    out = _train(
        tmp_path,
        "remote_backend=faulty",
        "remote_backend.fail_in=generate",
        "remote_backend.fail_after_calls=64",  # the first step's requests succeed
        f"remote_backend.calls_log={calls}",
        "trainer.total_training_steps=4",
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    failed = re.fullmatch(
        r"verl-remote train: the run failed: RolloutError: sampling failed at step (\d+): "
        r"InjectedFailure: faulty backend: injected failure in generate \(and \d+ more failed requests\)",
        last,
    )
    assert failed is not None, last
    assert steps(out.stdout) == list(range(1, int(failed.group(1))))
    assert "replay buffer" not in out.stdout + out.stderr
    # Each request's failure is logged by verl's agent loop: the console shows it once and counts the rest.
    assert (out.stdout + out.stderr).count("injected failure in generate") == 2, out.stderr[-3000:]
    assert re.search(r"verl-remote: \d+ more error lines like the ones above are in .*/logs/train-", out.stderr)
    assert faulty_calls(calls).count("destroy") == 1
    assert ray_left_behind() == {}


@pytest.mark.faults
def test_a_layout_with_two_forwarders_is_refused_for_a_single_forwarder_backend(
    tmp_path: Path, ray_left_behind: Any
) -> None:
    calls = tmp_path / "calls.txt"
    out = _train(
        tmp_path,
        "remote_backend=faulty",
        f"remote_backend.calls_log={calls}",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=1",
    )
    assert out.returncode == 1
    assert "SingleForwarderError: backend 'faulty' needs exactly one forwarder worker" in out.stderr
    assert "set trainer.n_gpus_per_node=1 trainer.nnodes=1" in out.stderr
    assert faulty_calls(calls).count("destroy") == 1
    assert ray_left_behind() == {}


def _metric(stdout: str, name: str) -> list[float]:
    return [float(part.split(":")[1]) for part in stdout.split() if part.startswith(f"{name}:")]


def test_a_kl_penalty_gets_reference_log_probs_from_the_frozen_initial_model(tmp_path: Path) -> None:
    out = _train(tmp_path, "--recipe", str(ROOT / "configs" / "grpo-kl.yaml"), "trainer.total_training_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_metric(out.stdout, "timing_s/ref")) == 2  # verl asked for reference log-probs each step
    kl = _metric(out.stdout, "actor/kl_loss")
    assert kl[0] == 0.0 and kl[1] > 0.0  # identical to the reference before the first update, not after


@pytest.mark.faults
def test_a_second_run_in_the_same_folder_is_refused_and_one_in_another_folder_runs_beside_it(
    tmp_path: Path, ray_left_behind: Any
) -> None:
    script = str(Path(sys.executable).parent / "verl-remote")
    first_args = [script, "train", f"trainer.default_local_dir={tmp_path / 'ckpt'}", *QUICK]
    first = subprocess.Popen(
        [*first_args, "trainer.total_training_steps=6"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert first.stdout is not None
    for line in first.stdout:  # the first run holds the folder once it trains
        if "training with backend" in line:
            break
    second = _train(tmp_path, "trainer.total_training_steps=1", timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    assert (
        f"trainer.default_local_dir={tmp_path / 'ckpt'}: another verl-remote run (pid {first.pid}, since "
        in (second.stderr.strip().splitlines()[-1])
    )
    # Two runs at once in different folders: their own Ray instances, names and ports; neither disturbs the other.
    other = tmp_path / "other"
    other.mkdir()
    assert first.poll() is None
    beside = _train(other, "trainer.total_training_steps=1")
    assert beside.returncode == 0, beside.stderr[-3000:]
    assert steps(beside.stdout) == [1]
    rest, _ = first.communicate(timeout=600)
    assert first.returncode == 0, rest[-3000:]
    assert steps(rest) == [1, 2, 3, 4, 5, 6]
    assert ray_left_behind() == {}


@pytest.mark.faults
def test_a_damaged_latest_checkpoint_is_named_and_passed_over_for_the_previous_one(tmp_path: Path) -> None:
    first = _train(tmp_path, "trainer.total_training_steps=4", "trainer.save_freq=2")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    weights = ckpt / "global_step_4" / "actor" / "local_engine" / "local_engine.pt"
    weights.write_bytes(weights.read_bytes()[:100])  # a disk full, a copy cut short
    saved = _checkpoint_checksum(ckpt / "global_step_2" / "actor")

    pinned = _train(tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt / 'global_step_4'}")
    assert pinned.returncode == 2
    assert f"{weights} has 100 bytes" in pinned.stderr.strip().splitlines()[-1]
    assert f"trainer.resume_from_path={ckpt / 'global_step_2'}" in pinned.stderr.strip().splitlines()[-1]

    resumed = _train(tmp_path, "trainer.total_training_steps=4", "trainer.resume_mode=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"the latest checkpoint, global_step_4, cannot be resumed: {weights} has 100 bytes, " in resumed.stdout
    assert "resuming from global_step_2, the newest complete one" in resumed.stdout
    assert steps(resumed.stdout) == [3, 4]
    assert f"(weights sha256 {saved})" in resumed.stdout


@pytest.mark.faults
def test_a_run_killed_during_a_save_resumes_from_the_last_complete_checkpoint(
    tmp_path: Path, ray_left_behind: Any
) -> None:
    calls = tmp_path / "calls.txt"
    args = ["remote_backend=faulty", f"remote_backend.calls_log={calls}", "trainer.save_freq=2"]
    script = str(Path(sys.executable).parent / "verl-remote")
    command = [script, "train", f"trainer.default_local_dir={tmp_path / 'ckpt'}", *QUICK, *args]
    command += ["trainer.total_training_steps=4", "remote_backend.hold_in_save_s=300"]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 400
    while not (calls.exists() and "holding in save_checkpoint 4" in calls.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run never reached the step-4 save"
        time.sleep(0.5)
    proc.kill()  # SIGKILL in the middle of the step-4 save: the backend's part written, verl's not
    proc.wait(timeout=60)
    killed_at = time.monotonic()
    assert ray_left_behind() == {}  # the run's watchdog ends what Ray's own cleanup would leave for minutes
    assert time.monotonic() - killed_at < BOUND_S + 2
    saved = _checkpoint_checksum(tmp_path / "ckpt" / "global_step_2" / "actor")

    calls.unlink()
    resumed = _train(tmp_path, *args, "trainer.total_training_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(resumed.stdout) == [3, 4]
    assert f"(weights sha256 {saved})" in resumed.stdout
    assert faulty_calls(calls)[0] == "load_checkpoint 2"


def test_verls_own_launcher_trains_with_the_backend_given_the_printed_overrides(
    tmp_path: Path, ray_left_behind: Any
) -> None:
    """python -m verl.trainer.main_ppo +remote_backend=NAME $(verl-remote config --overrides ...): stock verl's CLI."""
    calls = tmp_path / "calls.txt"
    words = cli("config", "--overrides", "remote_backend=faulty", f"remote_backend.calls_log={calls}", cwd=tmp_path)
    assert words.returncode == 0, words.stderr[-3000:]
    assert f"remote_backend.calls_log={calls}" in words.stdout.split()  # differs from the group file's value
    launch = [
        sys.executable, "-m", "verl.trainer.main_ppo", "+remote_backend=faulty", *words.stdout.split(), *QUICK,
        "trainer.save_freq=2", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ]  # fmt: skip
    # verl's ray.init() joins a cluster started on this machine with `ray start`; this run wants its own.
    env = {**os.environ, "RAY_ADDRESS": "local"}
    out = run(*launch, "trainer.total_training_steps=2", env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert steps(out.stdout) == [1, 2]
    assert re.search(r"verl-remote: 2 steps \(1-2\); mean reward \d\.\d{3} over the first 2", out.stdout)
    assert faulty_calls(calls).count("destroy") == 1
    assert ray_left_behind() == {}

    # verl's resume, through verl-remote's checkpoint records: the next step, from the backend's saved state.
    calls.unlink()
    resumed = run(*launch, "trainer.total_training_steps=3", env=env, cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(resumed.stdout) == [3]
    assert faulty_calls(calls)[0] == "load_checkpoint 2"
    assert ray_left_behind() == {}
