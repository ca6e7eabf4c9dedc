"""verl_remote.kit.compute: the layout helpers against verl's own slicing, and verl's actor loss by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

from verl_remote.discovery.compose import compose_config
from verl_remote.kit.compute import actor_loss, response_index, response_values


def _jagged(rows: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def test_response_token_j_is_scored_at_position_n_minus_r_minus_1_plus_j() -> None:
    # Row 0: 3 prompt + 2 response tokens; row 1: 2 prompt + 1 response token.
    assert response_index([5, 3], [2, 1]).tolist() == [2, 3, 6]
    with pytest.raises(ValueError, match="prompt of at least one token"):
        response_index([2], [2])


def test_response_values_slice_as_verls_own_padding_helper_does() -> None:
    from verl.workers.utils.padding import no_padding_2_padding

    torch.manual_seed(0)
    prompt_lengths, response_lengths = [3, 1, 4, 2], [2, 5, 1, 3]
    values = _jagged([torch.randn(p + r).tolist() for p, r in zip(prompt_lengths, response_lengths, strict=True)])
    data = TensorDict(
        {
            "prompts": _jagged([[1.0] * p for p in prompt_lengths], torch.long),
            "responses": _jagged([[1.0] * r for r in response_lengths], torch.long),
        },
        batch_size=[4],
    )
    verls = no_padding_2_padding(values, data)  # [B, max_r], right-padded with 0
    mine = response_values(values, data["responses"])
    assert mine.offsets().diff().tolist() == response_lengths
    for row, r in enumerate(response_lengths):
        assert torch.equal(mine[row], verls[row, :r])


def _mini_batch(advantages: list[list[float]], old: list[list[float]], prompts: list[int]) -> dict[str, Any]:
    responses = [len(a) for a in advantages]
    return {
        "input_ids": _jagged([[1.0] * (p + r) for p, r in zip(prompts, responses, strict=True)], torch.long),
        "prompts": _jagged([[1.0] * p for p in prompts], torch.long),
        "responses": _jagged([[1.0] * r for r in responses], torch.long),
        "response_mask": _jagged([[1.0] * r for r in responses], torch.long),
        "old_log_probs": _jagged(old),
        "advantages": _jagged(advantages),
    }


def _row_log_probs(prompts: list[int], response_log_probs: list[list[float]]) -> torch.Tensor:
    """Whole-row predict-next log-probs: the response's at n-r-1+j, junk before, 0 last."""
    rows = [[-9.0] * (p - 1) + lp + [0.0] for p, lp in zip(prompts, response_log_probs, strict=True)]
    return _jagged(rows).requires_grad_(True)


def _actor(*overrides: str) -> Any:
    return compose_config(list(overrides), recipe="demo").actor_rollout_ref.actor


def test_actor_loss_is_verls_vanilla_ppo_loss_by_hand() -> None:
    prompts = [2, 3]
    advantages = [[1.0, 1.0, 1.0], [-2.0]]
    old = [[-1.0, -1.0, -1.0], [-0.5]]
    batch = _mini_batch(advantages, old, prompts)
    meta = {"dp_size": 1, "batch_num_tokens": 4, "global_batch_size": 2}

    # New log-probs equal to the old ones: ratio 1, so the clipped loss is -A averaged over the 4 tokens.
    log_probs = _row_log_probs(prompts, old)
    loss, metrics = actor_loss(log_probs, batch, meta, _actor())
    assert loss.item() == pytest.approx(-(1 + 1 + 1 - 2) / 4)
    assert metrics["pg_loss"] == pytest.approx(loss.item()) and metrics["loss"] == pytest.approx(loss.item())
    assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == pytest.approx(0.0)
    loss.backward()
    grads = log_probs.grad.values()  # d loss / d log p = -A / 4 on response positions, 0 elsewhere
    assert grads.tolist() == pytest.approx([0.0, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.5, 0.0])

    # A ratio far above 1 + clip_ratio_high with positive advantages is clipped: no gradient there.
    high = _row_log_probs(prompts, [[0.0, 0.0, 0.0], [-0.5]])
    loss, metrics = actor_loss(high, batch, meta, _actor())
    assert metrics["pg_clipfrac"] == pytest.approx(3 / 4)
    loss.backward()
    assert high.grad.values()[1:4].abs().sum() == 0


def test_actor_loss_follows_loss_agg_mode_and_adds_the_kl_term() -> None:
    prompts = [2, 3]
    advantages = [[1.0, 1.0, 1.0], [-2.0]]
    old = [[-1.0, -1.0, -1.0], [-0.5]]
    meta = {"dp_size": 1, "batch_num_tokens": 4, "global_batch_size": 2}
    seq_mean, _ = actor_loss(
        _row_log_probs(prompts, old),
        _mini_batch(advantages, old, prompts),
        meta,
        _actor("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"),
    )
    assert seq_mean.item() == pytest.approx((-1.0 + 2.0) / 2)  # the mean of each row's token mean

    batch = _mini_batch(advantages, old, prompts)
    batch["ref_log_prob"] = _jagged([[-1.5, -1.0, -1.0], [-0.5]])
    loss, metrics = actor_loss(
        _row_log_probs(prompts, old),
        batch,
        meta,
        _actor(
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.actor.kl_loss_coef=0.5",
        ),
    )
    from verl.trainer.ppo.core_algos import kl_penalty

    kl = kl_penalty(torch.tensor([-1.0]), torch.tensor([-1.5]), "low_var_kl").item() / 4  # one token differs
    assert metrics["kl_loss"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(-0.25 + 0.5 * kl)


# What verl itself requires besides the mode (its own errors say so).
NEEDS = {"dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"]}


@pytest.mark.parametrize("loss_mode", sorted(POLICY_LOSS_REGISTRY))
def test_every_policy_loss_the_actor_config_can_select_runs_and_trains(loss_mode: str) -> None:
    torch.manual_seed(0)
    prompts = [2, 3, 4]
    old = [torch.randn(r).mul(0.1).sub(1).tolist() for r in (3, 2, 4)]
    batch = _mini_batch([torch.randn(len(o)).tolist() for o in old], old, prompts)
    log_probs = _row_log_probs(prompts, [[v + 0.05 for v in o] for o in old])
    loss, metrics = actor_loss(
        log_probs,
        batch,
        {"dp_size": 1, "batch_num_tokens": 9, "global_batch_size": 3},
        _actor(f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", *NEEDS.get(loss_mode, ())),
    )
    assert torch.isfinite(loss) and all(v == v for v in metrics.values())
    loss.backward()
    assert log_probs.grad.values().abs().sum() > 0


def test_actor_loss_names_what_the_mini_batch_lacks() -> None:
    batch = _mini_batch([[1.0]], [[-1.0]], [2])
    del batch["advantages"]
    with pytest.raises(ValueError, match=r"lacks \['advantages'\]"):
        actor_loss(_row_log_probs([2], [[-1.0]]), batch, {}, _actor())


def test_a_backend_that_reports_its_flops_gets_mfu_from_them() -> None:
    from verl_remote.integration.worker import RemoteForwarderWorker

    class Worker(RemoteForwarderWorker):
        def backend_device_name(self) -> str:
            return "CPU"  # 448 GFLOPS in verl's table

        def backend_flops(self, seqlens: list[int]) -> float:
            return 1e9 * sum(seqlens)

    worker = object.__new__(Worker)  # the MFU arithmetic only: no Ray, no service
    worker._flops, worker._world_size = None, 1
    # 2 epochs over 224 tokens at 1 GFLOP each in 2 s: 224 GFLOPS of the CPU's 448.
    assert worker._mfu([100, 124], elapsed=2.0, epochs=2) == pytest.approx(0.5)
    worker._world_size = 2
    assert worker._mfu([100, 124], elapsed=2.0, epochs=2) == pytest.approx(0.25)
