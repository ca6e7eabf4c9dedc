"""What the driver hands every forwarder and rollout server: the backend's name, its reconnect handle and the
run's shared config sections.

The trainer builds it once, on the driver (:func:`attach`), into the one part of verl's config that verl gives
every forwarder and rollout server unchanged: ``actor_rollout_ref.rollout.custom.verl_remote``. Each forwarder
and server reads it once (:func:`read`) and re-attaches to the backend with
``from_config(handoff.main_config(...), handle=handoff.handle)``. The sections travel as YAML text, since verl
turns nested dicts with a ``_target_`` in the rollout config into dataclasses, and a string passes through
untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

__all__ = ["CUSTOM_KEY", "SHARED_SECTIONS", "HandOff", "attach", "read"]

#: The key under ``actor_rollout_ref.rollout.custom`` that holds the hand-off.
CUSTOM_KEY = "verl_remote"

#: The run's sections every forwarder and rollout server gets, as composed on the driver, resolved.
SHARED_SECTIONS = ("remote_backend", "data", "trainer", "algorithm")


@dataclass(frozen=True)
class HandOff:
    """The hand-off as a forwarder or rollout server reads it."""

    backend: str
    handle: dict[str, Any]
    #: The run's ``remote_backend``, ``data``, ``trainer`` and ``algorithm`` sections.
    shared: DictConfig

    def main_config(self, actor_rollout_ref: Any) -> DictConfig:
        """The config the backend's ``from_config`` gets in this process: the shared sections, plus the
        ``actor_rollout_ref`` section the process has (a forwarder its whole section, a rollout server
        ``{"model": ...}``)."""
        merged = OmegaConf.merge(self.shared, {"actor_rollout_ref": actor_rollout_ref})
        assert isinstance(merged, DictConfig)
        return merged


def attach(config: DictConfig, backend: str, handle: dict[str, Any]) -> None:
    """Put the hand-off into ``config`` (the run's, on the driver), once the backend exists."""
    shared = {key: OmegaConf.to_container(config[key], resolve=True) for key in SHARED_SECTIONS if key in config}
    with open_dict(config):
        existing = config.actor_rollout_ref.rollout.get("custom")
        custom: dict[str, Any] = dict(OmegaConf.to_container(existing)) if existing is not None else {}  # type: ignore[arg-type]
        custom[CUSTOM_KEY] = {"backend": backend, "handle": handle, "config": OmegaConf.to_yaml(shared)}
        config.actor_rollout_ref.rollout.custom = custom


def read(rollout_config: Any) -> HandOff:
    """The hand-off from verl's rollout config, in a forwarder or a rollout server."""
    custom = rollout_config.get("custom") if hasattr(rollout_config, "get") else rollout_config.custom
    entry = (custom or {}).get(CUSTOM_KEY)
    if entry is None:
        raise RuntimeError(
            "this worker was started without verl-remote's backend handle: run it through 'verl-remote train' "
            "(trainer.v1.trainer_mode=remote)"
        )
    shared = OmegaConf.create(str(entry["config"]))
    assert isinstance(shared, DictConfig)
    handle = entry["handle"]  # plain containers, whichever form of verl's rollout config carried it
    plain = OmegaConf.to_container(handle, resolve=True) if OmegaConf.is_config(handle) else handle
    return HandOff(str(entry["backend"]), dict(plain), shared)  # type: ignore[arg-type]
