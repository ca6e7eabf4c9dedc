"""``LocalBackend``: the RemoteBackend contract over one Ray actor running :class:`LocalEngine`."""

from __future__ import annotations

import os
from typing import Any

import ray
from omegaconf import OmegaConf

from verl_remote import Packed, RayService, RemoteBackend, resources
from verl_remote.backends.local.engine import GenerateResult, LocalEngine

__all__ = ["LocalBackend"]

# Where, inside verl's global_step_N/actor folder, the engine's state goes.
CHECKPOINT_SUBDIR = "local_engine"


class LocalBackend(RemoteBackend):
    """Every process holds a handle to the same named engine actor (a :class:`RayService`)."""

    def __init__(self, service: RayService) -> None:
        self.service = service
        self.engine = service.actor()

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> LocalBackend:
        if handle is not None:
            return cls(RayService.from_handle(handle))
        settings = OmegaConf.to_container(main_config.remote_backend, resolve=True)
        assert isinstance(settings, dict)
        device = str(settings.get("device", "auto"))
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
        settings["device"] = device
        actor_config = OmegaConf.to_container(main_config.actor_rollout_ref.actor, resolve=True)
        service = RayService.start(
            LocalEngine,
            str(main_config.actor_rollout_ref.model.path),
            actor_config,
            settings,
            prefix="verl_remote_local_engine",
            num_cpus=resources(settings)["num_cpus"],
            num_gpus=1 if device.startswith("cuda") else 0,
        )
        return cls(service)

    def reconnect_handle(self) -> dict[str, Any]:
        return self.service.handle()

    @classmethod
    def requires_single_forwarder(cls) -> bool:
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
        self.service.stop()

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
