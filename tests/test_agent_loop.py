"""verl-remote's agent loop (integration/agent_loop.py) against verl's own, on the same prompts, server and reward:
every trajectory it puts into TransferQueue holds what verl's ``SingleTurnAgentLoop`` and ``AgentLoopWorkerTQ``
put there, field for field, and every prompt's status ends as verl's does, a failed group included."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from verl_remote.demo import resolve_demo_assets
from verl_remote.discovery.compose import compose_config

PROMPTS = 6
N = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A run's config, Ray with TransferQueue, the echo backend's deterministic rollout server and verl's client
    of it, as verl's trainer makes them."""
    import ray
    import transfer_queue as tq
    from omegaconf import open_dict
    from verl_remote_echo_backend.server import EchoServer

    from verl_remote.integration.client import OneServerClient
    from verl_remote.integration.handoff import attach
    from verl_remote.integration.rollout import _plain
    from verl_remote.integration.server import RemoteRolloutServer  # noqa: F401 (the base's module, verl-free)

    folder = tmp_path_factory.mktemp("agent-loop")
    config = compose_config(
        ["remote_backend=echo", f"remote_backend.state_dir={folder}", f"actor_rollout_ref.rollout.n={N}"],
        recipe="demo",
    )
    resolve_demo_assets(config)
    with open_dict(config):
        config.transfer_queue.enable = True
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        tq.init(config.transfer_queue)
        from verl_remote.discovery.registry import load_backend_class

        backend = load_backend_class("echo").from_config(config)
        attach(config, "echo", backend.reconnect_handle())
        rollout = config.actor_rollout_ref.rollout
        server = (
            ray.remote(EchoServer)
            .options(num_cpus=0, max_concurrency=64)
            .remote(_plain(rollout), config.actor_rollout_ref.model, 0)
        )
        ray.get(server.ready.remote())
        client = OneServerClient(config, servers={"echo": server})
        yield {"config": config, "client": client, "server": server}
    finally:
        import transfer_queue as tq

        tq.close()
        ray.shutdown()


def _batch(config: Any, first: int = 0) -> Any:
    """The demo's first prompts as verl's trainer hands them to an agent-loop manager (its data set, its collate,
    a uid per prompt, the step)."""
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils import hf_tokenizer
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import collate_fn

    tokenizer = hf_tokenizer(str(config.actor_rollout_ref.model.path))
    dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None, is_train=True)
    batch_dict = collate_fn([dataset[i] for i in range(first, first + PROMPTS)])
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(PROMPTS)], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    return batch


def _statuses(uids: list[str], partition: str = "train", timeout_s: float = 60) -> dict[str, str]:
    import transfer_queue as tq

    deadline = time.monotonic() + timeout_s
    while True:
        tags = tq.kv_list(partition).get(partition, {})
        found = {uid: tags.get(uid, {}).get("status") for uid in uids}
        if all(status in ("finished", "failure") for status in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _by_verl(run: dict[str, Any], batch: Any) -> None:
    """verl's own agent-loop worker on ``batch``, in this process, with a reward worker of verl's."""
    import ray
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    reward = ray.remote(RewardLoopWorker).options(num_cpus=0).remote(run["config"], None)

    async def work() -> None:
        worker = AgentLoopWorkerTQ.__ray_actor_class__(run["config"], run["client"], None, [reward])
        await worker.generate_sequences(batch)
        while worker.background_tasks:
            await asyncio.gather(*list(worker.background_tasks))

    asyncio.run(work())
    ray.kill(reward)


def _comparable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _rows(keys: list[str]) -> list[dict[str, Any]]:
    """Each key's trajectory as TransferQueue gives it back, field by field (the timings and the uid aside)."""
    import transfer_queue as tq

    got = tq.kv_batch_get(keys=keys, partition_id="train")
    rows = []
    for i in range(len(keys)):
        row = {}
        for name in got.keys():  # noqa: SIM118 (iterating a TensorDict walks its rows)
            value = got[name][i]
            value = getattr(value, "data", value)
            if name == "metrics":
                value = sorted(dict(value))  # which timings, not their values
            if name != "uid":
                row[name] = _comparable(value)
        rows.append(row)
    return rows


def _failures(run: dict[str, Any]) -> list[tuple[str, bool]]:
    """The server's failed requests, each one's first words and whether it was transient."""
    import ray

    return [(said.split(" whose")[0], transient) for said, transient in ray.get(run["server"].take_failures.remote())]


def test_the_batched_agent_loop_stores_what_verls_own_stores(run: dict[str, Any]) -> None:
    import transfer_queue as tq

    from verl_remote.integration.agent_loop import GroupSampler

    theirs = _batch(run["config"])
    ours = _batch(run["config"])  # the same prompts, other uids
    _by_verl(run, theirs)
    sampler = GroupSampler(run["config"], run["client"])
    try:
        assert sampler.takes(ours)
        sampler.submit(ours)
        their_uids, our_uids = list(theirs["uid"]), list(ours["uid"])
        their_status, our_status = _statuses(their_uids), _statuses(our_uids)
        # The echo server refuses some prompts: their groups fail, the others finish, in both.
        assert [their_status[u] for u in their_uids] == [our_status[u] for u in our_uids]
        assert set(our_status.values()) == {"finished", "failure"}, our_status
        done = [(a, b) for a, b in zip(their_uids, our_uids, strict=True) if our_status[b] == "finished"]
        keys = [(f"{a}_{s}_0", f"{b}_{s}_0") for a, b in done for s in range(N)]
        verl_rows, our_rows = _rows([a for a, _ in keys]), _rows([b for _, b in keys])
        differ = [
            (key, name, theirs_row.get(name), our_row.get(name))
            for (key, _), theirs_row, our_row in zip(keys, verl_rows, our_rows, strict=True)
            for name in sorted(set(theirs_row) | set(our_row))
            if theirs_row.get(name) != our_row.get(name)
        ]
        assert differ == []
        assert len({tuple(r["responses"]) for r in our_rows}) > 1  # lengths and tokens differ between prompts
        assert any(r["rm_scores"][-1] != 0 for r in our_rows) or all(r["rm_scores"][-1] == 0 for r in verl_rows)
        tags = tq.kv_list("train")["train"]
        for a, b in keys:
            assert tags[a] == tags[b]
        failed = [(a, b) for a, b in zip(their_uids, our_uids, strict=True) if our_status[b] == "failure"]
        for a, b in failed:  # no trajectory of a failed group
            assert not [k for k in tags if k.startswith(f"{a}_") or k.startswith(f"{b}_")]
        assert _failures(run) == [("EchoRefusal: echo: a prompt", False)] * (2 * N * len(failed))
    finally:
        sampler.close()


def test_requests_that_start_while_the_weights_sync_beside_a_step_wait_for_the_new_weights(run: dict[str, Any]) -> None:
    """The rollout server's hold (RemotePPOTrainer._sync_beside_next_step): a request that arrives after
    ``hold_requests`` samples, and is tagged with, the version published next, not the one before; a sync that
    did not finish lets it go on the version it had. Ray starts one caller's calls to an actor in order, and a
    request takes its first version before its first wait, so without the hold it would read the old one. A new
    version clears what the server cached of the weights before (verl's clear_kv_cache: Arctic's prefix cache)."""
    import ray

    server = run["server"]
    prompt = [1, 2]  # sums to 3: the echo server answers it
    ray.get(server.set_global_steps.remote(3))
    clears = ray.get(server.cleared.remote())
    ray.get(server.hold_requests.remote())
    held = server.generate_group.remote(prompt, {"temperature": 1.0, "logprobs": True}, 2)
    ray.get(server.set_global_steps.remote(4))  # the sync's new weights, published
    for sample in ray.get(held, timeout=60):
        assert sample["extra_fields"] == {"global_steps": 4, "min_global_steps": 4, "max_global_steps": 4}
    assert ray.get(server.cleared.remote()) == clears + 1  # what it cached of version 3, cleared before it sampled
    ray.get(server.set_global_steps.remote(4))
    assert ray.get(server.cleared.remote()) == clears + 1  # the same weights: nothing to clear

    ray.get(server.hold_requests.remote())
    held = server.generate_group.remote(prompt, {"temperature": 1.0, "logprobs": True}, 1)
    ray.get(server.release_requests.remote())  # the sync failed: the request goes on the weights it had
    assert [s["extra_fields"]["min_global_steps"] for s in ray.get(held, timeout=60)] == [4]

    unheld = server.generate_group.remote(prompt, {"temperature": 1.0, "logprobs": True}, 1)
    ray.get(server.set_global_steps.remote(5))
    assert [s["extra_fields"]["min_global_steps"] for s in ray.get(unheld, timeout=60)] == [4]  # no hold: at once
