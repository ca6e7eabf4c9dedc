"""A run's request routing: verl-remote's client and balancer (verl_remote.integration.client, .balancer), through
verl's own router plugin loader and a real Ray instance; and the server modules Ray imports with their handles."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from omegaconf import OmegaConf

from verl_remote.integration.balancer import BALANCER_CONFIG, RunBalancer, use_run_balancer


def test_the_balancer_answers_from_its_one_server_and_hands_over_to_verls_once_it_has_two() -> None:
    balancer = RunBalancer({"a": "handle-a"})
    assert balancer.acquire_server("r1") == ("a", "handle-a")
    assert balancer.get_status()["total_inflight"] == 1
    balancer.release_server("a", "r1")
    balancer.release_server("a", "r1")  # a second release does not go below 0, as verl's
    assert balancer.get_total_inflight() == 0
    assert balancer.require_acquire_fields() == [] and balancer.require_release_fields() == []

    balancer.add_servers({"b": "handle-b"})  # now verl's balancer: least loaded first
    first, second = balancer.acquire_server("r2"), balancer.acquire_server("r3")
    assert {first[0], second[0]} == {"a", "b"}
    assert balancer.acquire_server("r2") == first  # verl's sticky session
    assert sorted(balancer.get_all_servers()) == ["a", "b"]
    balancer.remove_servers(["a"])
    assert balancer.get_all_servers() == ["b"]

    empty = RunBalancer({})
    with pytest.raises(RuntimeError, match="No available servers"):
        empty.acquire_server("r1")


def test_the_run_names_the_balancer_unless_it_names_a_router_or_asks_for_deterministic_routing() -> None:
    def rollout(**settings: Any) -> Any:
        base = {"router_config_path": None, "full_determinism": False}
        return OmegaConf.create({"actor_rollout_ref": {"rollout": {**base, **settings}}})

    config = rollout()
    assert use_run_balancer(config) and config.actor_rollout_ref.rollout.router_config_path == BALANCER_CONFIG
    assert OmegaConf.load(BALANCER_CONFIG).router_class == f"{RunBalancer.__module__}.{RunBalancer.__name__}"
    own = rollout(router_config_path="my_router.yaml")
    assert not use_run_balancer(own) and own.actor_rollout_ref.rollout.router_config_path == "my_router.yaml"
    deterministic = rollout(full_determinism=True)
    assert not use_run_balancer(deterministic)
    assert deterministic.actor_rollout_ref.rollout.router_config_path is None


def test_a_run_with_one_server_samples_without_the_balancer_and_one_with_two_through_it(ray_instance: Any) -> None:
    from verl.workers.rollout.router import get_router_handle

    from verl_remote.integration.client import OneServerClient

    ray = ray_instance

    class _Server:
        """A rollout server's generate, as verl's client calls it (defined here: Ray pickles it by value)."""

        def __init__(self, name: str) -> None:
            self.name = name

        async def generate(self, prompt_ids: list[int], **kwargs: Any) -> Any:
            from verl.workers.rollout.replica import TokenOutput

            await asyncio.sleep(0.2)  # in flight together
            return TokenOutput(token_ids=[len(prompt_ids)], extra_fields={"global_steps": 0, "server": self.name})

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"full_determinism": False, "name": "verl_remote"}}})
    server = ray.remote(_Server)
    one = {"s0": server.remote("s0")}
    # verl's own plugin loader builds the balancer from the YAML the run names.
    balancer = get_router_handle(one, router_config_path=BALANCER_CONFIG)
    assert ray.get(balancer.get_all_servers.remote()) == ["s0"]
    # No balancer handle at all: a call to it would fail the request.
    client = OneServerClient(config, load_balancer_handle=None, servers=one)

    async def sample(client: OneServerClient, n: int) -> list[Any]:
        return await asyncio.gather(
            *(client.generate(f"r{i}", prompt_ids=[1, 2], sampling_params={}) for i in range(n))
        )

    outputs = asyncio.run(sample(client, 3))
    assert [o.extra_fields["server"] for o in outputs] == ["s0"] * 3

    two = {"s0": one["s0"], "s1": server.remote("s1")}
    balancer = get_router_handle(two, router_config_path=BALANCER_CONFIG)
    client = OneServerClient(config, load_balancer_handle=balancer, servers=two)
    assert client.only_server is None
    outputs = asyncio.run(sample(client, 2))  # least loaded first: one each
    assert sorted(o.extra_fields["server"] for o in outputs) == ["s0", "s1"]
    assert ray.get(balancer.get_total_inflight.remote()) == 0


@pytest.mark.parametrize(
    "module",
    [
        "verl_remote.integration.balancer",
        "verl_remote.integration.server",
        "verl_remote.backends.local.server",
        "verl_remote.backends.local.backend",  # the local server's backend, and its engine actor's class
        "verl_remote.backends.local.actor",
        "verl_arctic.server",
        "verl_remote_tinker.server",
    ],
)
def test_the_modules_ray_imports_with_a_servers_handle_import_no_verl(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('verl', 'torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"
