"""verl-remote-tinker against SkyRL's real Tinker-API server (``skyrl[tinker,jax]==0.4.0``), not a fake of it.

The server runs in its own Python 3.12 environment (the ``tinker_server`` fixture in tests/conftest.py); the
runs reach it only through ``remote_backend.base_url``, as a user's would. Its database (SQLite, in the
server's work folder) tells which models a run left loaded.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import torch
from test_local_server import listening, session_processes, wait_gone

from conftest import (
    assert_two_turn_run,
    cli,
    finish,
    free_port,
    last_line,
    live_actors,
    metric,
    read_until,
    run_log,
    start,
    step_row,
    steps,
    train,
    two_turn,
)
from verl_remote import SamplingParams
from verl_remote.demo import resolve_demo_assets
from verl_remote.discovery.compose import compose_config
from verl_remote.kit.compute import actor_loss
from verl_remote_tinker.backend import SKYRL_LIVE_SAMPLER, TinkerBackend
from verl_remote_tinker.session import SDK_RANGE, TinkerError, TinkerSession
from verl_remote_tinker.testing.local_server import LocalServer
from verl_remote_tinker.testing.proxy import Fault, TinkerProxy
from verl_remote_tinker.worker import linearised_datums

pytestmark = [pytest.mark.tinker, pytest.mark.train]


def _loaded(server: LocalServer) -> list[str]:
    """The models the server holds: created and not unloaded. A model whose creation failed holds nothing,
    though SkyRL's table keeps its row as 'created' (skyrl/tinker/api.py create_model writes the row before its
    engine runs the request, and the engine only marks the request failed)."""
    query = (
        "select m.model_id from models m join futures f on f.request_id = m.request_id "
        "where m.status != 'unloaded' and lower(f.status) != 'failed'"
    )
    with sqlite3.connect(server.workdir / "tinker.db") as db:
        return [m for (m,) in db.execute(query) if m not in LOST]


def _unload(server: LocalServer, model: str) -> None:
    """Unload ``model`` through the server's own route, and wait until its engine has (a request in its turn)."""
    answer = httpx.post(f"{server.url}/api/v1/unload_model", json={"model_id": model}, timeout=30)
    assert answer.status_code == 200, answer.text
    deadline = time.monotonic() + 60
    while model in _loaded(server):
        assert time.monotonic() < deadline, _loaded(server)
        time.sleep(0.2)


#: Models a test unloaded behind a session's back. Closing that session asks to unload it again, which the
#: server accepts and its engine then fails (the model is not loaded): its row stays 'unloading'.
LOST: set[str] = set()


#: An API key as a hosted service's would be: it must reach the service and nothing else.
SECRET = {"TINKER_API_KEY": "tml-verl-remote-test-key-4f1c9e"}


def _tinker(url: str) -> list[str]:
    return ["remote_backend=tinker", f"remote_backend.base_url={url}"]


def test_full_fine_tuning_is_refused_in_one_line_where_the_service_does_not_offer_it(
    tinker_server: LocalServer, ray_instance: Any
) -> None:
    """lora_rank 0, which SkyRL's server does not offer: one line before any step. (The conformance checks run
    against this server with the newest SDK of the range, in tests/test_fresh_venv.py; with this environment's,
    the oldest, the two-step run and its resume below make a run's calls: sample, forward, forward-backward,
    optimizer step, sampler sync, and the save and load of the service's state.)"""
    config = compose_config([*_tinker(tinker_server.url), "remote_backend.lora_rank=0"], recipe="demo")
    resolve_demo_assets(config)
    with pytest.raises(RuntimeError) as refused:
        TinkerBackend.from_config(config)
    said = str(refused.value)
    assert said.startswith(
        f"verl-remote-tinker: remote_backend.lora_rank=0 asks for full fine-tuning, which the service at "
        f"{tinker_server.url} does not offer ("
    ), said
    assert "LoRA rank 0 must be between 1 and 32" in said and "\n" not in said, said
    assert live_actors() == []  # the session's actor (from_config starts one on this Ray) went with the refusal
    assert _loaded(tinker_server) == []


def _session_settings(server: LocalServer) -> dict[str, Any]:
    """A session's settings, as the backend gives them, for the tests that drive one in this process."""
    return {
        "base_url": server.url, "api_key_env": "TINKER_API_KEY", "timeout_s": 120, "max_retries": 1,
        "lora_rank": 4, "lora_seed": 7, "train_mlp": True, "train_attn": True, "train_unembed": True,
    }  # fmt: skip


def test_the_gradient_the_service_applies_is_verls(tinker_server: LocalServer) -> None:
    """verl's loss sent as a linearised importance-sampling loss moves the model exactly as the service's own
    cross_entropy loss does when the two objectives are the same function: here verl's vanilla PPO loss at
    ratio 1 with unit advantages and seq-mean-token-mean aggregation, and SkyRL's per-sequence-mean cross
    entropy. Same LoRA seed, so the gradient norms the service reports must agree."""
    rows = [[3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 11, 12, 13], [3, 14, 15, 16, 17, 18]]
    responses = [3, 2, 4]
    settings = _session_settings(tinker_server)
    optim = {"lr": 1e-2, "betas": [0.9, 0.999], "weight_decay": 0.0, "clip_grad": 0.0, "total_training_steps": 2}
    actor = compose_config(
        ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
        recipe="demo",
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
        # Then the service loses the model between two calls (its stale-session cleanup does this): the next call
        # fails in the service's own words, naming the call and the service; the session still closes.
        [model] = _loaded(tinker_server)
        _unload(tinker_server, model)
        LOST.add(model)
        try:
            with pytest.raises(TinkerError) as lost:
                await session.forward([row[:-1] for row in rows])  # rows not asked for before: not cached
        finally:
            await session.close()
        assert "Tinker call forward " in str(lost.value) and tinker_server.url in str(lost.value), str(lost.value)
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


@pytest.mark.faults
def test_an_overlapped_session_scores_the_next_steps_rows_behind_the_step_at_the_weights_it_makes(
    tinker_server: LocalServer,
) -> None:
    """In an overlapped run the rows sampled while a step trains are the next step's, whose old log-probs are
    those of the weights the step makes: the session queues one forward pass over them right behind the step's
    optimizer step (before the step's answer, and behind it in the service's own order), the sampler's save
    behind the step too, and the next step's ``forward`` is answered from that pass with what a pass asked then
    answers. A greedy (validation) sample is not scored ahead."""
    settings = {**_session_settings(tinker_server), "overlap": True}
    optim = {"lr": 5e-2, "betas": [0.9, 0.999], "weight_decay": 0.0, "clip_grad": 0.0, "total_training_steps": 2}

    def params(temperature: float) -> SamplingParams:
        return SamplingParams(max_tokens=4, temperature=temperature, top_p=1.0, top_k=-1, stop_token_ids=())

    async def run() -> tuple[Any, ...]:
        session = TinkerSession(settings, tinker_server.model, optim)
        await session.start()
        try:
            trained = [[3, 4, 5] + s["tokens"] for s in await session.sample_group([3, 4, 5], params(1.0), 2)]
            nxt = [[6, 7, 8, 9] + s["tokens"] for s in await session.sample_group([6, 7, 8, 9], params(1.0), 4)]
            await session.sample_group([10, 11], params(0.0), 1)
            before = await session.forward(trained)  # this step's rows, at the weights it trains
            datums = [
                {"input": row[:-1], "target": row[1:], "weights": [1.0] * (len(row) - 1),
                 "logprobs": lp.tolist(), "advantages": [1.0] * (len(row) - 1)}
                for row, lp in zip(trained, before, strict=True)
            ]  # fmt: skip
            await session.submit_forward_backward(datums)
            metrics = await session.optim_step()
            ahead = await session.forward(nxt)
            info = await session.info()
            session.scores.clear()  # asked again, a pass of its own
            again, after = await session.forward(nxt), await session.forward(trained)
            return nxt, metrics, ahead, info, again, before, after, str(session.training.model_id)
        finally:
            await session.close()

    nxt, metrics, ahead, info, again, before, after, model = asyncio.run(run())
    assert metrics["old_log_probs_ahead"] == 0.0  # this step's own rows were sampled before it: asked, not ahead
    # the next step's rows, and not the greedy one, were scored ahead, and the next step's forward found them all
    assert info["scored_ahead"] == {"rows": len({tuple(row) for row in nxt}), "used": len({tuple(row) for row in nxt})}
    for a, b in zip(ahead, again, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert any(np.abs(a - b).max() > 1e-3 for a, b in zip(before, after, strict=True))  # the step moved the weights
    with sqlite3.connect(tinker_server.workdir / "tinker.db") as db:
        order = [t for (t,) in db.execute(
            "select request_type from futures where model_id = ? order by request_id", (model,)
        )]  # fmt: skip
    step = order.index("OPTIM_STEP")
    # behind the step, in the service's order: the sampler's save and the next step's rows, one pass
    assert order[step + 1 : step + 3] == ["SAVE_WEIGHTS_FOR_SAMPLER", "FORWARD"], order
    assert order.count("FORWARD") == 4, order  # this step's rows, the next step's ahead, both asked again


def test_a_rate_limit_and_a_paused_queue_are_waited_out_with_one_line_each_until_the_timeout(
    tinker_server: LocalServer,
) -> None:
    """What hosted services answer and SkyRL's server does not, from a proxy in front of it (its docstring traces
    each answer to the SDK's code): HTTP 429 with Retry-After on a sample request, which the SDK retries; HTTP
    408 with a paused queue state on a result's poll, which the SDK polls on. Each is waited out with one line;
    a rate limit that outlasts remote_backend.timeout_s ends the call at that timeout. Then a service that
    refuses the SDK's version is named in one line with the installed version and the fix."""
    settings = {
        "base_url": "", "api_key_env": "TINKER_API_KEY", "timeout_s": 60, "max_retries": None,
        "lora_rank": 4, "lora_seed": 7, "train_mlp": True, "train_attn": True, "train_unembed": True,
    }  # fmt: skip
    optim = {"lr": 1e-2, "betas": [0.9, 0.999], "weight_decay": 0.0, "clip_grad": 0.0, "total_training_steps": 2}
    said: list[str] = []
    limited = {"detail": "Rate limit exceeded"}
    paused = {
        "type": "try_again",
        "queue_state": "paused_rate_limit",
        "queue_state_reason": "concurrent LoRA rate limit",
    }

    async def conversation(proxy: TinkerProxy) -> None:
        session = TinkerSession({**settings, "base_url": proxy.url}, tinker_server.model, optim)
        await session.start()
        session.pauses.say = said.append
        try:
            proxy.inject(Fault("/api/v1/asample", 429, times=3, headers={"Retry-After": "1"}, body=limited))
            began = time.monotonic()
            answer = await session.sample([3, 4, 5], SamplingParams(max_tokens=4))
            assert len(answer["tokens"]) == 4 and time.monotonic() - began >= 3  # three waits of Retry-After's 1 s
            assert len(said) == 1, said
            assert said[0] == (
                f"verl-remote-tinker: the service at {proxy.url} paused requests (asample) (HTTP 429, rate limit; "
                "Retry-After 1 s); the SDK waits and retries, the run waits at most remote_backend.timeout_s=60 s "
                "per call"
            )

            proxy.inject(Fault("/api/v1/retrieve_future", 408, times=3, body=paused))
            out = await session.forward([[3, 4, 5, 6, 7]])
            assert out[0].shape == (4,)
            assert len(said) == 2 and "paused training (concurrent LoRA rate limit)" in said[1], said

            session.settings["timeout_s"] = 5
            proxy.inject(Fault("/api/v1/asample", 429, times=10**6, headers={"Retry-After": "1"}, body=limited))
            began = time.monotonic()
            with pytest.raises(TinkerError, match=r"Tinker call sample .*: no answer within 5 s"):
                await session.sample([3, 4, 6], SamplingParams(max_tokens=4))
            assert 5 <= time.monotonic() - began < 15
            assert len(said) == 3, said
            proxy.faults.clear()
        finally:
            session.settings["timeout_s"] = 60
            await session.close()

    with TinkerProxy(tinker_server.url) as proxy:
        asyncio.run(conversation(proxy))
        assert _loaded(tinker_server) == []
        # A service that no longer supports the installed SDK (hosted Tinker answers HTTP 400).
        proxy.inject(Fault("", 400, times=10**6, body={"detail": "SDK version no longer supported, please upgrade"}))
        with pytest.raises(TinkerError) as refused:
            asyncio.run(TinkerSession({**settings, "base_url": proxy.url}, tinker_server.model, optim).start())
    import tinker

    assert str(refused.value) == (
        f"the service at {proxy.url} refuses tinker SDK {tinker.__version__} (HTTP 400: SDK version no longer "
        f"supported, please upgrade); install the SDK it asks for, within verl-remote-tinker's range: pip install "
        f"'tinker{SDK_RANGE}' (the newest there), or, if the service needs a newer SDK than that range, a newer "
        "verl-remote-tinker"
    )


@pytest.mark.faults
def test_an_unreachable_service_fails_before_anything_starts(cli_main: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    code, _out, err = cli_main("train", *_tinker(dead), "trainer.total_training_steps=1")
    assert code == 2, err[-3000:]
    last = last_line(err)
    assert f"remote_backend.base_url={dead}: nothing answers there" in last, last
    assert "verl_remote_tinker.local_server" in last
    assert time.monotonic() - began < 60


def test_the_sdk_trains_on_the_server_whose_engine_runs_in_its_session(tinker_server: LocalServer) -> None:
    """An SDK client alone trains on the module's server; ready means the engine has the model loaded."""
    import tinker
    from tinker import types

    commands = [" ".join(p.cmdline()) for p in session_processes(tinker_server.pid)]
    assert any("skyrl.tinker.api" in c for c in commands), commands
    assert any("skyrl.tinker.engine" in c for c in commands), commands  # the engine is in the same session

    service = tinker.ServiceClient(base_url=tinker_server.url, api_key="tml-local")
    began = time.monotonic()
    training = service.create_lora_training_client(base_model=tinker_server.model, rank=8, seed=0)
    assert time.monotonic() - began < 60
    tokens = [5, 9, 12, 7, 3, 8, 10, 11]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
            "weights": types.TensorData(data=[0.0] * 4 + [1.0] * 3, dtype="float32"),
        },
    )
    out = training.forward([datum], "cross_entropy").result()
    logprobs = np.asarray(out.loss_fn_outputs[0]["logprobs"].data)
    assert logprobs.shape == (7,)
    assert np.isfinite(logprobs).all() and (logprobs <= 0).all()

    # Its sampling client is no snapshot: it samples the adapter in memory, which the next optimizer step
    # changes (skyrl 0.4.0 backends/jax.py:1031-1034), so the backend declines overlapped runs on this server
    # (TinkerBackend.cannot_overlap; hosted Tinker's SamplingClient keeps the weights it was saved from).
    sampler = training.save_weights_and_get_sampling_client()

    def sampled() -> np.ndarray:  # one value per next token (SkyRL leaves out the first token's None)
        return np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[-7:], dtype=float)

    synced = sampled()
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    after = sampled()
    trained = np.asarray(training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
    assert np.abs(after - synced).max() > 1e-3  # the step moved what the saved sampler samples
    assert np.abs(after - trained).max() < 1e-4  # to the trainer's weights
    [model] = _loaded(tinker_server)
    _unload(tinker_server, model)  # the server holds nothing for the next test
    service.holder.close()  # the SDK's session heartbeat


@pytest.mark.faults
def test_two_steps_then_resume_at_step_three_with_the_same_weights_until_the_service_goes_away(
    tinker_server: LocalServer, tmp_path: Path, ray_left_behind: Any
) -> None:
    # The first run meets a rate limit, as hosted Tinker answers one (a proxy in front of the server): the SDK
    # waits it out, the console says so once. It asks for an overlapped run, which the backend declines on
    # SkyRL's server (its sampler is the adapter it trains, no snapshot): one line, then a synchronous run.
    with TinkerProxy(tinker_server.url) as limited:
        limited.inject(Fault("/api/v1/asample", 429, headers={"Retry-After": "1"}, body={"detail": "Rate limit"}))
        first = train(
            tmp_path, *_tinker(limited.url), *two_turn(), "trainer.total_training_steps=2", "trainer.save_freq=2",
            "trainer.v1.trainer_mode=remote_async", "algorithm.adv_estimator=grpo_passk", env=SECRET,
        )  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    declined = [line for line in first.stdout.splitlines() if "cannot sample while it trains" in line]
    assert len(declined) == 1, declined
    assert (
        f"verl-remote: backend 'tinker' cannot sample while it trains ({SKYRL_LIVE_SAMPLER}): this run is "
        "synchronous (trainer.v1.trainer_mode=remote)"
    ) in declined[0], declined
    assert steps(first.stdout) == [1, 2]
    assert limited.api_keys == {SECRET["TINKER_API_KEY"]}  # the key reached the service, and only that key
    paused = [line for line in (first.stdout + first.stderr).splitlines() if "paused requests (asample)" in line]
    assert len(paused) == 1, paused
    assert f"verl-remote-tinker: the service at {limited.url} paused requests (asample) (HTTP 429" in paused[0]
    # Where the time went: each step's waits on the service and their share of verl's time for the phase.
    log = run_log(tmp_path / "ckpt")
    assert "'adv_estimator': 'grpo_passk'" in log  # an estimator other than the default (tests/test_estimators.py)
    for phase in ("gen", "old_log_prob", "update_actor", "update_weights"):
        waited, share = metric(log, f"service/wait_s/{phase}"), metric(log, f"service/wait_share/{phase}")
        assert len(waited) == 2 and all(w > 0 for w in waited), (phase, waited)
        assert len(share) == 2 and all(0 < x <= 1.05 for x in share), (phase, share)  # a part of the phase's time
    waits = first.stdout.strip().splitlines()[-2]
    assert re.fullmatch(
        r"verl-remote: waiting on the service took \d+% of generation, \d+% of the old log-probs, \d+% of the update, "
        r"\d+% of the weight sync, \d+% of the checkpoint \(medians over 2 steps\)",
        waits,
    ), waits
    # The sampler got the trained weights each step: its log-probs are the trainer's, turn after turn of the
    # tests' multi-turn agent loop.
    assert_two_turn_run(run_log(tmp_path / "ckpt"), steps=2)
    record = json.loads((tmp_path / "ckpt" / "global_step_2" / "actor" / "tinker_checkpoint.json").read_text())
    assert record["step"] == 2 and record["tinker_path"].startswith("tinker://")
    assert _loaded(tinker_server) == []  # destroy unloaded the run's model
    assert ray_left_behind() == {}
    _export_the_step_two_ways(tinker_server, tmp_path, limited.url)

    # Resumed, overlapped (trainer.v1.trainer_mode=remote_async: each next step sampled while this one trains;
    # remote_backend.snapshot_sampling=true takes SkyRL's server for a snapshot service, as hosted Tinker is, to
    # run the overlapped path), and then the service goes away mid-run with every process it started, as a
    # crashed or preempted node does (this ends the module's server: this test comes last).
    server = tinker_server
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    processes = session_processes(server.pid)
    try:
        proc = start(
            tmp_path, *_tinker(server.url), "trainer.total_training_steps=20", "trainer.resume_mode=auto",
            "remote_backend.timeout_s=30", "trainer.v1.trainer_mode=remote_async",
            "remote_backend.snapshot_sampling=true", "trainer.save_freq=2", "remote_restart.max=1",
            "remote_restart.backoff_s=1", env=SECRET,
        )  # fmt: skip
        resumed = "".join(read_until(proc, step_row(4)))
        # The service loses the run's model behind its back (its stale-session cleanup does this, as does a
        # restart): a transient fault, so the run restarts from step 4's checkpoint in a new model.
        lost = _loaded(server)
        for model in lost:
            _unload(server, model)
            LOST.add(model)
        resumed += "".join(read_until(proc, step_row(6)))
        # Each step trained once, through the resume and the restart: the service's own record of its requests
        # shows one optimizer step a step (the demo's batch is one mini-batch) behind each checkpoint.
        behind = {}
        for step in (2, 4, 6):
            record = tmp_path / "ckpt" / f"global_step_{step}" / "actor" / "tinker_checkpoint.json"
            behind[step] = _optimizer_steps(server, json.loads(record.read_text())["tinker_path"])
        assert behind == {2: 2, 4: 4, 6: 6}, behind
    finally:
        server.stop()
    killed_at = time.monotonic()
    assert steps(resumed) == [3, 4, 5, 6], resumed[-3000:]
    [restart] = [line for line in resumed.splitlines() if line.startswith("verl-remote: restart ")]
    assert restart.startswith("verl-remote: restart 1 of 1 in 1 s, from global_step_4: a transient fault at step 5: ")
    assert "Tinker call " in restart and re.search(r"Model \S+ not loaded", restart), restart
    # Resumed from the service's own checkpoint (weights and optimizer): the first step's old log-probs are those
    # of the step-2 weights, so the sampler (synced on load) and the trainer agree from the start. The restart
    # resumes step 4's checkpoint of this overlapped run, with the prompts it had in flight then (verl's
    # TransferQueue state), sampled on step 3's weights or step 4's: at most one update old, as any step.
    log = run_log(tmp_path / "ckpt")
    diffs = metric(log, "training/rollout_probs_diff_max")
    assert len(diffs) >= 3 and diffs[0] < 1e-4, diffs
    staleness = metric(log, "training/off_policy/trajectory_staleness/max")
    assert staleness[0] == 0 and max(staleness) <= 1, staleness
    # The session scored the next step's rows behind each step (the share of a step's old log-probs it found
    # scored ahead): the first step of each session sampled before any step of its own, and later ones found
    # theirs there.
    ahead = metric(log, "actor/old_log_probs_ahead")
    assert len(ahead) >= 3 and ahead[0] == 0 and all(0 <= x <= 1 for x in ahead), ahead
    assert max(ahead) == 1, ahead
    assert metric(log, "verl_remote/restarts")[:3] == [0, 0, 1]
    assert "cannot sample while it trains" not in resumed

    # The next call fails within the run's timeout, transient but with the run's one restart used: the run stops,
    # destroys its backend, leaves no process.
    rest = finish(proc, timeout=600)
    failed_after = time.monotonic() - killed_at
    assert proc.returncode == 1, rest[-3000:]
    assert "verl-remote: not restarted: a transient fault, after 1 restart (remote_restart.max=1)" in rest
    last = last_line(rest)
    assert last.startswith("verl-remote train: the run failed: "), last
    assert "Tinker call " in last and server.url in last, last
    assert failed_after < 120, failed_after
    assert ray_left_behind() == {}
    # Everything the server started is gone with it.
    assert wait_gone(server.pid, timeout=1) == []
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
    assert not listening(host, port)
    assert not server.workdir.exists()  # a temporary work directory is removed
    server.stop()  # idempotent

    # The API key (read from remote_backend.api_key_env in the session's process only) is in no output, log,
    # checkpoint record or error of either run.
    key = SECRET["TINKER_API_KEY"]
    assert key not in first.stdout + first.stderr + resumed + rest
    written = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file() and p.suffix in {".json", ".log", ".txt"}]
    assert any(p.name == "tinker_checkpoint.json" for p in written) and any(p.suffix == ".log" for p in written)
    assert [p for p in written if key in p.read_text(errors="replace")] == []


def _optimizer_steps(server: LocalServer, tinker_path: str) -> int:
    """The optimizer steps behind a training checkpoint of the service (``tinker://MODEL/weights/NAME``), from its
    database, where each request is a row in the order it came (skyrl 0.4.0 tinker/api.py, ``create_future``): those
    its model took before the save, and those behind the checkpoint the model was loaded from with its optimizer
    (a ``load_weights`` request, a new model's first: api.py ``load_weights``)."""
    model, kind, name = tinker_path.removeprefix("tinker://").split("/")
    assert kind == "weights", tinker_path
    done = "status = 'COMPLETED' and model_id = ?"
    with sqlite3.connect(server.workdir / "tinker.db") as db:
        [(save,)] = db.execute(
            f"select request_id from futures where {done} and request_type = 'SAVE_WEIGHTS' "
            "and json_extract(request_data, '$.path') = ?",
            (model, name),
        ).fetchall()
        [(taken,)] = db.execute(
            f"select count(*) from futures where {done} and request_type = 'OPTIM_STEP' and request_id < ?",
            (model, save),
        ).fetchall()
        loads = db.execute(
            f"select request_data from futures where {done} and request_type = 'LOAD_WEIGHTS'", (model,)
        ).fetchall()
    for (data,) in loads:
        source = json.loads(data)
        assert source["load_optimizer"], source
        taken += _optimizer_steps(server, f"tinker://{source['source_model_id']}/weights/{source['checkpoint_id']}")
    return int(taken)


def _export_the_step_two_ways(server: LocalServer, tmp_path: Path, recorded_url: str) -> None:
    """`verl-remote export` of the run's step 2, from the service: the LoRA merged into the base model, and alone
    as a PEFT folder. The run recorded the proxy's address, gone now: refused in one line, then exported with the
    service's address given. The merged model's log-probs are the service's for the same checkpoint (a session
    loads it); PEFT merges the adapter folder into the same weights; training moved them from the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ckpt"
    gone = cli("export", str(ckpt), "--out", str(tmp_path / "hf"), env=SECRET)
    assert gone.returncode == 2, gone.stderr[-3000:]
    assert f"remote_backend.base_url={recorded_url}: nothing answers there" in last_line(gone.stderr), gone.stderr
    for adapter in ([], ["--adapter"]):
        out = tmp_path / ("adapter" if adapter else "hf")
        done = cli(
            "export", str(ckpt), "--out", str(out), *adapter, f"remote_backend.base_url={server.url}", env=SECRET
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"verl-remote: exported step 2 to {out} (" in done.stdout
    assert _loaded(server) == []  # the export's training client, unloaded
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert SECRET["TINKER_API_KEY"] not in done.stdout + done.stderr

    rows = [[3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 11, 12, 13], [3, 14, 15, 16, 17, 18]]
    record = json.loads((ckpt / "global_step_2" / "actor" / "tinker_checkpoint.json").read_text())
    settings = {
        "base_url": server.url, "api_key_env": "TINKER_API_KEY", "timeout_s": 120, "max_retries": 1,
        "lora_rank": 4, "train_mlp": True, "train_attn": True, "train_unembed": True,
    }  # fmt: skip

    async def theirs() -> list[np.ndarray]:
        session = TinkerSession(settings, server.model, {"lr": 1e-2, "total_training_steps": 2})
        await session.start()
        try:
            await session.load({"tinker_path": record["tinker_path"], "schedule_steps": 0})
            return [np.asarray(v) for v in await session.forward(rows)]
        finally:
            await session.close()

    service = asyncio.run(theirs())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        for row, scored in zip(rows, service, strict=True):
            logits = merged(input_ids=torch.tensor([row])).logits[0]
            ours = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(row[1:])[:, None])[:, 0].numpy()
            assert np.abs(ours - scored[: len(row) - 1]).max() < 1e-4, (ours, scored)
    base = AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.float32)
    moved = max((merged.state_dict()[n] - w).abs().max().item() for n, w in base.state_dict().items())
    assert moved > 0, moved
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    for name, weight in merged.state_dict().items():
        assert torch.allclose(peft[name], weight, atol=1e-6), name
