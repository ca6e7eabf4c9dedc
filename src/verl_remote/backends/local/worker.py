"""The local backend's forwarder: verl's calls, as packed arrays, to the engine actor."""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict

from verl_remote import RemoteForwarderWorker, as_dict, pack, pack_fields, unpack_like
from verl_remote.backends.local.backend import LocalBackend

__all__ = ["LocalForwarderWorker"]

# What verl's PPO loss reads from a mini-batch (response-aligned fields are optional).
TRAIN_FIELDS = (
    "input_ids",
    "prompts",
    "responses",
    "response_mask",
    "old_log_probs",
    "advantages",
    "ref_log_prob",
    "rollout_is_weights",
)


class LocalForwarderWorker(RemoteForwarderWorker):
    backend: LocalBackend

    def backend_log_probs(
        self, data: TensorDict, *, temperature: float, calculate_entropy: bool, reference: bool
    ) -> tuple[Any, Any]:
        input_ids = pack(data["input_ids"])
        out = self.backend.compute_log_prob(
            input_ids, temperature=temperature, calculate_entropy=calculate_entropy, reference=reference
        )
        return unpack_like(out["log_probs"], input_ids), unpack_like(out["entropy"], input_ids)

    def backend_forward_backward(self, mini_batch: TensorDict, meta: dict[str, Any]) -> dict[str, float]:
        # The loss travels with the request, as a service is sent it.
        return self.backend.forward_backward(pack_fields(mini_batch, TRAIN_FIELDS), {**meta, "loss": self.loss()})

    def loss(self) -> dict[str, Any]:
        """The loss settings each update applies: this worker's actor config (``actor_rollout_ref.actor``)."""
        return as_dict(self.config.actor)

    def backend_optimizer_step(self) -> dict[str, float]:
        return self.backend.optimizer_step()

    def backend_end_of_step(self) -> float | None:
        return self.backend.lr_scheduler_step()

    def backend_device_name(self) -> str | None:
        return self.backend.device_name()
