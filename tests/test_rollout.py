"""The rollout replica and server: the sampling contract, enforced once for every backend, and what crosses into the
server's process (verl_remote.integration.rollout, .server)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import ray

from conftest import live_actors
from verl_remote import SampleResult, SamplingParams
from verl_remote.kit.sampling import within_contract

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # what runs in the server's process, below


def _heavy_modules(server: Any) -> list[str]:
    return sorted(module for module in ("verl", "torch", "transformers") if module in sys.modules)


def _stop_token_ids(server: Any) -> list[int]:
    return list(server.stop_token_ids)


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
    # Its process imports neither verl, torch nor transformers, and has the model's EOS ids as transformers has them.
    assert ray_instance.get(server.__ray_call__.remote(_heavy_modules)) == []
    assert ray_instance.get(server.__ray_call__.remote(_stop_token_ids)) == _eos_by_transformers(
        str(config.actor_rollout_ref.model.path)
    )
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


def test_the_server_gets_verls_rollout_config_as_plain_values_and_sends_verls_token_output_without_importing_verl(
    tmp_path: Path,
) -> None:
    """What crosses into the rollout server's process and back needs no verl there (integration/server.py)."""
    from omegaconf import DictConfig

    from verl_remote.backends.local.rollout import LocalRolloutReplica
    from verl_remote.discovery.compose import compose_config
    from verl_remote.integration import rollout
    from verl_remote.integration.handoff import attach
    from verl_remote.integration.handoff import read as read_handoff
    from verl_remote.integration.server import TokenOutputOnArrival

    config = compose_config(["remote_backend=local"], recipe="demo")
    handle = {"actor": "engine", "namespace": "run", "more": {"ids": [1, 2]}}
    attach(config, "local", handle)
    replica = LocalRolloutReplica(
        replica_rank=0, config=config.actor_rollout_ref.rollout, model_config=config.actor_rollout_ref.model
    )
    assert type(replica.config).__name__ == "RolloutConfig"  # verl's class, as verl builds the replica
    plain = rollout._plain(replica.config)
    assert isinstance(plain, DictConfig)
    for key in ("prompt_length", "response_length", "max_model_len", "temperature", "calculate_log_probs"):
        assert plain[key] == getattr(replica.config, key), key
    assert read_handoff(plain).handle == read_handoff(replica.config).handle == handle
    pickled = tmp_path / "config.pkl"
    pickled.write_bytes(pickle.dumps(plain))
    code = (
        f"import pickle, sys; c = pickle.loads(open({str(pickled)!r}, 'rb').read()); "
        "print(c.prompt_length, 'verl' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [str(replica.config.prompt_length), "False"], out.stderr[-2000:]

    sent = TokenOutputOnArrival(
        token_ids=[5, 2], log_probs=[-0.5, -0.25], stop_reason="completed", extra_fields={"global_steps": 3}
    )
    arrived = pickle.loads(pickle.dumps(sent))  # as Ray sends it to verl's agent loop
    assert type(arrived).__module__ == "verl.workers.rollout.replica" and type(arrived).__name__ == "TokenOutput"
    assert (arrived.token_ids, arrived.log_probs, arrived.extra_fields) == ([5, 2], [-0.5, -0.25], {"global_steps": 3})


def _eos_by_transformers(model_path: str) -> list[int]:
    from transformers import AutoTokenizer, GenerationConfig

    ids = {AutoTokenizer.from_pretrained(model_path).eos_token_id}
    try:
        generation = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        generation = None
    ids.update([generation] if isinstance(generation, int) else generation or [])
    return sorted(ids - {None})


def test_the_servers_eos_ids_are_transformers_whether_read_from_the_folder_or_through_transformers(
    tmp_path: Path,
) -> None:
    """The server reads the model's EOS ids from its folder where the files say them plainly (no transformers in
    its process); where they do not, through transformers. Either way the ids are transformers' own."""
    import shutil

    from verl_remote.demo import assets
    from verl_remote.integration import server

    demo = assets.ensure_demo_assets().model_path
    cases = {"demo": demo}
    listed = tmp_path / "list"  # a generation config with more than one EOS id, the tokenizer's among them
    shutil.copytree(demo, listed)
    generation = json.loads((listed / "generation_config.json").read_text())
    (listed / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [1, 2, 3]}))
    cases["list"] = listed
    renamed = tmp_path / "renamed"  # an AddedToken dict, no generation config
    shutil.copytree(demo, renamed)
    (renamed / "generation_config.json").unlink()
    tokenizer_config = json.loads((renamed / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = {"content": "<unk>", "special": True, "__type": "AddedToken"}
    (renamed / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    cases["renamed"] = renamed
    mapped = tmp_path / "mapped"  # a special_tokens_map.json, which transformers reads over the config: theirs
    shutil.copytree(demo, mapped)
    (mapped / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<pad>"}))
    cases["mapped"] = mapped

    from transformers import AutoTokenizer

    loaded = []  # the folders whose tokenizer was asked for: those the files do not say plainly

    def tokenizer(path: Path) -> Any:
        loaded.append(path.name)
        return AutoTokenizer.from_pretrained(str(path))

    found = {name: server.model_stop_token_ids(str(path), lambda p=path: tokenizer(p)) for name, path in cases.items()}
    assert found == {name: _eos_by_transformers(str(path)) for name, path in cases.items()}
    assert loaded == ["mapped"]
    assert len(found["list"]) == 3 and found["renamed"] != found["demo"]  # the cases differ where they should
    assert server._fast_tokenizer_eos_id(mapped) is None  # asked of transformers, not read
    assert server._fast_tokenizer_eos_id(demo) == found["demo"][0]
