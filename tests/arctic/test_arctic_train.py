"""verl-remote train remote_backend=arctic against the Arctic test server, as a user runs it, and stopped.

The server runs as its own process (``python -m verl_arctic.testing.server``), like a real Arctic service; the
CLI reaches it only through ``remote_backend.comms.url``. Runs end to end on protocol v0.1, and on main beside a
dead run's jobs, against Arctic's own servers: tests/arctic/test_real_server.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (
    KL_RECIPE,
    arctic_jobs,
    arctic_process,
    assert_two_turn_run,
    cli,
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
    two_turn,
)

pytestmark = pytest.mark.train


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


@pytest.mark.faults
def test_sigterm_sigkill_a_killed_server_and_a_failing_sampler_stop_the_run_and_each_time_it_resumes(
    tmp_path: Path,
) -> None:
    """One run stopped four ways, each stop resumed by the next run in the same folder:

    - SIGTERM (kill, systemd, schedulers, `ray job stop`) after step 2 of GRPO with a KL penalty and the tests'
      multi-turn agent loop, which has trained as it should until then: the jobs go, the checkpoint stays;
    - SIGKILL of the driver after step 4: no chance to clean up, so the dead run's jobs stay on the service,
      recorded in its folder, and the next run removes them;
    - the service killed after step 6: the step stops in Arctic's words;
    - the service back, but leaving out the sampled log-probs the run asks for: the resumed step's requests all
      fail in verl-arctic's words; verl's agent loop logs a failed request and goes on, the run stops instead,
      in the sampler's own words, and destroys its jobs. (An HTTP error of another call names the call and the
      server the same way: tests/arctic/test_protocol.py; a failure in the update stops a run and destroys its
      backend once: tests/test_train.py.)
    """
    port = free_port()
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "server.log"
    # REINFORCE++ rather than GRPO: an estimator other than the default trains through verl-arctic
    # (tests/test_estimators.py: every estimator verl's V1 trainer can feed).
    arctic = [
        "remote_backend=arctic", f"remote_backend.comms.url=http://127.0.0.1:{port}", "trainer.save_freq=2",
        "algorithm.adv_estimator=reinforce_plus_plus",
    ]  # fmt: skip
    with arctic_process("main", log, port=port) as url:
        proc = start(tmp_path, *KL_RECIPE, *arctic, *two_turn(), "trainer.total_training_steps=4")
        seen = "".join(read_until(proc, step_row(2)))
        assert arctic_jobs(url) != {}
        proc.send_signal(signal.SIGTERM)
        rest = finish(proc, timeout=300)
        _assert_trained_two_kl_steps(seen, ckpt, "main")
        assert "'adv_estimator': 'reinforce_plus_plus'" in run_log(ckpt)
        assert_two_turn_run(run_log(ckpt), steps=2)  # each turn's text-in request: the trainer's tokens
        assert proc.returncode == 143, rest[-3000:]
        assert last_line(rest) == "verl-remote train: terminated by SIGTERM"
        assert "verl-remote: terminated (SIGTERM); destroying the backend" in rest
        assert "logging.cc" not in rest and "SIGABRT" not in rest  # no native crash in Ray's teardown
        assert arctic_jobs(url) == {}  # destroyed on the way out, before Ray went down
        assert left_behind(tmp_path) == {}

        # Asked to overlap, colocated engines (the default) decline in one line, and the run is synchronous.
        proc = start(tmp_path, *arctic, "trainer.v1.trainer_mode=remote_async", "trainer.total_training_steps=6")
        resumed = "".join(read_until(proc, step_row(4)))
        assert steps(resumed) == [3, 4]
        assert (
            "verl-remote: backend 'arctic' cannot sample while it trains (remote_backend.colocate=true: its sampling "
            "and training engines share their GPUs and take turns; launch the server with separate GPUs per engine "
            "and set remote_backend.colocate=false): this run is synchronous (trainer.v1.trainer_mode=remote)"
        ) in resumed
        assert "left by a run that did not end cleanly" not in resumed  # SIGTERM left nothing behind
        proc.kill()
        proc.wait(timeout=60)
        assert left_behind(tmp_path) == {}  # the run's watchdog ended its Ray processes
        left = json.loads((ckpt / "arctic_jobs.json").read_text())
        assert set(arctic_jobs(url)) == {str(job) for job in left["jobs"].values()}  # still held on the service

        # Overlapped (separate engines): it samples each next step while this one trains, resuming a synchronous
        # run's checkpoint, until the service dies; its weight sync beside the next step, as it asks.
        overlapped = [
            "trainer.v1.trainer_mode=remote_async", "remote_backend.colocate=false",
            "trainer.v1.remote_async.background_weight_sync=true", "remote_restart.max=0",
        ]  # fmt: skip
        proc = start(tmp_path, *arctic, *overlapped, "trainer.total_training_steps=20")
        cleaned = "".join(read_until(proc, step_row(6)))
        assert steps(cleaned) == [5, 6]
        assert "cannot sample while it trains" not in cleaned
        assert (
            "verl-remote: the next step's requests do not wait for the weight sync (trainer.v1.remote_async."
            "background_weight_sync=true): a step may train on samples two updates old (verl's training/off_policy/"
            "trajectory_staleness up to 2)"
        ) in cleaned
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
    assert proc.returncode == 1, rest[-3000:]
    # Steps 5 and 6 ran, step 7 failed: its samples were taken during step 6, so its first call to the dead server
    # is whichever of its calls comes first (the old log-probs' forward, measured), or sampling where the samples
    # taken ahead were not all back. Either way one line: the call, the URL and what the connection said, and for
    # sampling the step and how many of its 64 requests (8 prompts x 8 responses) failed; not verl's replay buffer.
    lines = rest.strip().splitlines()
    assert any(re.fullmatch(r"verl-remote: 2 steps \(5-6\); mean reward .*", line) for line in lines), rest[-3000:]
    resumes = f"verl-remote: the last complete checkpoint is {ckpt}/global_step_6; the same command resumes from it"
    assert resumes in lines, rest[-3000:]
    # A lost connection is transient, but this run turned restarts off (restarts: the test after this one).
    assert "verl-remote: not restarted: a transient fault; restarts are off (remote_restart.max=0)" in lines
    failed = re.fullmatch(
        r"verl-remote train: the run failed: (?:ArcticError: Arctic call \w+ \(POST "
        + re.escape(url)
        + r"/[\w-]+\?job_id=\d+\) failed: cannot reach the server: .+|RolloutError: sampling failed at step 7: "
        r"ArcticError: Arctic call generate \(POST "
        + re.escape(url)
        + r"/generate\?job_id=\d+\) failed: All connection attempts failed \(and (\d+) more failed requests\))",
        lines[-1],
    )
    assert failed is not None and int(failed.group(1) or 0) < 64, lines[-1]
    assert "replay buffer" not in rest
    # The kill to the run's exit, Ray's shutdown included: the failure line came 4 s after the kill (the run log's
    # times, 2 shared cores); the bound leaves room for a machine busy with other runs.
    assert failed_after < 30, failed_after
    assert left_behind(tmp_path) == {}
    staleness = metric(run_log(ckpt), "training/off_policy/trajectory_staleness/max")
    assert staleness[:2] == [0, 1], staleness  # step 5 on the resumed weights' samples, step 6 on step 5's
    assert max(staleness) <= 2, staleness
    # The weight sync ran beside the next step (background_weight_sync): that step logs the sync's own time and
    # the part of it the step waited for.
    took = metric(run_log(ckpt), "timing_s/update_weights")
    waited = metric(run_log(ckpt), "timing_s/update_weights_wait")
    assert len(took) == len(waited) >= 1 and all(t > 0 for t in took), (took, waited)
    assert all(0 <= w <= t for w, t in zip(waited, took, strict=True)), (took, waited)

    # The service is back (empty, as after a restart), but its sampler leaves out the log-probs the run asks for.
    with arctic_process("main", tmp_path / "server-back.log", "--without-sampled-logprobs", port=port):
        asked = train(tmp_path, *arctic, "trainer.total_training_steps=8")
        jobs = arctic_jobs(url)
        exported = {step: _export(ckpt, step, tmp_path / f"hf-{step}") for step in ("2", "latest")}
        assert arctic_jobs(url) == {}  # the export's own training job, destroyed
    gone = cli("export", str(ckpt), "--out", str(tmp_path / "hf-gone"))
    assert gone.returncode == 2 and last_line(gone.stderr).startswith("verl-remote export: error: "), gone.stderr
    assert f"start it at {url} (remote_backend.comms.url, as the run recorded it)" in last_line(gone.stderr)
    # A run that launched its server (comms.launch) has it launched again, and stopped after.
    launch = f"remote_backend.comms.launch=python -m verl_arctic.testing.server --port {port} --api main"
    launched = cli("export", str(ckpt), "--step", "4", "--out", str(tmp_path / "hf-launched"), launch)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "verl-arctic: starting the Arctic server (remote_backend.comms.launch: python -m " in launched.stdout
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # the launched server is stopped
    adapter = cli("export", str(ckpt), "--adapter", "--out", str(tmp_path / "hf-gone"))
    assert adapter.returncode == 2 and "verl-arctic trains every weight of the model" in last_line(adapter.stderr)
    assert not (tmp_path / "hf-gone").exists()
    _assert_exports_what_training_saved(ckpt, {**exported, "4": tmp_path / "hf-launched"})
    assert asked.returncode == 1, asked.stderr[-3000:]
    said = f"Arctic's /generate at {url} was asked for sampled log-probs (logprobs=0) but answered with no "
    failed = re.fullmatch(
        r"verl-remote train: the run failed: RolloutError: sampling failed at step (\d+): \w+: "
        + re.escape(said)
        + r".* \(and \d+ more failed requests\)",
        last_line(asked.stderr),
    )
    assert failed is not None and failed.group(1) == "7", last_line(asked.stderr)  # resumed from step 6's save
    assert "set actor_rollout_ref.rollout.calculate_log_probs=false" in asked.stderr
    # An answer without what was asked would come again: not a transient fault, no restart.
    assert "verl-remote: restart " not in asked.stderr and "not restarted" not in asked.stderr
    assert steps(asked.stdout) == []
    assert "replay buffer" not in asked.stdout + asked.stderr
    # Each request's failure is logged by verl's agent loop: the console shows it once and counts the rest.
    assert (asked.stdout + asked.stderr).count(said) == 2, asked.stderr[-3000:]
    assert re.search(r"verl-remote: \d+ more error lines like the ones above are in .*/logs/train-", asked.stderr)
    assert jobs == {}  # destroyed on the way out
    assert not (ckpt / "arctic_jobs.json").exists()
    assert left_behind(tmp_path) == {}


@pytest.mark.faults
def test_transient_faults_restart_the_run_from_its_last_checkpoint_and_a_refusal_stops_it(tmp_path: Path) -> None:
    """A run of 6 steps through a proxy of the tests' own (verl_remote.testing.proxy) that fails its requests as a
    load balancer and a flaky network do, and a service restart, finishes unattended:

    - a 502 to one sampling request of step 1: the request is sent again, the step goes on (no restart);
    - the connection of step 3's forward-backward cut: the run restarts from step 2's checkpoint;
    - the service killed after step 4 and started again, empty (its jobs gone, its checkpoints on disk): the run
      restarts from step 4's checkpoint.

    Each step is trained once: the service's optimizer has made three times the steps at step 6 that it had at
    step 2; and each attempt drew its prompts where the checkpoint it resumed left verl's data loader. Then a
    refusal (HTTP 400) stops the next run at once, with no restart.
    """
    from verl_remote.testing.proxy import CUT, Fault, FaultProxy

    port = free_port()
    ckpt = tmp_path / "ckpt"
    with FaultProxy(f"http://127.0.0.1:{port}") as proxy:
        arctic = [
            "remote_backend=arctic", f"remote_backend.comms.url={proxy.url}", "trainer.save_freq=2",
            "remote_restart.backoff_s=1",
        ]  # fmt: skip
        with arctic_process("main", tmp_path / "server.log", port=port):
            proxy.inject(Fault("/generate", 502, body={"detail": "Bad Gateway"}))
            proc = start(tmp_path, *arctic, "trainer.total_training_steps=6")
            seen = read_until(proc, step_row(2))
            proxy.inject(Fault("/forward-backward", CUT))
            seen += read_until(proc, step_row(4))
            server = subprocess.run(
                ["pgrep", "-f", f"verl_arctic.testing.server --port {port}"], capture_output=True, text=True
            )
            for pid in server.stdout.split():
                os.kill(int(pid), signal.SIGKILL)  # a service restarted for maintenance: gone, then back
        with arctic_process("main", tmp_path / "server-back.log", port=port):
            rest = finish(proc, timeout=900)
            output = "".join(seen) + rest
            assert proc.returncode == 0, output[-3000:]
            assert proxy.answered("/generate") == 1 and proxy.answered("/forward-backward") == 1
            restarts = [line for line in output.splitlines() if line.startswith("verl-remote: restart ")]
            assert len(restarts) == 2, output[-5000:]
            assert restarts[0].startswith(
                "verl-remote: restart 1 of 3 in 1 s, from global_step_2: a transient fault at step 3: "
            ), restarts
            assert "Arctic call forward_backward (POST " in restarts[0], restarts
            assert restarts[1].startswith(
                "verl-remote: restart 2 of 3 in 2 s, from global_step_4: a transient fault at step 5: "
            ), restarts
            assert steps(output) == [1, 2, 3, 4, 5, 6]  # each shown once: the attempts' steps 3 and 5 failed
            assert re.search(r"^verl-remote: 6 steps \(1-6\); mean reward .*; restarted 2 times$", output, re.M)
            log = run_log(ckpt)
            assert metric(log, "verl_remote/restarts") == [0, 0, 1, 1, 2, 2]
            # Each attempt's sampler had the weights it resumed, as its trainer did: its log-probs are the trainer's.
            diffs = metric(log, "training/rollout_probs_diff_max")
            assert len(diffs) == 6 and max(diffs) < 1e-4, diffs
            # Step 1's 502 answered one /generate, which carries a batch of the step's requests: each sent again.
            retried = metric(log, "verl_remote/sample_retries")
            assert retried[0] >= 1 and sum(retried[1:]) == 0, retried

            # Each step trained once: what the service's optimizer counted, saved with each checkpoint.
            def optimizer_steps(step: int) -> int:
                import torch

                [state] = (ckpt / f"global_step_{step}" / "actor" / "arctic" / f"checkpoint-{step}").glob("*/state.pt")
                counts = {int(s["step"]) for s in torch.load(state, weights_only=True)["optimizer"]["state"].values()}
                assert len(counts) == 1, counts
                return counts.pop()

            assert optimizer_steps(2) > 0
            assert optimizer_steps(4) == 2 * optimizer_steps(2) and optimizer_steps(6) == 3 * optimizer_steps(2)

            # No prompt lost or trained twice: each attempt took up verl's data loader where the checkpoint it
            # resumed left it (its state, which verl saves as global_step_N/data.pt): 8 prompts drawn a step, in
            # the epoch's one shuffled order (the sampler's generator as the epoch began, the same in each), so
            # steps 3-6 drew the prompts an uninterrupted run draws. A loader started over would have drawn 16 by
            # step 4, the prompts of steps 1-2 again.
            import torch

            def data_loader(step: int) -> tuple[int, torch.Tensor]:
                state = torch.load(ckpt / f"global_step_{step}" / "data.pt", weights_only=True)["_sampler_iter_state"]
                return int(state["samples_yielded"]), state["sampler_iter_state"]["generator"]

            drawn = {step: data_loader(step) for step in (2, 4, 6)}
            assert [count for count, _ in drawn.values()] == [16, 32, 48], drawn
            assert all(torch.equal(order, drawn[2][1]) for _, order in drawn.values())

            # A refusal is refused again: the run stops at once, in the service's words, and is not restarted.
            # (POST only: the preflight's look at the protocol asks GET /forward-backward.)
            refusal = {"detail": "Job 9 is not a training job"}
            proxy.inject(Fault("/forward-backward", 400, method="POST", body=refusal))
            refused = train(tmp_path, *arctic, "trainer.total_training_steps=7")
            assert refused.returncode == 1, refused.stderr[-3000:]
            assert "HTTP 400: Job 9 is not a training job" in last_line(refused.stderr), refused.stderr[-3000:]
            assert "verl-remote: restart " not in refused.stdout + refused.stderr
            assert arctic_jobs(f"http://127.0.0.1:{port}") == {}  # destroyed on the way out
    assert left_behind(tmp_path) == {}


def _export(ckpt: Path, step: str, out: Path) -> Path:
    """``verl-remote export`` of one step of the run in ``ckpt``, on the server that holds no job: a training job of
    the export's own loads the step and writes it with /save's export_hf."""
    done = cli("export", str(ckpt), "--step", step, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(rf"^verl-remote: exported step {6 if step == 'latest' else step} to {out} \(", done.stdout, re.M)
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert not list(ckpt.rglob(".arctic-export-*")) and not list(ckpt.rglob("arctic-run-export-*"))
    return out


def _assert_exports_what_training_saved(ckpt: Path, exported: dict[str, Path]) -> None:
    """Each exported folder holds the weights the server saved for its step (so its log-probs are the server's:
    the conformance check compares them, tests/arctic/test_arctic_check.py), which training moved from the initial
    model, and moved further by step 6."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_remote.runtime.record import read_run_record

    record = read_run_record(str(ckpt))
    assert record is not None
    initial = AutoModelForCausalLM.from_pretrained(str(record.actor_rollout_ref.model.path), dtype=torch.float32)
    moved = {}
    for step, out in exported.items():
        number = 6 if step == "latest" else int(step)  # each step its own weights: 2, 4 and 6
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        [state] = (ckpt / f"global_step_{number}" / "actor" / "arctic" / f"checkpoint-{number}").glob("*/state.pt")
        saved = torch.load(state, weights_only=True)["model"]
        for name, weight in model.items():
            assert torch.equal(weight, saved[name]), (step, name)
        moved[step] = max((model[name] - w).abs().max().item() for name, w in initial.state_dict().items())
    assert moved["2"] > 0 and moved["latest"] > 0 and moved["2"] != moved["latest"], moved
