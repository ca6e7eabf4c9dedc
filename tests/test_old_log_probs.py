"""Where a step's old log-probs come from (integration/old_log_probs.py): the decision and its measure. The demo run
(tests/test_train.py) shows a run taking the sampler's; the Tinker runs (tests/tinker_service) the same on a service."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from verl_remote.integration.old_log_probs import OldLogProbs, max_difference, old_log_probs_problem


def _config(**overrides: object) -> object:
    config = OmegaConf.create(
        {
            "remote_old_log_probs": {"source": "auto", "tolerance": 1e-4, "check_every": 10},
            "actor_rollout_ref": {"rollout": {"calculate_log_probs": True}},
            "algorithm": {"rollout_correction": {"bypass_mode": False, "rollout_is": None, "rollout_rs": None}},
        }
    )
    for key, value in overrides.items():
        OmegaConf.update(config, key.replace("__", "."), value)
    return config


def _run(choice: OldLogProbs, first: int, last: int, differences: dict[int, float]) -> tuple[list[str], list[str]]:
    """What each step of ``first..last`` does, each check measuring ``differences`` (else 1e-7); the lines said."""
    plans, said = [], []
    for step in range(first, last + 1):
        plans.append(choice.plan(step))
        if plans[-1] == "check" and (line := choice.checked(differences.get(step, 1e-7), step)):
            said.append(line)
    return plans, said


def test_a_synchronous_run_takes_the_samplers_after_two_checks_and_checks_again_every_check_every_steps() -> None:
    plans, said = _run(OldLogProbs.of(_config(), overlap=False), 1, 21, {})
    assert [step for step, plan in enumerate(plans, 1) if plan != "sampler"] == [1, 2, 10, 20]
    assert set(plans) == {"check", "sampler"}
    assert said == [
        "verl-remote: from step 3 the old log-probs are the sampler's, without verl's second forward pass: they "
        "equal the trainer's within 0.0001 (checked every 10 steps; remote_old_log_probs.source=recompute keeps the "
        "pass)"
    ]
    # A resumed run (or a restart) checks at its own first two steps; check_every=0: none after them.
    plans, said = _run(OldLogProbs.of(_config(remote_old_log_probs__check_every=0), overlap=False), 7, 30, {})
    assert plans[:2] == ["check", "check"] and set(plans[2:]) == {"sampler"}
    assert said[0].startswith("verl-remote: from step 9 the old log-probs") and "(checked no more;" in said[0]


@pytest.mark.parametrize(("step", "difference"), [(1, 3e-3), (2, 2e-4), (10, float("nan"))])
def test_a_check_beyond_the_tolerance_recomputes_from_then_on(step: int, difference: float) -> None:
    plans, said = _run(OldLogProbs.of(_config(), overlap=False), 1, 15, {step: difference})
    assert set(plans[step:]) == {"recompute"} and "recompute" not in plans[:step]
    assert said[-1] == (
        f"verl-remote: the sampler's log-probs differ from the trainer's by up to {difference:.3g} at step {step}, "
        "more than remote_old_log_probs.tolerance=0.0001: verl's forward pass computes the old log-probs at every "
        "step"
    )


@pytest.mark.parametrize(
    ("overrides", "overlap", "reason"),
    [
        ({"remote_old_log_probs__source": "recompute"}, False, "remote_old_log_probs.source=recompute"),
        ({}, True, "samples while it trains"),
        ({"actor_rollout_ref__rollout__calculate_log_probs": False}, False, "calculate_log_probs=false"),
        ({"algorithm__rollout_correction__bypass_mode": True}, False, "bypass_mode=true"),
        ({"algorithm__rollout_correction__rollout_is": "token"}, False, "corrects for the sampler"),
        ({"algorithm__rollout_correction__rollout_rs": "token_k1"}, False, "corrects for the sampler"),
    ],
)
def test_a_run_whose_sampler_is_not_its_trainer_or_that_says_so_recomputes(
    overrides: dict[str, object], overlap: bool, reason: str
) -> None:
    choice = OldLogProbs.of(_config(**overrides), overlap=overlap)
    assert reason in choice.reason
    # verl's pass at these weights is the model's own, but for verl's bypass mode (the sampler's, unchecked).
    assert choice.current("recompute") is ("bypass_mode" not in reason)
    assert _run(choice, 1, 12, {}) == (["recompute"] * 12, [])


def test_bad_settings_are_named() -> None:
    assert old_log_probs_problem(_config()) is None
    assert old_log_probs_problem(OmegaConf.create({})) is None  # verl's own launcher with an older recipe: auto
    assert old_log_probs_problem(_config(remote_old_log_probs__source="sampler")) == (
        "remote_old_log_probs.source=sampler: expected one of auto, recompute"
    )
    for bad in (-1.0, "x", True):
        problem = old_log_probs_problem(_config(remote_old_log_probs__tolerance=bad))
        assert problem is not None and problem.startswith(f"remote_old_log_probs.tolerance={bad}: expected")
    for bad in (-1, 2.5, "x"):
        problem = old_log_probs_problem(_config(remote_old_log_probs__check_every=bad))
        assert problem is not None and problem.startswith(f"remote_old_log_probs.check_every={bad}: expected an")


def test_the_difference_is_over_response_tokens_only_jagged_or_padded() -> None:
    old = torch.nested.nested_tensor_from_jagged(torch.tensor([-1.0, -2.0, -3.0, -0.5]), torch.tensor([0, 3, 4]))
    sampled = torch.nested.nested_tensor_from_jagged(torch.tensor([-1.0, -2.5, -9.0, -0.5]), torch.tensor([0, 3, 4]))
    mask = torch.nested.nested_tensor_from_jagged(torch.tensor([1, 1, 0, 1]), torch.tensor([0, 3, 4]))
    assert max_difference(old, sampled, mask) == pytest.approx(0.5)  # the 6.0 is a masked-out token's
    padded = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    assert max_difference(padded, padded + 0.25, torch.tensor([[1, 1], [1, 0]])) == 0.25
    assert max_difference(padded, padded, torch.zeros(2, 2)) == 0.0
    with pytest.raises(ValueError, match="not of the response mask's layout"):
        max_difference(padded, torch.zeros(2, 3), torch.ones(2, 2))


def test_a_config_without_the_section_gets_verl_remote_yamls_defaults() -> None:
    """verl's own launcher with a config composed before the section existed reads the same defaults."""
    from importlib.resources import files

    from verl_remote.integration import old_log_probs

    yaml = OmegaConf.load(str(files("verl_remote.config") / "verl_remote.yaml")).remote_old_log_probs
    assert dict(yaml) == {
        "source": "auto",
        "tolerance": old_log_probs.TOLERANCE,
        "check_every": old_log_probs.CHECK_EVERY,
    }
    bare = OldLogProbs.of(
        OmegaConf.create({"actor_rollout_ref": {"rollout": {"calculate_log_probs": True}}}), overlap=False
    )
    assert (bare.tolerance, bare.check_every, bare.reason) == (old_log_probs.TOLERANCE, old_log_probs.CHECK_EVERY, "")
