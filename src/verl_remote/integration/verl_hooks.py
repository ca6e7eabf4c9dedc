"""What verl-remote registers in verl's registries, right after verl imports them (see
:mod:`verl_remote.integration.verl_plugin`).

Both registrations are lazy: nothing of verl-remote's trainer or rollout code is imported until verl asks for
``trainer.v1.trainer_mode=remote`` (or ``remote_async``) or ``actor_rollout_ref.rollout.name=verl_remote``. The
trainer must stay lazy: verl imports its trainer registry while it may still be importing
``verl.trainer.main_ppo``, which verl-remote's trainer module imports in turn.
"""

from __future__ import annotations

from typing import Any

from verl_remote.integration.names import ASYNC_MODE, MODE, ROLLOUT_NAME

__all__ = ["MODE", "ROLLOUT_NAME", "on_rollout_replica", "on_trainer_base"]


class _Trainers(dict):  # type: ignore[type-arg]
    """verl's trainer registry, which imports verl-remote's trainer the first time ``remote`` is looked up."""

    def __missing__(self, name: str) -> Any:
        if name in (MODE, ASYNC_MODE):
            # registers RemotePPOTrainer under both names, in this dict
            import verl_remote.integration.trainer  # noqa: F401

            if name in self:
                return dict.__getitem__(self, name)
        raise KeyError(name)


def on_trainer_base(module: Any) -> None:
    if not isinstance(module.TRAINER_REGISTRY, _Trainers):
        # verl's functions read the module global at call time, so replacing it is enough.
        module.TRAINER_REGISTRY = _Trainers(module.TRAINER_REGISTRY)


def _replica_class() -> type:
    from verl_remote.integration.rollout import BackendRolloutReplica

    return BackendRolloutReplica


def on_rollout_replica(module: Any) -> None:
    module.RolloutReplicaRegistry.register(ROLLOUT_NAME, _replica_class)
