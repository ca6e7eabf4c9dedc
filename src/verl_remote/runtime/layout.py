"""The run's forwarder layout for its backend: one forwarder worker per ``trainer.n_gpus_per_node`` x
``trainer.nnodes``, and a backend that needs every call from one (``requires_single_forwarder``) gets one.
Checked once: by ``verl-remote train`` before Ray starts, or by the trainer under verl's own launcher, before the
backend is made."""

from __future__ import annotations

from typing import Any

__all__ = ["forwarder_count", "lora_problem", "single_forwarder_problem", "verl_lora_rank"]


def forwarder_count(config: Any) -> int:
    return int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)


def single_forwarder_problem(config: Any, name: str, single_forwarder: bool) -> str | None:
    """What is wrong with the layout for backend ``name``, with the keys to set; None when nothing is."""
    forwarders = forwarder_count(config)
    if single_forwarder and forwarders != 1:
        return (
            f"backend '{name}' needs exactly one forwarder worker, but trainer.n_gpus_per_node * trainer.nnodes = "
            f"{forwarders}: set trainer.n_gpus_per_node=1 trainer.nnodes=1"
        )
    return None


def verl_lora_rank(config: Any) -> int:
    """The LoRA rank verl's config asks for: ``actor_rollout_ref.model.lora_rank``, or the newer
    ``actor_rollout_ref.model.lora.rank``; 0 for every weight."""
    from omegaconf import OmegaConf

    ranks = [
        OmegaConf.select(config, f"actor_rollout_ref.model.{key}", default=0) for key in ("lora_rank", "lora.rank")
    ]
    return max(int(rank or 0) for rank in ranks)


def lora_problem(config: Any, name: str, verl_lora: bool) -> str | None:
    """A LoRA adapter asked of backend ``name``, which trains every weight (it does not declare ``verl_lora``): the
    key to set, or None."""
    rank = verl_lora_rank(config)
    if rank > 0 and not verl_lora:
        key = "lora_rank" if int(config.actor_rollout_ref.model.get("lora_rank") or 0) == rank else "lora.rank"
        return (
            f"actor_rollout_ref.model.{key}={rank}: backend '{name}' trains every weight of the model, not a LoRA "
            f"adapter; set actor_rollout_ref.model.{key}=0 for full fine-tuning, or use a backend that trains LoRA "
            "(remote_backend=tinker)"
        )
    return None
