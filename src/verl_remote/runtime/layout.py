"""The run's forwarder layout for its backend: one forwarder worker per ``trainer.n_gpus_per_node`` x
``trainer.nnodes``, and a backend that needs every call from one (``requires_single_forwarder``) gets one.
Checked once: by ``verl-remote train`` before Ray starts, or by the trainer under verl's own launcher, before the
backend is made."""

from __future__ import annotations

from typing import Any

__all__ = ["forwarder_count", "single_forwarder_problem"]


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
