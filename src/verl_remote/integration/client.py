"""The client verl's agent loop samples through: verl's own, minus its balancer where there is nothing to balance.

verl's :class:`~verl.workers.rollout.llm_server.LLMServerClient` asks its request balancer (a Ray actor of its own)
for a server before each request and tells it after: two Ray calls a sample, the first awaited. A run whose
replicas have one server between them (every backend's default: one replica, one server) gets that server for
every request from the balancer, so :class:`OneServerClient` sends each request straight to it and calls the
balancer not at all. With more servers it is verl's client unchanged.
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.llm_server import LLMServerClient

__all__ = ["OneServerClient"]


class OneServerClient(LLMServerClient):
    """verl's client; with exactly one server in ``servers`` (address to actor handle) it routes there directly."""

    def __init__(
        self, config: Any, load_balancer_handle: Any = None, *, servers: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(config, load_balancer_handle=load_balancer_handle, **kwargs)
        #: The run's one server, (its id, its handle); None where there are more (or none).
        self.only_server: tuple[str, Any] | None = None
        if servers and len(servers) == 1:
            self.only_server = next(iter(servers.items()))

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        if self.only_server is not None:
            return self.only_server
        server_id, handle = await super()._acquire_server(request_id, **extra)
        return str(server_id), handle

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        if self.only_server is None:
            super()._release_server(server_id, request_id=request_id)
