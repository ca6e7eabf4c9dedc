"""Forwarder worker and rollout replica of the echo backend: they only re-attach."""

from __future__ import annotations

from typing import Any

from verl_remote.discovery.registry import load_backend_class


class EchoWorker:
    def __init__(self, config: Any, handle: dict[str, Any]) -> None:
        self.backend = load_backend_class("echo").from_config(config, handle=handle)


class EchoReplica(EchoWorker):
    pass
