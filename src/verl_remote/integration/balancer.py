"""verl's request balancer for a run with one rollout server, in a process that does not import verl.

verl starts a balancer actor for every run (``GlobalRequestLoadBalancer``, in ``verl.workers.rollout.router``);
its process imports verl to unpickle the class, seconds of CPU while the run starts. verl takes a balancer of
one's own as a router plugin (``actor_rollout_ref.rollout.router_config_path``, a YAML file naming the class);
``verl-remote`` names :class:`RunBalancer` there (``BALANCER_CONFIG``) unless the run names a router of its own or
asks for verl's ``full_determinism`` routing. With one server there is nothing to balance and it answers from
the server it holds (verl-remote's client sends requests straight to that server and does not call it at all:
:mod:`verl_remote.integration.client`); from the moment it holds more than one it hands every call to verl's own
balancer, built then with the same servers. The server classes' modules import no verl either
(:mod:`verl_remote.integration.server`): Ray imports a class's module wherever a handle to one of its actors
arrives, here with the servers this actor is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["BALANCER_CONFIG", "RunBalancer"]

#: The router plugin's YAML (verl's ``router_config_path``): ``router_class`` names :class:`RunBalancer`.
BALANCER_CONFIG = str(Path(__file__).with_name("balancer.yaml"))


class RunBalancer:
    """verl's router protocol (``RequestLoadBalancer``) over ``servers`` (id to actor handle)."""

    def __init__(self, servers: dict[str, Any], settings: dict[str, Any] | None = None) -> None:
        self._servers: dict[str, Any] = dict(servers)
        self._inflight: dict[str, int] = {server_id: 0 for server_id in servers}
        #: verl's balancer, once there is more than one server to balance.
        self._verl: Any = None
        self._promote_if_needed()

    def _promote_if_needed(self) -> None:
        if self._verl is None and len(self._servers) > 1:
            from verl.workers.rollout.router import GlobalRequestLoadBalancer

            self._verl = GlobalRequestLoadBalancer(self._servers)

    def acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        if self._verl is not None:
            server_id, handle = self._verl.acquire_server(request_id)
            return str(server_id), handle
        if not self._servers:
            raise RuntimeError("No available servers in load balancer")
        ((server_id, handle),) = self._servers.items()
        self._inflight[server_id] += 1
        return server_id, handle

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        if self._verl is not None:
            self._verl.release_server(server_id, request_id)
        elif self._inflight.get(server_id, 0) > 0:
            self._inflight[server_id] -= 1

    def require_acquire_fields(self) -> list[str]:
        return []

    def require_release_fields(self) -> list[str]:
        return []

    def add_servers(self, servers: dict[str, Any]) -> None:
        if self._verl is not None:
            self._verl.add_servers(servers)
            return
        for server_id, handle in servers.items():
            self._servers[server_id] = handle
            self._inflight.setdefault(server_id, 0)
        self._promote_if_needed()

    def remove_servers(self, server_ids: list[str]) -> None:
        if self._verl is not None:
            self._verl.remove_servers(server_ids)
        for server_id in server_ids:
            self._servers.pop(server_id, None)
            self._inflight.pop(server_id, None)

    def get_inflight_count(self, server_id: str) -> int:
        if self._verl is not None:
            return int(self._verl.get_inflight_count(server_id))
        return self._inflight.get(server_id, 0)

    def get_all_servers(self) -> list[str]:
        if self._verl is not None:
            return list(self._verl.get_all_servers())
        return list(self._servers)

    def get_status(self) -> dict[str, Any]:
        if self._verl is not None:
            return dict(self._verl.get_status())
        return {
            "servers": dict(self._inflight),
            "total_inflight": sum(self._inflight.values()),
            "active_servers": len(self._inflight),
            "registered_handles": list(self._servers),
        }

    def clear_sticky_cache(self) -> dict[str, Any]:
        if self._verl is not None:
            return dict(self._verl.clear_sticky_cache())
        return {"cleared_entries": 0, "server_loads": dict(self._inflight)}

    def get_total_inflight(self) -> int:
        if self._verl is not None:
            return int(self._verl.get_total_inflight())
        return sum(self._inflight.values())


def use_run_balancer(config: Any) -> bool:
    """Name :class:`RunBalancer` as the run's router plugin (``actor_rollout_ref.rollout.router_config_path``),
    unless the run names a router of its own or asks for verl's deterministic routing (``full_determinism``,
    which verl's own balancer implements). Whether it did; run before anything copies the rollout config."""
    from omegaconf import open_dict

    rollout = config.actor_rollout_ref.rollout
    if rollout.get("router_config_path") or rollout.get("full_determinism", False):
        return False
    with open_dict(rollout):
        rollout.router_config_path = BALANCER_CONFIG
    return True
