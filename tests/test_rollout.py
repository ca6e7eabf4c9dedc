"""The rollout replica's sampling contract, enforced once for every backend (verl_remote.integration.rollout)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import live_actors
from verl_remote import SampleResult, SamplingParams
from verl_remote.kit.sampling import within_contract


def test_an_agent_loops_stop_ids_add_to_the_models_eos_and_end_the_response_after_the_first() -> None:
    # verl's tool agent loop adds its tool parser's stop ids to the request (tool_agent_loop.py, generating state).
    params = SamplingParams.from_verl(
        {"temperature": 0.7, "stop_token_ids": [9, 2], "logprobs": True}, max_tokens=6, stop_token_ids=[2]
    )
    assert params.stop_token_ids == (2, 9) and params.temperature == 0.7 and params.logprobs
    cut = within_contract(SampleResult([4, 9, 5, 2], [-0.1, -0.2, -0.3, -0.4], "aborted"), params)
    assert (cut.token_ids, cut.log_probs, cut.stop_reason) == ([4, 9], [-0.1, -0.2], "completed")
    # Without the request's ids, the model's EOS alone ends it.
    plain = SamplingParams.from_verl({}, max_tokens=6, stop_token_ids=[2])
    assert within_contract(SampleResult([4, 9, 5, 2, 7]), plain).token_ids == [4, 9, 5, 2]


def test_stop_strings_are_refused_naming_the_token_id_parameter() -> None:
    with pytest.raises(ValueError, match=r"stop on token ids only; have the agent loop pass .*stop_token_ids"):
        SamplingParams.from_verl({"stop": ["</tool_call>"]}, max_tokens=4, stop_token_ids=[2])


def test_the_rollout_server_started_ahead_is_the_replicas_only_when_verl_gives_the_replica_the_same_settings(
    ray_instance: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from verl_remote.backends.local.rollout import LocalRolloutReplica
    from verl_remote.demo import resolve_demo_assets
    from verl_remote.discovery.compose import compose_config
    from verl_remote.integration import rollout
    from verl_remote.integration.handoff import attach

    config = compose_config(["remote_backend=local"], recipe="demo")
    resolve_demo_assets(config)

    @ray_instance.remote
    class Engine:  # what the servers attach to: they start and stay up, never asked to sample
        pass

    namespace = ray_instance.get_runtime_context().namespace
    engine = Engine.options(name="engine", namespace=namespace).remote()
    attach(config, "local", {"actor": "engine", "namespace": namespace})

    def replica(rank: int = 0, **change: Any) -> Any:  # as verl's LLMServerManager builds it
        model = config.actor_rollout_ref.model.copy()
        model.update(change)
        return LocalRolloutReplica(replica_rank=rank, config=config.actor_rollout_ref.rollout, model_config=model)

    # The settings verl gives the replica, as it makes them from the same config: the replica takes the server.
    rollout.start_server_ahead(config)
    assert rollout._take_server_ahead(replica(rank=1)) is None  # only the first replica's
    server = rollout._take_server_ahead(replica())
    assert server is not None and rollout._take_server_ahead(replica()) is None  # taken once
    assert ray_instance.get(server.ready.remote()) is True
    ray_instance.kill(server)

    # Other settings: the replica starts its own, and the one started ahead is stopped.
    rollout.start_server_ahead(config)
    with caplog.at_level("WARNING"):
        assert rollout._take_server_ahead(replica(path="/another/model")) is None
    assert "the rollout server started ahead has other settings" in caplog.text
    assert [name.rsplit(".", 1)[-1] for name in live_actors(grace_s=5)] == ["Engine"]
    # Never taken: stopped when the run ends.
    rollout.start_server_ahead(config)
    rollout.discard_server_ahead()
    assert [name.rsplit(".", 1)[-1] for name in live_actors(grace_s=5)] == ["Engine"]
    ray_instance.kill(engine)
