"""The names verl-remote registers in verl's registries (:mod:`verl_remote.integration.verl_hooks`), set in a
run's config."""

from __future__ import annotations

__all__ = ["MODE", "ROLLOUT_NAME"]

MODE = "remote"  # trainer.v1.trainer_mode
ROLLOUT_NAME = "verl_remote"  # actor_rollout_ref.rollout.name
