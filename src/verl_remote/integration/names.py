"""The names verl-remote registers in verl's registries (:mod:`verl_remote.integration.verl_hooks`), set in a
run's config; and who launched the run whose trainer is being built (:data:`LAUNCHER`)."""

from __future__ import annotations

from contextvars import ContextVar

from verl_remote.kit.config import OVERLAPPED_MODE

__all__ = ["ASYNC_MODE", "ESTIMATORS_V1_CANNOT_FEED", "LAUNCHER", "MODE", "ROLLOUT_NAME"]

MODE = "remote"  # trainer.v1.trainer_mode
ASYNC_MODE = OVERLAPPED_MODE  # trainer.v1.trainer_mode: the next step samples while this one trains
ROLLOUT_NAME = "verl_remote"  # actor_rollout_ref.rollout.name

#: verl's advantage estimators that its V1 trainer (the one verl-remote runs) cannot feed, with what they need: its
#: advantage step passes an estimator the rewards, masks, group ids and log-probs only (verl 0.9.1
#: trainer/ppo/v1/trainer_base.py, ``_compute_advantage``). tests/test_estimators.py runs every registered
#: estimator through that step, so this list cannot drift from verl's. GAE, which needs a critic, is refused apart.
_SUM_PI_SQUARED = (
    "the actor's per-token sum of squared probabilities (sum_pi_squared), which verl's V1 trainer does not pass to it"
)
ESTIMATORS_V1_CANNOT_FEED = {
    "remax": "a greedy baseline sample of every prompt, which verl's V1 trainer does not make",
    "optimal_token_baseline": _SUM_PI_SQUARED,
    "tir_optimal_token_baseline": _SUM_PI_SQUARED,
    "gdpo": "each reward component apart (algorithm.gdpo_reward_keys), which verl's V1 trainer does not pass to it",
}

#: Who launched the run whose trainer is built in this context: "cli" (``verl-remote train``, through
#: ``RemoteTaskRunner``) or "verl" (verl's own launcher, ``python -m verl.trainer.main_ppo``, or ``ray job submit``
#: of it). Set by the runner around verl's ``run``, which builds the trainer in the same thread.
LAUNCHER: ContextVar[str] = ContextVar("verl_remote_launcher", default="verl")
