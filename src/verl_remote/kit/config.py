"""Reading the run's config in a backend."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

__all__ = ["as_dict"]


def as_dict(node: Any) -> dict[str, Any]:
    """A config section (``main_config.remote_backend``, ``...actor``) as a plain, resolved dict; a dict as it is."""
    value = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else node
    if not isinstance(value, dict):
        raise TypeError(f"expected a config mapping, got {type(value).__name__}")
    return {str(k): v for k, v in value.items()}
