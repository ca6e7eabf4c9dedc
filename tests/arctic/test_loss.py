"""verl's loss through Arctic's verl_grpo (verl_arctic.loss): for every policy loss, aggregation and the KL
term, the gradient the server's loss takes with respect to the log-probs is verl's.

The server's side is our model of Arctic's ``verl_grpo`` (verl_arctic.testing.engine, traced to
arctic-platform's code; tests/arctic/test_real_server.py holds it to Arctic's own server); verl's side is
verl's ``ppo_loss`` through :func:`verl_remote.actor_loss_gradient`.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss

from verl_arctic.loss import ARCTIC_LOSS, Aggregation, aggregation, carried_advantages, single_pass
from verl_arctic.testing.engine import _agg_loss, verl_grpo
from verl_arctic.worker import verl_grpo_request
from verl_remote import actor_loss, actor_loss_gradient, as_dict, response_values
from verl_remote.discovery.compose import compose_config

AGGREGATIONS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
#: What verl itself requires besides the mode (its own errors say so).
NEEDS = {"dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"]}
PAD = 0


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _mini_batch(seed: int, kl: bool) -> tuple[dict[str, Any], torch.Tensor, dict[str, Any]]:
    """Rows of different prompt and response lengths, old log-probs off the current ones by up to 0.6 (so that
    clips bite), mixed advantages; the current weights' log-probs over whole rows; verl's meta."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [3, 1, 4, 2, 5, 2], [1, 7, 2, 6, 3, 5]
    rows = [torch.randint(1, 50, (p + r,), generator=g) for p, r in zip(prompts, responses, strict=True)]
    current = [-torch.rand(p + r, generator=g) * 3 for p, r in zip(prompts, responses, strict=True)]
    for row in current:
        row[-1] = 0.0
    ours = [c[p - 1 : p - 1 + r] for c, p, r in zip(current, prompts, responses, strict=True)]
    batch: dict[str, Any] = {
        "input_ids": _jagged(rows),
        "prompts": _jagged([row[:p] for row, p in zip(rows, prompts, strict=True)]),
        "responses": _jagged([row[p:] for row, p in zip(rows, prompts, strict=True)]),
        "response_mask": _jagged([torch.ones(r, dtype=torch.long) for r in responses]),
        "old_log_probs": _jagged([o + (torch.rand(len(o), generator=g) - 0.5) * 1.2 for o in ours]),
        "advantages": _jagged(
            [torch.full((r,), float(a)) for r, a in zip(responses, [1, -1, 0.5, -2, 1.5, -0.5], strict=True)]
        ),
    }
    if kl:
        batch["ref_log_prob"] = _jagged([o + (torch.rand(len(o), generator=g) - 0.5) * 0.4 for o in ours])
    tokens = sum(responses)
    meta = {"dp_size": 1, "batch_num_tokens": tokens, "global_batch_size": len(rows), "temperature": 1.0}
    return batch, _jagged(current), meta


@functools.cache
def _composed() -> Any:
    return compose_config(["remote_backend=arctic"], recipe="demo").actor_rollout_ref.actor


def _actor(*overrides: str) -> dict[str, Any]:
    """verl-arctic's actor config with ``overrides`` (``actor_rollout_ref.actor.`` keys), as a run's forwarder has
    it (composed once: the overrides are set on a copy)."""
    actor = _composed().copy()
    for override in overrides:
        key, value = override.removeprefix("actor_rollout_ref.actor.").split("=", 1)
        OmegaConf.update(actor, key, yaml.safe_load(value), force_add=True)
    return as_dict(actor)


def _verls_gradient(
    batch: dict[str, Any], current: torch.Tensor, meta: dict[str, Any], actor: dict[str, Any]
) -> list[torch.Tensor]:
    """d(verl's actor loss)/d(log-probs) of the response tokens, row by row, by autograd through actor_loss."""
    leaf = current.values().clone().requires_grad_(True)
    loss, _ = actor_loss(torch.nested.nested_tensor_from_jagged(leaf, current.offsets()), batch, meta, actor)
    loss.backward()
    assert leaf.grad is not None
    grad = torch.nested.nested_tensor_from_jagged(leaf.grad, current.offsets())
    return list(response_values(grad, batch["response_mask"]).unbind(0))


def _server_gradient(batch: dict[str, Any], current: torch.Tensor, body: dict[str, Any]) -> list[torch.Tensor]:
    """d(verl_grpo's loss)/d(log-probs) of the response tokens, row by row, the server's log-probs being
    ``current`` laid out as it lays them out (dense, left-padded prompts, roll(-1))."""
    dense = body["batch"]
    width_p = dense["prompts"].shape[1]
    leaf = torch.zeros(dense["input_ids"].shape, dtype=torch.float32)
    prompts = [len(p) for p in batch["prompts"].unbind(0)]
    responses = [len(r) for r in batch["responses"].unbind(0)]
    for b, (row, p, r) in enumerate(zip(current.unbind(0), prompts, responses, strict=True)):
        leaf[b, width_p - p : width_p + r] = row
    leaf.requires_grad_(True)
    meta = {**body["meta"], "dp_size": 1}
    loss, _ = verl_grpo(leaf, None, dense, meta)
    loss.backward()
    assert leaf.grad is not None
    return [leaf.grad[b, width_p - 1 : width_p - 1 + r] for b, r in enumerate(responses)]


#: Every policy loss under verl's default aggregation, and every aggregation under three policy losses (the
#: aggregation's weight is the carried advantage's divisor, whatever the loss).
CASES = [(mode, "token-mean") for mode in sorted(POLICY_LOSS_REGISTRY)] + [
    (mode, agg) for agg in AGGREGATIONS[1:] for mode in ("vanilla", "gspo", "cispo")
]


@pytest.mark.parametrize(("loss_mode", "agg"), CASES)
def test_the_carried_gradient_is_verls_for_every_policy_loss_and_aggregation(loss_mode: str, agg: str) -> None:
    kl = agg in ("token-mean", "seq-mean-token-mean")  # the KL term rides along on some of them
    batch, current, meta = _mini_batch(seed=len(loss_mode) + len(agg), kl=kl)
    settings = [
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        f"actor_rollout_ref.actor.loss_agg_mode={agg}",
        f"actor_rollout_ref.actor.use_kl_loss={kl}",
        "actor_rollout_ref.actor.kl_loss_coef=0.3",
        *NEEDS.get(loss_mode, ()),
    ]
    actor = _actor(*settings)
    gradient, _ = actor_loss_gradient(current, batch, meta, actor)
    verls = list(response_values(gradient, batch["response_mask"]).unbind(0))
    assert sum(float(g.abs().sum()) for g in verls) > 0

    how = aggregation(actor, meta, batch["response_mask"])
    carried = carried_advantages(verls, list(batch["response_mask"].unbind(0)), how)
    wire = {k: v for k, v in actor.items() if not isinstance(v, dict | list)}
    wire |= {"loss_agg_mode": how.mode, "use_kl_loss": False, **ARCTIC_LOSS}
    body = verl_grpo_request(batch, PAD, {}, how, wire, response_values(current, batch["response_mask"]), carried)
    theirs = _server_gradient(batch, current, body)
    for row, (mine, server) in enumerate(zip(verls, theirs, strict=True)):
        assert torch.allclose(server, mine, rtol=1e-4, atol=1e-7), (row, mine, server)


@pytest.mark.parametrize("agg", [agg for agg in AGGREGATIONS if agg != "seq-mean-token-mean"])
def test_vanilla_at_arctics_clip_ratios_is_one_pass_and_its_gradient_is_verls(agg: str) -> None:
    batch, current, meta = _mini_batch(seed=7, kl=True)
    actor = _actor(f"actor_rollout_ref.actor.loss_agg_mode={agg}", "actor_rollout_ref.actor.use_kl_loss=true")
    assert single_pass(actor, batch)
    verls = _verls_gradient(batch, current, meta, actor)

    how = aggregation(actor, meta, batch["response_mask"])
    wire = {k: v for k, v in actor.items() if not isinstance(v, dict | list)} | {"loss_agg_mode": how.mode}
    body = verl_grpo_request(batch, PAD, {}, how, wire, batch["old_log_probs"])
    theirs = _server_gradient(batch, current, body)
    for mine, server in zip(verls, theirs, strict=True):
        assert torch.allclose(server, mine, rtol=1e-4, atol=1e-7)


def test_the_servers_own_seq_mean_token_mean_averages_a_micro_batch_so_verls_is_carried_without_it() -> None:
    """Arctic's servers pack a micro-batch's rows into one sequence before their loss (the test server models it:
    verl_arctic.testing.engine._packed), so their seq-mean-token-mean divides each token by the micro-batch's
    tokens, not its response's: sent as such, vanilla's gradient is not verl's (what the gradient check found on
    Arctic's own 0.1.4 server, docs/measurements.md). verl-arctic carries it through seq-mean-token-sum, and an
    entropy bonus, which only the server's own aggregation could weigh, is refused."""
    batch, current, meta = _mini_batch(seed=7, kl=False)
    actor = _actor("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
    assert not single_pass(actor, batch)
    verls = _verls_gradient(batch, current, meta, actor)
    # What verl-arctic sent before: the server's own seq-mean-token-mean, in one pass.
    own = Aggregation("seq-mean-token-mean", meta["batch_num_tokens"], float(meta["global_batch_size"]))
    wire = {k: v for k, v in actor.items() if not isinstance(v, dict | list)} | {"loss_agg_mode": own.mode}
    theirs = _server_gradient(batch, current, verl_grpo_request(batch, PAD, {}, own, wire, batch["old_log_probs"]))
    off = [float((server - mine).abs().max() / mine.abs().max()) for mine, server in zip(verls, theirs, strict=True)]
    assert max(off) > 0.5, off  # each row weighed by its share of the micro-batch's tokens, not 1 / its own

    how = aggregation(actor, meta, batch["response_mask"])
    assert how.mode == "seq-mean-token-sum"
    carried = carried_advantages(verls, list(batch["response_mask"].unbind(0)), how)
    wire |= {"loss_agg_mode": how.mode, "use_kl_loss": False, **ARCTIC_LOSS}
    body = verl_grpo_request(batch, PAD, {}, how, wire, response_values(current, batch["response_mask"]), carried)
    for mine, server in zip(verls, _server_gradient(batch, current, body), strict=True):
        assert torch.allclose(server, mine, rtol=1e-4, atol=1e-7)

    with pytest.raises(ValueError, match="pack each micro-batch into one sequence"):
        aggregation({**actor, "entropy_coeff": 0.01}, meta, batch["response_mask"])


@pytest.mark.parametrize("agg", [agg for agg in AGGREGATIONS if agg != "seq-mean-token-mean"])
def test_the_servers_aggregation_is_verls_for_the_entropy_bonus(agg: str) -> None:
    batch, _, meta = _mini_batch(seed=3, kl=False)
    mask = torch.nested.to_padded_tensor(batch["response_mask"], 0)
    entropy = torch.rand(mask.shape)
    verls = agg_loss(entropy, mask, agg, dp_size=1, batch_num_tokens=meta["batch_num_tokens"],
                     global_batch_size=meta["global_batch_size"])  # fmt: skip
    how = aggregation(_actor(f"actor_rollout_ref.actor.loss_agg_mode={agg}"), meta, batch["response_mask"])
    # The server's dense layout is wider (the prompt's width first): the responses' values sit after zeros.
    wide = torch.cat([torch.zeros(mask.shape[0], 4), entropy], dim=1)
    wide_mask = torch.cat([torch.zeros(mask.shape[0], 4, dtype=mask.dtype), mask], dim=1).bool()
    info = {"dp_size": 1, "batch_num_tokens": how.batch_num_tokens, "global_batch_size": how.global_batch_size}
    assert float(_agg_loss(wide, wide_mask, how.mode, info)) == pytest.approx(float(verls), rel=1e-6)


def test_anything_but_vanilla_at_arctics_clips_without_rollout_weights_is_carried() -> None:
    batch, _, _ = _mini_batch(seed=1, kl=False)
    assert not single_pass(_actor("actor_rollout_ref.actor.policy_loss.loss_mode=gspo"), batch)
    assert not single_pass(_actor("actor_rollout_ref.actor.clip_ratio_high=0.28"), batch)
    assert not single_pass(_actor(), {**batch, "rollout_is_weights": batch["advantages"]})
