"""verl-tinker against SkyRL's real Tinker-API server (``skyrl[tinker,jax]==0.4.0``), not a fake of it.

The server runs in its own Python 3.12 environment (the ``tinker_server`` fixture in tests/conftest.py); the
runs reach it only through ``remote_backend.base_url``, as a user's would. Its database (SQLite, in the
server's work folder) tells which models a run left loaded.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from conftest import cli, free_port, read_until, steps
from verl_remote.compose import compose_config
from verl_remote.compute import actor_loss
from verl_tinker.local_server import LocalServer, start_local_server
from verl_tinker.session import TinkerSession
from verl_tinker.worker import linearised_datums

pytestmark = [pytest.mark.tinker, pytest.mark.train]

QUICK = ["trainer.val_before_train=false", "trainer.test_freq=-1"]


def _loaded(server: LocalServer) -> list[str]:
    """The models the server holds (created and not unloaded)."""
    with sqlite3.connect(server.workdir / "tinker.db") as db:
        return [m for (m,) in db.execute("select model_id from models where status != 'unloaded'")]


def _train(tmp_path: Path, url: str, *overrides: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    args = ["train", "remote_backend=tinker", f"remote_backend.base_url={url}", *QUICK]
    return cli(*args, f"trainer.default_local_dir={tmp_path / 'ckpt'}", *overrides, cwd=tmp_path, timeout=timeout)


def _start(tmp_path: Path, url: str, *overrides: str) -> subprocess.Popen[str]:
    script = str(Path(sys.executable).parent / "verl-remote")
    args = ["train", "remote_backend=tinker", f"remote_backend.base_url={url}", *QUICK]
    args += [f"trainer.default_local_dir={tmp_path / 'ckpt'}", *overrides]
    return subprocess.Popen([script, *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_verl_tinker_passes_every_conformance_check(
    tinker_server: LocalServer, tmp_path: Path, ray_left_behind: Any
) -> None:
    out = cli("check", "tinker", f"remote_backend.base_url={tinker_server.url}", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    marks = re.findall(r"^\[(ok  |FAIL|skip)\] (\w+)", out.stdout, re.M)
    assert len(marks) == 13 and all(mark == "ok  " for mark, _ in marks), out.stdout
    assert ray_left_behind() == {}
    assert _loaded(tinker_server) == []


def test_the_gradient_the_service_applies_is_verls(tinker_server: LocalServer) -> None:
    """verl's loss sent as a linearised importance-sampling loss moves the model exactly as the service's own
    cross_entropy loss does when the two objectives are the same function: here verl's vanilla PPO loss at
    ratio 1 with unit advantages and seq-mean-token-mean aggregation, and SkyRL's per-sequence-mean cross
    entropy. Same LoRA seed, so the gradient norms the service reports must agree."""
    rows = [[3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 11, 12, 13], [3, 14, 15, 16, 17, 18]]
    responses = [3, 2, 4]
    settings = {
        "base_url": tinker_server.url, "api_key_env": "TINKER_API_KEY", "timeout_s": 120, "max_retries": 1,
        "lora_rank": 4, "lora_seed": 7, "train_mlp": True, "train_attn": True, "train_unembed": True,
    }  # fmt: skip
    optim = {"lr": 1e-2, "betas": [0.9, 0.999], "weight_decay": 0.0, "clip_grad": 0.0, "total_training_steps": 2}
    actor = compose_config(
        ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.ppo_mini_batch_size=3"]
    ).actor_rollout_ref.actor

    def jagged(values: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.nested.nested_tensor([torch.tensor(v, dtype=dtype) for v in values], layout=torch.jagged)

    async def ours() -> tuple[list[float], list[np.ndarray]]:
        session = TinkerSession(settings, tinker_server.model, optim)
        await session.start()
        norms = []
        for _ in range(2):
            current = await session.forward(rows)
            old = [lp[len(row) - r - 1 :].tolist() for row, lp, r in zip(rows, current, responses, strict=True)]
            batch = {
                "input_ids": jagged([[float(t) for t in row] for row in rows]).to(torch.long),
                "prompts": jagged([row[: len(row) - r] for row, r in zip(rows, responses, strict=True)]).to(torch.long),
                "responses": jagged([row[len(row) - r :] for row, r in zip(rows, responses, strict=True)]).to(
                    torch.long
                ),
                "response_mask": jagged([[1.0] * r for r in responses]),
                "old_log_probs": jagged(old),
                "advantages": jagged([[1.0] * r for r in responses]),
            }
            leaf = torch.tensor(np.concatenate([np.append(v, 0.0) for v in current]), requires_grad=True)
            log_probs = torch.nested.nested_tensor_from_jagged(leaf.float(), batch["input_ids"].offsets())
            meta = {"dp_size": 1, "batch_num_tokens": sum(responses), "global_batch_size": 3}
            loss, _ = actor_loss(log_probs, batch, meta, actor)
            loss.backward()
            assert leaf.grad is not None
            reduction = "sequence_mean"  # SkyRL's (what auto resolves to for this server)
            await session.submit_forward_backward(
                linearised_datums(rows, current, leaf.grad.numpy(), batch["response_mask"], reduction)
            )
            norms.append((await session.optim_step())["grad_norm"])
        after = await session.forward(rows)
        await session.close()
        return norms, after

    async def builtin() -> tuple[list[float], list[np.ndarray]]:
        from tinker import types

        session = TinkerSession(settings, tinker_server.model, optim)
        await session.start()
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=row[1:], dtype="int64"),
                    "weights": types.TensorData(data=[0.0] * (len(row) - 1 - r) + [1.0] * r, dtype="float32"),
                },
            )
            for row, r in zip(rows, responses, strict=True)
        ]
        norms = []
        for _ in range(2):
            step = session.training.forward_backward(data, "cross_entropy")
            adam = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
            done = session.training.optim_step(adam)
            await step.result_async()
            norms.append(float((await done.result_async()).metrics["skyrl.ai/grad_norm"]))
        after = await session.forward(rows)
        await session.close()
        return norms, after

    our_norms, our_after = asyncio.run(ours())
    their_norms, their_after = asyncio.run(builtin())
    assert our_norms[0] > 0.01
    np.testing.assert_allclose(our_norms, their_norms, rtol=2e-4)
    for a, b in zip(our_after, their_after, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)
    assert _loaded(tinker_server) == []


def test_two_steps_then_resume_at_step_three_with_the_same_weights(
    tinker_server: LocalServer, tmp_path: Path, ray_left_behind: Any
) -> None:
    first = _train(tmp_path, tinker_server.url, "trainer.total_training_steps=2", "trainer.save_freq=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert steps(first.stdout) == [1, 2]
    # The sampler got the trained weights each step: its log-probs are the trainer's.
    diffs = [float(v) for v in re.findall(r"training/rollout_probs_diff_max:([0-9.e-]+)", first.stdout)]
    assert len(diffs) == 2 and max(diffs) < 1e-4
    record = json.loads((tmp_path / "ckpt" / "global_step_2" / "actor" / "tinker_checkpoint.json").read_text())
    assert record["step"] == 2 and record["tinker_path"].startswith("tinker://")
    assert _loaded(tinker_server) == []  # destroy unloaded the run's model
    assert ray_left_behind() == {}

    second = _train(tmp_path, tinker_server.url, "trainer.total_training_steps=3", "trainer.resume_mode=auto")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert steps(second.stdout) == [3]
    # Resumed from the service's own checkpoint (weights and optimizer): the first step's old log-probs are
    # those of the step-2 weights, so the sampler (synced on load) and the trainer agree from the start.
    diffs = [float(v) for v in re.findall(r"training/rollout_probs_diff_max:([0-9.e-]+)", second.stdout)]
    assert len(diffs) == 1 and diffs[0] < 1e-4
    assert _loaded(tinker_server) == []
    assert ray_left_behind() == {}


@pytest.mark.faults
def test_an_unreachable_service_fails_before_anything_starts(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    out = _train(tmp_path, dead, "trainer.total_training_steps=1", timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert f"remote_backend.base_url={dead}: nothing answers there" in last, last
    assert "verl_tinker.local_server" in last
    assert time.monotonic() - start < 60


@pytest.mark.faults
def test_a_service_error_mid_run_stops_the_run_in_one_line_and_leaves_nothing_running(
    tinker_server: LocalServer, tmp_path: Path, ray_left_behind: Any
) -> None:
    """The service loses the run's model between two steps (its stale-session cleanup does this): the next
    call fails with the service's own answer; the run stops, destroys its backend, leaves no process."""
    proc = _start(tmp_path, tinker_server.url, "trainer.total_training_steps=20")
    read_until(proc, "step:1 ")
    [model] = _loaded(tinker_server)
    answer = httpx.post(f"{tinker_server.url}/api/v1/unload_model", json={"model_id": model}, timeout=30)
    assert answer.status_code == 200, answer.text
    rest, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert last.startswith("verl-remote train: the run failed: "), last
    assert "Tinker call " in last and tinker_server.url in last, last
    assert ray_left_behind() == {}


@pytest.mark.faults
def test_a_service_killed_mid_run_stops_the_run_within_its_timeout(tmp_path: Path, ray_left_behind: Any) -> None:
    with start_local_server(workdir=tmp_path / "server") as server:
        proc = _start(tmp_path, server.url, "trainer.total_training_steps=20", "remote_backend.timeout_s=20")
        read_until(proc, "step:1 ")
        server.stop()  # the service goes away, as a crashed or preempted node does
        killed_at = time.monotonic()
        rest, _ = proc.communicate(timeout=600)
    failed_after = time.monotonic() - killed_at
    assert proc.returncode == 1, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert last.startswith("verl-remote train: the run failed: "), last
    assert "Tinker call " in last and server.url in last, last
    assert failed_after < 180, failed_after
    assert ray_left_behind() == {}
