"""The /initialize bodies verl-arctic sends, and what it refuses before sending anything.

Each body is checked against our model of what Arctic's DeepSpeed accepts
(:func:`verl_arctic.testing.engine.deepspeed_setup`); that model is itself
checked against Arctic's own server in tests/arctic/test_real_server.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from verl_arctic.jobs import job_configs, refusal_hint
from verl_arctic.testing.engine import DeepSpeedRefusal, deepspeed_setup, reference_setup
from verl_remote.discovery.compose import compose_config

GENERATIONS = ["v0.1", "main"]


def _jobs(generation: str, *overrides: str) -> dict[str, dict[str, Any]]:
    config = compose_config(
        ["remote_backend=arctic", "actor_rollout_ref.actor.use_kl_loss=true", *overrides], recipe="demo"
    )
    return job_configs(config, generation)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_default_jobs_are_ones_arctics_deepspeed_builds(generation: str) -> None:
    jobs = _jobs(generation)
    assert list(jobs) == ["sampling", "log_prob", "training"]  # Arctic's creation order
    training = jobs["training"]
    setup = deepspeed_setup(training, generation, world=1)
    assert training["ds_config"]["zero_optimization"]["stage"] == 2  # stage 0 is refused in bf16
    assert setup.train_batch == setup.micro_batch * setup.accumulation
    assert training["ds_worker_config"]["attn_implementation"] == "flash_attention_2"
    reference_setup(jobs["log_prob"], generation)
    assert jobs["log_prob"]["log_prob_config"]["zero_optimization"]["stage"] == 0
    if generation == "main":
        assert "scheduler" not in training["ds_config"]  # a constant rate is no DeepSpeed scheduler at all


@pytest.mark.parametrize("generation", GENERATIONS)
def test_an_attention_override_and_zero_3_reach_both_deepspeed_jobs(generation: str) -> None:
    jobs = _jobs(
        generation,
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "remote_backend.train.deepspeed.zero_optimization.stage=3",
    )
    assert jobs["training"]["ds_worker_config"]["attn_implementation"] == "sdpa"
    assert jobs["log_prob"]["ds_worker_config"]["attn_implementation"] == "sdpa"
    assert jobs["log_prob"]["log_prob_config"]["zero_optimization"]["stage"] == 3
    reference_setup(jobs["log_prob"], generation)


@pytest.mark.parametrize(
    ("overrides", "kind", "warmup"),
    [
        (["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5"], "WarmupLR", 2),
        (["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"], "WarmupCosineLR", 1),
        (
            [
                "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                "actor_rollout_ref.actor.optim.lr_warmup_steps=3",
            ],
            "WarmupCosineLR",
            3,
        ),
    ],
)
def test_main_schedules_use_only_their_own_deepspeed_arguments(overrides: list[str], kind: str, warmup: int) -> None:
    jobs = _jobs("main", "trainer.total_training_steps=4", *overrides)
    scheduler = deepspeed_setup(jobs["training"], "main", world=1).scheduler
    assert scheduler is not None and scheduler["type"] == kind
    assert scheduler["params"]["warmup_num_steps"] == warmup and scheduler["params"]["warmup_type"] == "linear"


def test_a_v01_warmup_is_what_deepspeed_refuses_and_the_hint_says_so() -> None:
    jobs = _jobs("v0.1", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.25", "trainer.total_training_steps=4")
    with pytest.raises(DeepSpeedRefusal, match="warmup_num_steps must be a positive integer"):
        deepspeed_setup(jobs["training"], "v0.1", world=1)
    assert "constant learning rate without warm-up" in refusal_hint("training", jobs["training"], "v0.1")
    stage0 = _jobs("main", "remote_backend.train.deepspeed.zero_optimization.stage=0")["training"]
    assert "set remote_backend.train.deepspeed.zero_optimization.stage to 1, 2 or 3" in refusal_hint(
        "training", stage0, "main"
    )


def test_a_mini_batch_that_does_not_divide_into_micro_batches_is_refused_with_the_keys() -> None:
    with pytest.raises(ValueError, match="change ppo_mini_batch_size or ppo_micro_batch_size_per_gpu"):
        _jobs("main", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_loss_travels_with_each_update_not_in_the_jobs(generation: str) -> None:
    """Every policy loss, clip ratio and aggregation trains on the same jobs (verl_arctic.loss; tests/arctic/
    test_loss.py): nothing of them is refused, nor in an /initialize body."""
    losses = [
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.clip_ratio_c=10.0",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
    ]
    assert _jobs(generation, *losses) == _jobs(generation)


@pytest.mark.faults
def test_seq_mean_token_mean_with_an_entropy_bonus_is_refused_before_the_run() -> None:
    """Arctic's servers pack a micro-batch into one sequence, so they cannot weigh the entropy bonus per response
    (verl_arctic.loss); the loss alone trains, carried."""
    per_response = "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"
    assert _jobs("main", per_response) == _jobs("main")
    with pytest.raises(ValueError, match=r"pack each micro-batch into one sequence .* set entropy_coeff=0"):
        _jobs("main", per_response, "actor_rollout_ref.actor.entropy_coeff=0.01")
