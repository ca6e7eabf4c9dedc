"""Reading the run's config in a backend."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

__all__ = ["OVERLAPPED_MODE", "as_dict", "overlapped"]

#: ``trainer.v1.trainer_mode`` of a run that samples the next step while it trains this one.
OVERLAPPED_MODE = "remote_async"


def as_dict(node: Any) -> dict[str, Any]:
    """A config section (``main_config.remote_backend``, ``...actor``) as a plain, resolved dict; a dict as it is."""
    value = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else node
    if not isinstance(value, dict):
        raise TypeError(f"expected a config mapping, got {type(value).__name__}")
    return {str(k): v for k, v in value.items()}


def overlapped(main_config: Any) -> bool:
    """Whether this run samples the next step while it trains the current one (``trainer.v1.trainer_mode`` is
    ``remote_async`` and the backend did not decline, :meth:`RemoteBackend.cannot_overlap`). A backend whose
    sampler shares the trainer's weights keeps a snapshot for sampling only then."""
    return str(OmegaConf.select(main_config, "trainer.v1.trainer_mode", default="")) == OVERLAPPED_MODE
