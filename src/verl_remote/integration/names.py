"""The names verl-remote registers in verl's registries (:mod:`verl_remote.integration.verl_hooks`), set in a
run's config."""

from __future__ import annotations

from verl_remote.kit.config import OVERLAPPED_MODE

__all__ = ["ASYNC_MODE", "MODE", "ROLLOUT_NAME"]

MODE = "remote"  # trainer.v1.trainer_mode
ASYNC_MODE = OVERLAPPED_MODE  # trainer.v1.trainer_mode: the next step samples while this one trains
ROLLOUT_NAME = "verl_remote"  # actor_rollout_ref.rollout.name
