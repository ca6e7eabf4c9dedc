"""The glue: verl-remote's contract, forwarder worker and rollout replica over the bigram service."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from verl_remote import (
    RayService,
    RemoteBackend,
    RemoteForwarderWorker,
    RemoteRolloutReplica,
    as_dict,
    pack,
    pack_fields,
    resources,
    unpack_like,
)
from verl_remote_bigram.server import BigramServer
from verl_remote_bigram.service import BigramService

FIELDS = ("input_ids", "prompts", "responses", "response_mask", "old_log_probs", "advantages", "ref_log_prob")


class BigramBackend(RemoteBackend):
    def __init__(self, service: RayService) -> None:
        self.service = service  # service.call / call_async run its methods, raising its own exceptions

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> BigramBackend:
        if handle is not None:  # a forwarder or a rollout server: attach to the running service
            return cls(RayService.from_handle(handle))
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(str(main_config.actor_rollout_ref.model.path)))
        actor = OmegaConf.to_container(main_config.actor_rollout_ref.actor, resolve=True)
        settings = main_config.remote_backend
        return cls(RayService.start(BigramService, vocab, actor, int(settings.seed), **resources(settings)))

    def reconnect_handle(self) -> dict[str, Any]:
        return self.service.handle()

    @classmethod
    def requires_single_forwarder(cls) -> bool:
        return True  # one service, one optimizer: one caller per step

    async def update_weights(self) -> None:
        await self.service.call_async("publish")

    async def save_checkpoint(self, step: int, path: str) -> None:
        await self.service.call_async("save", path)

    async def load_checkpoint(self, step: int, path: str) -> None:
        await self.service.call_async("load", path)

    async def destroy(self) -> None:
        self.service.stop()


class BigramWorker(RemoteForwarderWorker):
    def backend_log_probs(self, data: Any, *, temperature: float, calculate_entropy: bool, reference: bool) -> Any:
        ids = pack(data["input_ids"])
        out = self.backend.service.call("log_probs", ids, temperature, reference)
        return unpack_like(out["log_probs"], ids), unpack_like(out["entropy"], ids)

    def backend_forward_backward(self, mini_batch: Any, meta: dict[str, Any]) -> dict[str, float]:
        # The loss is the forwarder's to say (verl builds each run's forwarder with its actor config): it travels
        # with the request, as a service is told which loss to apply.
        loss = as_dict(self.config.actor)
        return self.backend.service.call("forward_backward", pack_fields(mini_batch, FIELDS), {**meta, "loss": loss})

    def backend_optimizer_step(self) -> dict[str, float]:
        return self.backend.service.call("optimizer_step")

    def backend_device_name(self) -> str:
        return "CPU"

    def backend_flops(self, seqlens: list[int]) -> float:
        return self.backend.service.call("flops", seqlens)


class BigramReplica(RemoteRolloutReplica):
    server_class = BigramServer
