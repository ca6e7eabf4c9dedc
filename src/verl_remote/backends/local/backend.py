"""``LocalBackend``: the RemoteBackend contract over one Ray actor running :class:`LocalEngine`."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

import ray
from omegaconf import OmegaConf

from verl_remote.backend import RemoteBackend
from verl_remote.backends.local.engine import GenerateResult, LocalEngine
from verl_remote.payload import Packed

__all__ = ["LocalBackend"]

# Where, inside verl's global_step_N/actor folder, the engine's state goes.
CHECKPOINT_SUBDIR = "local_engine"


class LocalBackend(RemoteBackend):
    """Every process holds a handle to the same named engine actor."""

    def __init__(self, engine: Any, handle: dict[str, Any]) -> None:
        self.engine = engine
        self._handle = handle

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> LocalBackend:
        if handle is not None:
            return cls(ray.get_actor(handle["actor"], namespace=handle["namespace"]), handle)
        settings = OmegaConf.to_container(main_config.remote_backend, resolve=True)
        assert isinstance(settings, dict)
        device = str(settings.get("device", "auto"))
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
        settings["device"] = device
        actor_config = OmegaConf.to_container(main_config.actor_rollout_ref.actor, resolve=True)
        name = f"verl_remote_local_engine_{uuid.uuid4().hex[:8]}"
        namespace = ray.get_runtime_context().namespace
        engine = (
            ray.remote(LocalEngine)
            .options(
                name=name,
                namespace=namespace,
                num_cpus=float(settings.get("num_cpus", 1)),
                num_gpus=1 if device.startswith("cuda") else 0,
            )
            .remote(str(main_config.actor_rollout_ref.model.path), actor_config, settings)
        )
        ray.get(engine.weights_checksum.remote())  # surfaces construction errors here, on the driver
        return cls(engine, {"actor": name, "namespace": namespace})

    def reconnect_handle(self) -> dict[str, Any]:
        return dict(self._handle)

    def requires_single_forwarder(self) -> bool:
        # One engine owns one optimizer: several forwarders would step it once each per mini-batch.
        return True

    # -- lifecycle ----------------------------------------------------------------------------

    async def update_weights(self) -> None:
        await self.engine.update_weights.remote()

    async def save_checkpoint(self, step: int, path: str) -> None:
        await self.engine.save.remote(os.path.join(path, CHECKPOINT_SUBDIR))

    async def load_checkpoint(self, step: int, path: str) -> None:
        await self.engine.load.remote(os.path.join(path, CHECKPOINT_SUBDIR))

    async def destroy(self) -> None:
        with contextlib.suppress(ValueError):  # already gone
            ray.kill(self.engine, no_restart=True)

    # -- compute, used by this backend's worker and replica -------------------------------------

    def compute_log_prob(
        self, input_ids: Packed, *, temperature: float, calculate_entropy: bool, reference: bool
    ) -> dict[str, Any]:
        return dict(ray.get(self.engine.compute_log_prob.remote(input_ids, temperature, calculate_entropy, reference)))

    def forward_backward(self, batch: dict[str, Packed], meta: dict[str, Any]) -> dict[str, float]:
        return dict(ray.get(self.engine.forward_backward.remote(batch, meta)))

    def optimizer_step(self) -> dict[str, float]:
        return dict(ray.get(self.engine.optimizer_step.remote()))

    def lr_scheduler_step(self) -> float:
        return float(ray.get(self.engine.lr_scheduler_step.remote()))

    async def generate(self, prompt_ids: list[int], max_tokens: int, params: dict[str, Any]) -> GenerateResult:
        result: GenerateResult = await self.engine.generate.remote(prompt_ids, max_tokens, **params)
        return result

    def device_name(self) -> str:
        return str(ray.get(self.engine.device_name.remote()))

    def weights_checksum(self) -> str:
        return str(ray.get(self.engine.weights_checksum.remote()))
