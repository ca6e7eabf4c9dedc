"""The local engine's Ray actor: :class:`~verl_remote.backends.local.engine.LocalEngine`'s calls, in a module that
imports no torch.

Ray imports an actor class's module in every process that gets a handle to the actor, to learn its methods: the
rollout server's, which only sends the engine sampling requests, among them. With the engine's own module there
that was torch and transformers, seconds of CPU at a run's start; the engine itself is built in the actor's own
process, as it starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl_remote import Packed
    from verl_remote.backends.local.requests import GenerateResult, SampleRequest

__all__ = ["LocalEngineActor"]


class LocalEngineActor:
    """Each call is the engine's method of the same name (:class:`LocalEngine` documents them)."""

    def __init__(self, model_path: str, actor_config: dict[str, Any], settings: dict[str, Any]) -> None:
        from verl_remote.backends.local.engine import LocalEngine

        self.engine = LocalEngine(model_path, actor_config, settings)

    def compute_log_prob(
        self, input_ids: Packed, temperature: float, calculate_entropy: bool, reference: bool
    ) -> Any:  # the engine's dict of arrays (``@torch.no_grad()`` leaves its type untyped)
        return self.engine.compute_log_prob(input_ids, temperature, calculate_entropy, reference)

    def forward_backward(self, batch: dict[str, Packed], meta: dict[str, Any]) -> dict[str, float]:
        return self.engine.forward_backward(batch, meta)

    def optimizer_step(self) -> dict[str, float]:
        return self.engine.optimizer_step()

    def lr_scheduler_step(self) -> float:
        return self.engine.lr_scheduler_step()

    def generate_batch(self, requests: list[SampleRequest]) -> list[GenerateResult]:
        return self.engine.generate_batch(requests)

    def update_weights(self) -> int:
        return self.engine.update_weights()

    def close(self) -> None:
        self.engine.close()

    def save(self, path: str) -> str:
        return self.engine.save(path)

    def load(self, path: str) -> None:
        self.engine.load(path)

    def device_name(self) -> str:
        return self.engine.device_name()

    def weights_checksum(self) -> str:
        return self.engine.weights_checksum()
