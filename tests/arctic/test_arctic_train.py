"""verl-remote train remote_backend=arctic against the Arctic test server, as a user runs it.

The server runs as its own process (``python -m verl_arctic.testing.server``),
like a real Arctic service; the CLI reaches it only through
``remote_backend.comms.url``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ROOT, cli, free_port, read_until, steps

pytestmark = pytest.mark.train

QUICK = ["trainer.val_before_train=false", "trainer.test_freq=-1"]


@pytest.fixture(params=["v0.1", "main"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    with _serving(str(request.param), tmp_path) as url:
        yield url, str(request.param)


@contextmanager
def _serving(generation: str, tmp_path: Path, *flags: str, port: int | None = None) -> Iterator[str]:
    port = port or free_port()
    log = (tmp_path / "server.log").open("a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl_arctic.testing.server", "--port", str(port), "--api", generation, *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
        time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _start(tmp_path: Path, url: str, *overrides: str) -> subprocess.Popen[str]:
    """verl-remote train in the background, its console merged into one stream to read step by step."""
    script = str(Path(sys.executable).parent / "verl-remote")
    args = ["train", "remote_backend=arctic", f"remote_backend.comms.url={url}", *QUICK]
    args += [f"trainer.default_local_dir={tmp_path / 'ckpt'}", *overrides]
    return subprocess.Popen([script, *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _jobs(url: str) -> dict[str, object]:
    return dict(httpx.get(f"{url}/status", timeout=10).json()["jobs"])


def _train(tmp_path: Path, url: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    args = ["train", "remote_backend=arctic", f"remote_backend.comms.url={url}", *QUICK]
    args += [f"trainer.default_local_dir={tmp_path / 'ckpt'}", *overrides]
    return cli(*args, cwd=tmp_path, timeout=600)


def test_grpo_trains_against_the_arctic_server_and_destroys_its_jobs(server: tuple[str, str], tmp_path: Path) -> None:
    url, _generation = server
    out = _train(tmp_path, url, "trainer.total_training_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert steps(out.stdout)[-2:] == [1, 2]
    # The sampler got the trained weights each step: its log-probs are the trainer's.
    diffs = [float(p.split(":")[1]) for p in out.stdout.split() if p.startswith("training/rollout_probs_diff_max:")]
    assert len(diffs) == 2 and max(diffs) < 1e-4
    assert _jobs(url) == {}


def test_resume_from_an_arctic_checkpoint(server: tuple[str, str], tmp_path: Path) -> None:
    url, generation = server
    first = _train(tmp_path, url, "trainer.total_training_steps=2", "trainer.save_freq=2")
    assert first.returncode == 0, first.stderr[-3000:]
    pointer = json.loads((tmp_path / "ckpt" / "global_step_2" / "actor" / "arctic_checkpoint.json").read_text())
    assert pointer["step"] == 2 and pointer["generation"] == generation and Path(pointer["path"]).is_dir()

    second = _train(tmp_path, url, "trainer.total_training_steps=3", "trainer.resume_mode=auto")
    if generation == "main":
        assert second.returncode == 0, second.stderr[-3000:]
        assert steps(second.stdout) == [3]
    else:
        assert second.returncode == 1
        assert "Arctic protocol v0.1 at" in second.stderr and "has no load-checkpoint call" in second.stderr
    assert _jobs(url) == {}


@pytest.mark.faults
def test_a_server_error_names_the_call_and_the_server_and_the_run_destroys_its_jobs(
    server: tuple[str, str], tmp_path: Path
) -> None:
    url, generation = server
    # Arctic's engines refuse the memory logits optimisation without ZoRRO: the first log-prob call fails.
    route = "forward" if generation == "main" else "fwd-no-grad"
    out = _train(tmp_path, url, "trainer.total_training_steps=2", "remote_backend.train.logits.optimization=memory")
    assert out.returncode == 1
    assert f"ArcticError: Arctic call forward (POST {url}/{route}?job_id=" in out.stderr
    assert "HTTP 500: Internal Server Error" in out.stderr
    assert _jobs(url) == {}


@pytest.mark.faults
def test_an_unreachable_server_fails_before_anything_is_created(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    out = _train(tmp_path, dead, "trainer.total_training_steps=1")
    assert out.returncode == 2  # refused by the preflight, before Ray starts
    assert f"remote_backend.comms.url={dead}: nothing answers there" in out.stderr.strip().splitlines()[-1]
    assert "Started a local Ray instance" not in out.stdout + out.stderr


def test_the_backend_can_launch_the_service_and_stops_it_at_the_end(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launch = f"{sys.executable} -m verl_arctic.testing.server --port {port} --api main"
    out = _train(tmp_path, url, "trainer.total_training_steps=1", f"remote_backend.comms.launch='{launch}'")
    assert out.returncode == 0, out.stderr[-3000:]
    assert steps(out.stdout)[-1:] == [1]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_a_kl_penalty_gets_reference_log_probs_from_the_log_prob_job(server: tuple[str, str], tmp_path: Path) -> None:
    url, _generation = server
    recipe = str(ROOT / "configs" / "grpo-kl.yaml")
    out = cli(
        "train",
        "--recipe",
        recipe,
        "remote_backend=arctic",
        f"remote_backend.comms.url={url}",
        *QUICK,
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    kl = [float(p.split(":")[1]) for p in out.stdout.split() if p.startswith("actor/kl_loss:")]
    assert kl[0] == 0.0 and kl[1] > 0.0  # the reference job keeps the initial weights; training moves away
    assert _jobs(url) == {}


@pytest.mark.faults
def test_a_sampler_without_log_probs_fails_the_step_in_its_own_words_or_trains_without_them(tmp_path: Path) -> None:
    (tmp_path / "asked").mkdir()
    (tmp_path / "without").mkdir()
    with _serving("main", tmp_path, "--without-sampled-logprobs") as url:
        asked = _train(tmp_path / "asked", url, "trainer.total_training_steps=1")
        assert asked.returncode == 1
        assert f"Arctic's /generate at {url} was asked for sampled log-probs (logprobs=0) but answered with no " in (
            asked.stderr
        )
        assert "set actor_rollout_ref.rollout.calculate_log_probs=false" in asked.stderr
        assert _jobs(url) == {}
        without = _train(
            tmp_path / "without",
            url,
            "trainer.total_training_steps=1",
            "actor_rollout_ref.rollout.calculate_log_probs=false",
        )
        assert without.returncode == 0, without.stderr[-3000:]
        assert steps(without.stdout)[-1:] == [1]
        assert "training/rollout_probs_diff_max" not in without.stdout


@pytest.mark.faults
def test_sigterm_destroys_the_runs_jobs_and_the_same_command_resumes(tmp_path: Path, ray_left_behind: Any) -> None:
    """What kill, systemd, schedulers and `ray job stop` send: the jobs go, the checkpoint stays."""
    with _serving("main", tmp_path) as url:
        run = ["trainer.total_training_steps=4", "trainer.save_freq=2"]
        proc = _start(tmp_path, url, *run)
        read_until(proc, "step:2 ")
        assert _jobs(url) != {}
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=300)
        assert proc.returncode == 143, rest[-3000:]
        assert rest.strip().splitlines()[-1] == "verl-remote train: terminated by SIGTERM"
        assert _jobs(url) == {}  # destroyed on the way out, before Ray went down
        assert ray_left_behind() == {}

        resumed = _train(tmp_path, url, *run)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert steps(resumed.stdout) == [3, 4]
        assert "left by a run that did not end cleanly" not in resumed.stderr
        assert _jobs(url) == {}


@pytest.mark.faults
def test_a_server_killed_mid_run_stops_that_step_in_arctics_words_and_the_run_resumes_once_it_is_back(
    tmp_path: Path, ray_left_behind: Any
) -> None:
    port = free_port()
    run = ["trainer.total_training_steps=20", "trainer.save_freq=2"]
    with _serving("main", tmp_path, port=port) as url:
        proc = _start(tmp_path, url, *run)
        read_until(proc, "step:2 ")
        server = subprocess.run(
            ["pgrep", "-f", f"verl_arctic.testing.server --port {port}"], capture_output=True, text=True
        )
        for pid in server.stdout.split():
            os.kill(int(pid), signal.SIGKILL)  # the service dies, as a crashed or preempted node does
        killed_at = time.monotonic()
        rest, _ = proc.communicate(timeout=600)
    failed_after = time.monotonic() - killed_at
    last = rest.strip().splitlines()[-1]
    assert proc.returncode == 1, rest[-3000:]
    # One line: the step, the call, the URL and what the connection said; not verl's replay buffer.
    assert last.startswith("verl-remote train: the run failed: "), last
    assert "Arctic call " in last and f"{url}/" in last and ("step 3" in last or "step" not in last), last
    assert "replay buffer" not in rest
    assert failed_after < 120, failed_after
    assert ray_left_behind() == {}

    with _serving("main", tmp_path, port=port) as url:  # the service is back (empty, as after a restart)
        resumed = _train(tmp_path, url, "trainer.total_training_steps=4", "trainer.save_freq=2")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert steps(resumed.stdout) == [3, 4]
        assert _jobs(url) == {}


@pytest.mark.faults
def test_after_the_driver_is_killed_the_next_run_removes_its_jobs_and_resumes(
    tmp_path: Path, ray_left_behind: Any
) -> None:
    """SIGKILL leaves no chance to clean up: the dead run's jobs stay on the service, recorded in its folder."""
    with _serving("main", tmp_path) as url:
        script = str(Path(sys.executable).parent / "verl-remote")
        ckpt = tmp_path / "ckpt"
        args = ["train", "remote_backend=arctic", f"remote_backend.comms.url={url}", *QUICK]
        args += [f"trainer.default_local_dir={ckpt}", "trainer.total_training_steps=4", "trainer.save_freq=2"]
        proc = subprocess.Popen(
            [script, *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if "step:2 " in line:
                break
        proc.kill()
        proc.wait(timeout=60)
        assert ray_left_behind() == {}  # the run's watchdog ended its Ray processes
        left = json.loads((ckpt / "arctic_jobs.json").read_text())
        assert set(_jobs(url)) == {str(job) for job in left["jobs"].values()}  # still held on the service

        resumed = _train(tmp_path, url, "trainer.total_training_steps=4", "trainer.save_freq=2")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert steps(resumed.stdout) == [3, 4]
        for kind, job in left["jobs"].items():
            assert f"destroyed {kind} job {job} on {url}, left by a run that did not end cleanly" in resumed.stderr
        assert _jobs(url) == {} and not (ckpt / "arctic_jobs.json").exists()
