"""verl-remote train remote_backend=arctic against the Arctic test server, as a user runs it.

The server runs as its own process (``python -m verl_arctic.testing.server``), like a real Arctic service, one
per protocol generation for the module; the CLI reaches it only through ``remote_backend.comms.url``. Every
test leaves it holding no job, which the next test relies on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import (
    ROOT,
    TrainRuns,
    arctic_jobs,
    arctic_process,
    finish,
    free_port,
    last_line,
    left_behind,
    metric,
    read_until,
    run_log,
    start,
    step_row,
    steps,
    train,
)

pytestmark = pytest.mark.train


@pytest.fixture(scope="module", params=["v0.1", "main"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(url, generation): the test server of one generation, for the module."""
    generation = str(request.param)
    with arctic_process(generation, tmp_path_factory.mktemp(f"arctic-{generation}") / "server.log") as url:
        yield url, generation


KL_RECIPE = ("--recipe", str(ROOT / "configs" / "grpo-kl.yaml"))


def _base_run(train_runs: TrainRuns, url: str) -> Any:
    """2 steps of GRPO with a KL penalty, saving at step 2."""
    return train_runs(
        *KL_RECIPE, "remote_backend=arctic", f"remote_backend.comms.url={url}",
        "trainer.total_training_steps=2", "trainer.save_freq=2",
    )  # fmt: skip


def _assert_trained_two_kl_steps(output: str, ckpt: Path, generation: str) -> None:
    """What 2 steps of the KL recipe show: the sampler had the trained weights each step (its log-probs are the
    trainer's), the reference job kept the initial weights while training moved away, and the step-2 save
    points at Arctic's checkpoint."""
    assert steps(output)[:2] == [1, 2]
    log = run_log(ckpt)
    diffs = metric(log, "training/rollout_probs_diff_max")
    assert len(diffs) == 2 and max(diffs) < 1e-4
    kl = metric(log, "actor/kl_loss")
    assert kl[0] == 0.0 and kl[1] > 0.0
    pointer = json.loads((ckpt / "global_step_2" / "actor" / "arctic_checkpoint.json").read_text())
    assert pointer["step"] == 2 and pointer["generation"] == generation and Path(pointer["path"]).is_dir()


@pytest.mark.parametrize("server", ["v0.1"], indirect=True)
def test_grpo_with_a_kl_penalty_trains_saves_and_destroys_its_jobs(
    server: tuple[str, str], train_runs: TrainRuns
) -> None:
    """Protocol v0.1 from start to a clean end. (The same on main is the first run of the SIGTERM test below,
    and a run on main that ends cleanly is its last.)"""
    url, generation = server
    made = _base_run(train_runs, url).ok()
    assert steps(made.out.stdout) == [1, 2]
    _assert_trained_two_kl_steps(made.out.stdout, made.ckpt, generation)
    assert arctic_jobs(url) == {}
    assert left_behind(made.folder) == {}


@pytest.mark.parametrize("server", ["v0.1"], indirect=True)
def test_a_v0_1_checkpoint_cannot_be_resumed_and_the_run_is_refused_before_anything_starts(
    server: tuple[str, str], train_runs: TrainRuns, tmp_path: Path, cli_main: Any
) -> None:
    """Arctic's v0.1 protocol has no load-checkpoint call. (Resuming on main: the SIGTERM test below, three
    times.)"""
    url, _generation = server
    _base_run(train_runs, url).ok().clone(tmp_path)
    resume = ["remote_backend=arctic", f"remote_backend.comms.url={url}", "trainer.total_training_steps=3"]
    code, _out, err = cli_main("train", *resume, f"trainer.default_local_dir={tmp_path / 'ckpt'}")
    assert code == 2, err[-3000:]  # refused before anything starts (cli_main fails if Ray started)
    assert "Arctic protocol v0.1 at" in last_line(err) and "has no load-checkpoint call" in last_line(err)
    assert "set trainer.resume_mode=disable to start over" in last_line(err)
    assert arctic_jobs(url) == {}


@pytest.mark.faults
@pytest.mark.parametrize("server", ["main"], indirect=True)
def test_a_server_error_names_the_call_and_the_server_and_the_run_destroys_its_jobs(
    server: tuple[str, str], tmp_path: Path
) -> None:
    """Arctic's engines refuse the memory logits optimisation without ZoRRO: the first log-prob call fails. (Both
    generations' routes named in the same error: tests/arctic/test_protocol.py.)"""
    url, _generation = server
    out = train(tmp_path, "remote_backend=arctic", f"remote_backend.comms.url={url}",
                "trainer.total_training_steps=2", "remote_backend.train.logits.optimization=memory")  # fmt: skip
    assert out.returncode == 1
    assert last_line(out.stderr).startswith("verl-remote train: the run failed: ArcticError: ")
    assert f"ArcticError: Arctic call forward (POST {url}/forward?job_id=" in out.stderr
    assert "HTTP 500: Internal Server Error" in out.stderr
    assert arctic_jobs(url) == {}
    assert left_behind(tmp_path) == {}


@pytest.mark.faults
def test_a_sampler_failure_stops_that_step_in_the_samplers_own_words(tmp_path: Path) -> None:
    """A server that leaves out the sampled log-probs the run asks for: every request of the step fails in
    verl-arctic's words. verl's agent loop logs a failed request and goes on; the run stops instead, with the
    sampler's own error, each request's failure shown once and the rest counted. (Not asking for them, the run
    trains: the last run of the next test.)"""
    with arctic_process("main", tmp_path / "server.log", "--without-sampled-logprobs") as url:
        asked = train(tmp_path, "remote_backend=arctic", f"remote_backend.comms.url={url}",
                      "trainer.total_training_steps=2")  # fmt: skip
        assert asked.returncode == 1
        said = f"Arctic's /generate at {url} was asked for sampled log-probs (logprobs=0) but answered with no "
        failed = re.fullmatch(
            r"verl-remote train: the run failed: RolloutError: sampling failed at step (\d+): \w+: "
            + re.escape(said)
            + r".* \(and \d+ more failed requests\)",
            last_line(asked.stderr),
        )
        assert failed is not None, last_line(asked.stderr)
        assert "set actor_rollout_ref.rollout.calculate_log_probs=false" in asked.stderr
        assert steps(asked.stdout) == list(range(1, int(failed.group(1))))
        assert "replay buffer" not in asked.stdout + asked.stderr
        # Each request's failure is logged by verl's agent loop: the console shows it once and counts the rest.
        assert (asked.stdout + asked.stderr).count(said) == 2, asked.stderr[-3000:]
        assert re.search(r"verl-remote: \d+ more error lines like the ones above are in .*/logs/train-", asked.stderr)
        assert arctic_jobs(url) == {}
        assert left_behind(tmp_path) == {}


@pytest.mark.faults
def test_sigterm_sigkill_and_a_killed_server_stop_the_run_and_each_time_it_resumes(tmp_path: Path) -> None:
    """One run stopped three ways, each stop resumed by the next run in the same folder:

    - SIGTERM (kill, systemd, schedulers, `ray job stop`) after step 2 of GRPO with a KL penalty, which has
      trained as it should until then: the jobs go, the checkpoint stays;
    - SIGKILL of the driver after step 4: no chance to clean up, so the dead run's jobs stay on the service,
      recorded in its folder, and the next run removes them;
    - the service killed after step 6: the step stops in Arctic's words; the run resumes once it is back, here
      a service the run launches itself.
    """
    port = free_port()
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "server.log"
    arctic = ["remote_backend=arctic", f"remote_backend.comms.url=http://127.0.0.1:{port}", "trainer.save_freq=2"]
    with arctic_process("main", log, port=port) as url:
        proc = start(tmp_path, *KL_RECIPE, *arctic, "trainer.total_training_steps=4")
        seen = "".join(read_until(proc, step_row(2)))
        assert arctic_jobs(url) != {}
        proc.send_signal(signal.SIGTERM)
        rest = finish(proc, timeout=300)
        _assert_trained_two_kl_steps(seen, ckpt, "main")
        assert proc.returncode == 143, rest[-3000:]
        assert last_line(rest) == "verl-remote train: terminated by SIGTERM"
        assert "verl-remote: terminated (SIGTERM); destroying the backend" in rest
        assert "logging.cc" not in rest and "SIGABRT" not in rest  # no native crash in Ray's teardown
        assert arctic_jobs(url) == {}  # destroyed on the way out, before Ray went down
        assert left_behind(tmp_path) == {}

        proc = start(tmp_path, *arctic, "trainer.total_training_steps=6")
        resumed = "".join(read_until(proc, step_row(4)))
        assert steps(resumed) == [3, 4]
        assert "left by a run that did not end cleanly" not in resumed  # SIGTERM left nothing behind
        proc.kill()
        proc.wait(timeout=60)
        assert left_behind(tmp_path) == {}  # the run's watchdog ended its Ray processes
        left = json.loads((ckpt / "arctic_jobs.json").read_text())
        assert set(arctic_jobs(url)) == {str(job) for job in left["jobs"].values()}  # still held on the service

        proc = start(tmp_path, *arctic, "trainer.total_training_steps=20")
        cleaned = "".join(read_until(proc, step_row(6)))
        assert steps(cleaned) == [5, 6]
        for kind, job in left["jobs"].items():
            assert f"destroyed {kind} job {job} on {url}, left by a run that did not end cleanly" in cleaned
        assert not set(arctic_jobs(url)) & {str(job) for job in left["jobs"].values()}  # gone from the service
        server = subprocess.run(
            ["pgrep", "-f", f"verl_arctic.testing.server --port {port}"], capture_output=True, text=True
        )
        for pid in server.stdout.split():
            os.kill(int(pid), signal.SIGKILL)  # the service dies, as a crashed or preempted node does
        killed_at = time.monotonic()
        rest = finish(proc, timeout=600)
    failed_after = time.monotonic() - killed_at
    last = last_line(rest)
    assert proc.returncode == 1, rest[-3000:]
    # One line: the step, the call, the URL and what the connection said; not verl's replay buffer.
    assert last.startswith("verl-remote train: the run failed: "), last
    assert "Arctic call " in last and f"{url}/" in last and ("step 7" in last or "step" not in last), last
    assert "replay buffer" not in rest
    assert failed_after < 120, failed_after
    assert left_behind(tmp_path) == {}

    # The service is back, started by the run itself (remote_backend.comms.launch, empty as after a restart) and
    # leaving out the sampled log-probs, which the run does not ask for: it resumes at step 7 and trains, and the
    # service it launched stops with it.
    launch = f"{sys.executable} -m verl_arctic.testing.server --port {port} --api main --without-sampled-logprobs"
    resumed_run = train(
        tmp_path, *arctic, f"remote_backend.comms.launch='{launch}'", "trainer.total_training_steps=8",
        "actor_rollout_ref.rollout.calculate_log_probs=false",
    )  # fmt: skip
    assert resumed_run.returncode == 0, resumed_run.stderr[-3000:]
    assert steps(resumed_run.stdout) == [7, 8]
    assert "training/rollout_probs_diff_max" not in run_log(ckpt)
    assert not (ckpt / "arctic_jobs.json").exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
    assert left_behind(tmp_path) == {}
