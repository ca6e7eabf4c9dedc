"""The contract, the forwarder and the replica over a service that does nothing: log-probs of 0, a loss of 0."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from verl_remote import RemoteBackend, RemoteForwarderWorker, RemoteRolloutReplica, pack, unpack_like
from verl_remote_instant.server import InstantServer


class InstantBackend(RemoteBackend):
    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> InstantBackend:
        return cls()

    def reconnect_handle(self) -> dict[str, Any]:
        return {}

    async def update_weights(self) -> None:
        pass

    async def save_checkpoint(self, step: int, path: str) -> None:
        with open(os.path.join(path, "instant.json"), "w") as fp:
            json.dump({"step": step}, fp)

    async def load_checkpoint(self, step: int, path: str) -> None:
        pass

    async def destroy(self) -> None:
        pass


class InstantWorker(RemoteForwarderWorker):
    def backend_log_probs(self, data: Any, *, temperature: float, calculate_entropy: bool, reference: bool) -> Any:
        ids = pack(data["input_ids"])
        zeros = np.zeros(len(ids.values), dtype=np.float32)
        return unpack_like(zeros, ids), unpack_like(zeros, ids)

    def backend_forward_backward(self, mini_batch: Any, meta: dict[str, Any]) -> dict[str, float]:
        return {"loss": 0.0}

    def backend_optimizer_step(self) -> dict[str, float]:
        return {"grad_norm": 0.0, "lr": float(self.config.actor.optim.lr)}


class InstantReplica(RemoteRolloutReplica):
    server_class = InstantServer
