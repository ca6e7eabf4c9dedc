"""verl's advantage estimators under verl-remote: each one runs in verl's V1 trainer on the rewards alone, or the
run is refused before Ray in one line naming what it needs.

An estimator runs in verl's TaskRunner, between the rewards and the update; a backend only receives the
advantages it computed, so every estimator that verl's V1 advantage step can feed trains through every backend.
Here each registered estimator goes through that step as verl's V1 trainer calls it (``_compute_advantage``: the
fields it reads from its TransferQueue, padded, then ``compute_advantage_for_multi_trajectories``), so the
refusal list cannot drift from verl's. Runs through each backend with an estimator other than GRPO: rloo on the
local backend (tests/test_train.py), reinforce_plus_plus on Arctic's test server
(tests/arctic/test_arctic_train.py), grpo_passk on SkyRL's Tinker server (tests/tinker_service).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

from verl_remote.discovery.compose import ConfigError, compose_config
from verl_remote.integration.names import ESTIMATORS_V1_CANNOT_FEED

#: 3 prompts x 4 samples, responses of 1 to 6 tokens, the reward on each response's last token.
GROUPS, SAMPLES, WIDTH = 3, 4, 6
LENGTHS = [1 + (i * 5) % WIDTH for i in range(GROUPS * SAMPLES)]
REWARDS = [float((i * 7) % 3) / 2 for i in range(GROUPS * SAMPLES)]


def _step_input() -> tuple[DataProto, list[str]]:
    """What verl's V1 ``_compute_advantage`` hands the estimators: the fields it reads (uid, response_mask,
    rm_scores, the log-probs), padded, ``rm_scores`` as ``token_level_scores`` and ``token_level_rewards``, the uids
    as a non-tensor column; and its TransferQueue keys (``{uid}_{session}_{index}``)."""
    rows = GROUPS * SAMPLES
    mask = torch.zeros(rows, WIDTH, dtype=torch.int64)
    scores = torch.zeros(rows, WIDTH)
    for i, (length, reward) in enumerate(zip(LENGTHS, REWARDS, strict=True)):
        mask[i, :length] = 1
        scores[i, length - 1] = reward
    log_probs = -torch.linspace(0.1, 2.0, rows * WIDTH).reshape(rows, WIDTH) * mask
    data = DataProto.from_dict(
        tensors={
            "response_mask": mask,
            "rm_scores": scores,
            "token_level_scores": scores,
            "token_level_rewards": scores,
            "old_log_probs": log_probs,
            "ref_log_prob": log_probs,
            "rollout_log_probs": log_probs,
        }
    )
    uids = [f"prompt{i // SAMPLES}" for i in range(rows)]
    data.non_tensor_batch["uid"] = np.array(uids, dtype=object)
    return data, [f"{uid}_{i % SAMPLES}_0" for i, uid in enumerate(uids)]


def _run_config(*overrides: str) -> Any:
    return compose_config(["remote_backend=local", *overrides], recipe="demo")


@pytest.fixture(scope="module")
def run_config() -> Any:
    """The demo run's config, composed once for the module (each test sets its estimator on a copy)."""
    return _run_config()


@pytest.mark.parametrize("estimator", sorted(set(ADV_ESTIMATOR_REGISTRY) - {"gae"}))
def test_every_estimator_runs_on_the_rewards_alone_or_is_the_one_refused(estimator: str, run_config: Any) -> None:
    config = copy.deepcopy(run_config)
    config.algorithm.adv_estimator = estimator
    data, keys = _step_input()
    try:
        out = compute_advantage_for_multi_trajectories(
            data,
            batch_keys=keys,
            adv_estimator=estimator,
            gamma=config.algorithm.gamma,
            lam=config.algorithm.lam,
            num_repeat=SAMPLES,
            norm_adv_by_std_in_grpo=config.algorithm.get("norm_adv_by_std_in_grpo", True),
            config=config.algorithm,
        )
    except (AssertionError, KeyError, TypeError) as exc:  # what verl raises for an input it was not given
        assert estimator in ESTIMATORS_V1_CANNOT_FEED, f"{estimator} fails in verl's V1 advantage step: {exc!r}"
        return
    assert estimator not in ESTIMATORS_V1_CANNOT_FEED, f"{estimator} runs in verl's V1 advantage step: accept it"
    advantages, mask = out.batch["advantages"], data.batch["response_mask"]
    assert advantages.shape == (GROUPS * SAMPLES, WIDTH)
    assert bool(torch.isfinite(advantages).all())
    assert bool((advantages[mask == 0] == 0).all())  # nothing outside a response
    assert float(advantages[mask == 1].abs().max()) > 0  # the rewards differ within groups: something to learn


@pytest.mark.faults
def test_the_refused_estimators_are_verls_and_refused_before_ray_naming_what_they_need() -> None:
    from verl_remote.cli.run import prepare_config

    assert set(ESTIMATORS_V1_CANNOT_FEED) <= set(ADV_ESTIMATOR_REGISTRY)
    for estimator, needs in ESTIMATORS_V1_CANNOT_FEED.items():
        with pytest.raises(ConfigError) as refused:
            prepare_config(_run_config(f"algorithm.adv_estimator={estimator}"))
        assert str(refused.value).startswith(f"algorithm.adv_estimator={estimator} needs {needs}: use one that "), (
            refused.value
        )


def test_verls_own_launcher_refuses_them_too_when_it_builds_the_trainer_before_the_backend_is_made() -> None:
    """``python -m verl.trainer.main_ppo`` does not pass through ``verl-remote train``'s checks: the trainer it
    builds refuses the same estimators, and GAE, in the same words, before it makes the backend."""
    from verl_remote.integration.trainer import RemotePPOTrainer

    refused = {**ESTIMATORS_V1_CANNOT_FEED, "gae": "a critic (a value model verl trains beside the actor)"}
    for estimator, needs in refused.items():
        config = _run_config(f"algorithm.adv_estimator={estimator}")
        with pytest.raises(ValueError) as raised:
            RemotePPOTrainer(config)
        assert str(raised.value).startswith(f"algorithm.adv_estimator={estimator} needs {needs}"), raised.value


@pytest.mark.faults
def test_a_name_is_checked_against_verls_registries_as_they_are_a_registered_one_passes() -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_adv_est, register_policy_loss

    from verl_remote.integration.names import unknown_name_problem

    config = _run_config("algorithm.adv_estimator=my_estimator", "actor_rollout_ref.actor.policy_loss.loss_mode=mine")
    assert str(unknown_name_problem(config)).startswith("algorithm.adv_estimator=my_estimator: verl has no ")
    try:  # what a user's module registers is verl's from then on
        register_adv_est("my_estimator")(lambda **kwargs: None)
        assert str(unknown_name_problem(config)).startswith("actor_rollout_ref.actor.policy_loss.loss_mode=mine: ")
        register_policy_loss("mine")(POLICY_LOSS_REGISTRY["vanilla"])
        assert unknown_name_problem(config) is None
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("my_estimator", None)
        POLICY_LOSS_REGISTRY.pop("mine", None)
