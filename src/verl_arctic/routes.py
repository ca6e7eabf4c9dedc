"""The routes of Arctic's RL HTTP protocol, for both generations, in one table.

Everything that differs between generation ``v0.1`` (arctic-platform 0.1.2) and
``main`` at the level of routes lives here: paths, which calls carry binary
bodies and in which encoding. Payload differences (the step, save and
weight-sync bodies) are handled by the client, keyed on the same names. See
docs/arctic-protocol.md §1, §1' and §6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ENCODING", "GENERATIONS", "Route", "route"]

Generation = Literal["v0.1", "main"]
GENERATIONS: tuple[Generation, ...] = ("v0.1", "main")

#: The binary body encoding of each generation (see :mod:`verl_arctic.wire`).
ENCODING: dict[str, str] = {"v0.1": "torch", "main": "dssst1"}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    #: "json", "binary" (the generation's encoding) or None (no body).
    request: str | None = None
    response: str = "json"
    #: Whether the call names its job in the ``job_id`` query parameter.
    job_query: bool = True
    #: Safe to send again after a network failure (no state changes on the server).
    idempotent: bool = False


_COMMON = {
    "health": Route("GET", "/health", job_query=False, idempotent=True),
    "status": Route("GET", "/status", job_query=False, idempotent=True),
    "job": Route("GET", "/job/{job_id}", job_query=False, idempotent=True),
    "initialize": Route("POST", "/initialize", "json", job_query=False),
    "destroy": Route("POST", "/destroy", "json"),
    "sleep_inference": Route("POST", "/sleep-inference"),
    "wake_inference": Route("POST", "/wake-inference", "json"),
    "reset_prefix_cache": Route("POST", "/reset-prefix-cache"),
    "weight_norm": Route("POST", "/weight-norm", "json", job_query=False, idempotent=True),
}

_ROUTES: dict[str, dict[str, Route]] = {
    "v0.1": {
        **_COMMON,
        "forward_backward": Route("POST", "/fwd-bwd", "binary", "binary"),
        "forward": Route("POST", "/fwd-no-grad", "binary", "binary"),
        "step": Route("POST", "/step"),
        "save": Route("POST", "/save-checkpoint"),
        "weight_sync": Route("POST", "/sync-weights", "json", job_query=False),
        "generate": Route("POST", "/generate", "json"),
    },
    "main": {
        **_COMMON,
        "forward_backward": Route("POST", "/forward-backward", "binary", "binary"),
        "forward": Route("POST", "/forward", "binary", "binary"),
        "step": Route("POST", "/step", "json"),
        "save": Route("POST", "/save", "json"),
        "load_checkpoint": Route("POST", "/load-checkpoint", "json"),
        "weight_sync": Route("POST", "/weight-sync", "json"),
        "generate": Route("POST", "/generate", "binary", "binary"),
    },
}


def route(generation: str, operation: str) -> Route:
    """The route of ``operation`` in ``generation``; a clear error where it has none."""
    try:
        table = _ROUTES[generation]
    except KeyError:
        raise ValueError(
            f"unknown Arctic protocol generation {generation!r}; known: {', '.join(GENERATIONS)}"
        ) from None
    if operation not in table:
        raise NotImplementedError(f"Arctic protocol {generation} has no '{operation}' call")
    return table[operation]
