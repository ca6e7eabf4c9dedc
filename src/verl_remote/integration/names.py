"""The names verl-remote registers in verl's registries (:mod:`verl_remote.integration.verl_hooks`), set in a
run's config; and who launched the run whose trainer is being built (:data:`LAUNCHER`)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from omegaconf import OmegaConf

from verl_remote.kit.config import OVERLAPPED_MODE

__all__ = [
    "ASYNC_MODE",
    "ESTIMATORS_ON_REWARDS",
    "ESTIMATORS_V1_CANNOT_FEED",
    "LAUNCHER",
    "MODE",
    "RESTARTS",
    "ROLLOUT_NAME",
    "estimator_problem",
    "unknown_name_problem",
]

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

#: The estimators a refused one may be replaced with: verl's that need only the rewards (tests/test_estimators.py).
ESTIMATORS_ON_REWARDS = "algorithm.adv_estimator=grpo, rloo, reinforce_plus_plus, opo, gpg, grpo_passk, ..."


def estimator_problem(config: Any) -> str | None:
    """Why no backend can train the run's advantage estimator (a critic, or an input verl's V1 trainer does not
    pass to it), in one line with the fix; None when it can. Both launchers ask: ``verl-remote train`` before Ray,
    verl's own when it builds the trainer, before the backend is made."""
    from verl.trainer.ppo.utils import need_critic

    if need_critic(config):
        asked = (
            "critic.enable=true"
            if config.critic.get("enable")
            else f"algorithm.adv_estimator={config.algorithm.adv_estimator}"
        )
        return (
            f"{asked} needs a critic (a value model verl trains beside the actor), and no verl-remote backend "
            f"trains one: use an estimator that needs none ({ESTIMATORS_ON_REWARDS})"
        )
    estimator = str(config.algorithm.adv_estimator)
    if estimator in ESTIMATORS_V1_CANNOT_FEED:
        return (
            f"algorithm.adv_estimator={estimator} needs {ESTIMATORS_V1_CANNOT_FEED[estimator]}: use one that needs "
            f"only the rewards ({ESTIMATORS_ON_REWARDS})"
        )
    return None


def unknown_name_problem(config: Any) -> str | None:
    """An advantage estimator or a policy loss verl has no such name for, in one line with the nearest names; None
    when verl has both (read from verl's own registries, which a run's imports may have added to). verl itself
    finds out only at the first step's advantage, or the first update."""
    import difflib

    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, AdvantageEstimator

    estimators = set(ADV_ESTIMATOR_REGISTRY) | {estimator.value for estimator in AdvantageEstimator}
    for key, known, what in (
        ("algorithm.adv_estimator", estimators, "advantage estimator"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", set(POLICY_LOSS_REGISTRY), "policy loss"),
    ):
        name = OmegaConf.select(config, key, default=None)
        if name is None or str(name) in known:
            continue
        near = difflib.get_close_matches(str(name), sorted(known), n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        if key == "algorithm.adv_estimator" and str(name).lower() == "ppo":  # verl's PPO is GAE with a critic
            hint = "PPO's is gae, which needs a critic no verl-remote backend trains; GRPO's is grpo. "
        return f"{key}={name}: verl has no {what} of that name; {hint}verl's: {', '.join(sorted(known))}"
    return None


#: Who launched the run whose trainer is built in this context: "cli" (``verl-remote train``, through
#: ``RemoteTaskRunner``) or "verl" (verl's own launcher, ``python -m verl.trainer.main_ppo``, or ``ray job submit``
#: of it). Set by the runner around verl's ``run``, which builds the trainer in the same thread.
LAUNCHER: ContextVar[str] = ContextVar("verl_remote_launcher", default="verl")

#: How many times ``verl-remote train`` restarted this run after a transient fault before this attempt (each step
#: logs it as ``verl_remote/restarts``). Set by the runner like :data:`LAUNCHER`.
RESTARTS: ContextVar[int] = ContextVar("verl_remote_restarts", default=0)
