"""verl's token layout and actor loss, for a backend's service: what it would otherwise re-derive from verl.

**The layout.** verl hands a forwarder one row per sequence, prompt then response, with no padding
(``input_ids`` is a jagged tensor: row ``i`` has ``n_i = p_i + r_i`` tokens). Log-probs over a row are
predict-next: position ``t`` holds ``log p(input_ids[t + 1] | input_ids[: t + 1])`` and the last position,
which predicts nothing, holds 0. So response token ``j`` (``0 <= j < r_i``) is scored at position
``n_i - r_i - 1 + j``. Every response-aligned field (``response_mask``, ``old_log_probs``, ``advantages``,
``ref_log_prob``, ``rollout_is_weights``) has ``r_i`` values per row. :func:`response_index` and
:func:`response_values` give that alignment; :func:`actor_loss` applies it itself.

**The loss.** :func:`actor_loss` is verl's own (``verl.workers.utils.losses.ppo_loss``, whose terms come
from ``verl.trainer.ppo.core_algos``): the policy loss chosen by ``actor.policy_loss.loss_mode`` with
verl's clip ratios, minus ``entropy_coeff`` times the entropy, plus ``kl_loss_coef`` times the KL to
``ref_log_prob`` when ``use_kl_loss``, each aggregated by ``loss_agg_mode`` over the global mini-batch
(``meta``'s ``dp_size``, ``batch_num_tokens``, ``global_batch_size``). Every setting it reads is in the
run's actor config (``actor_rollout_ref.actor``), which a forwarder has as ``self.config.actor``.

**The loss's gradient, for a service that back-propagates weights.** Every term of verl's loss but the entropy
bonus is a function of the log-prob ``l_t`` of each response token, so its gradient with respect to the model is
``sum_t g_t * dl_t`` with ``g_t = dL/dl_t``. :func:`actor_loss_gradient` gives ``g`` (and verl's metrics) from
the log-probs at the current weights; a service that can back-propagate a weighted sum of log-probs, or a
policy loss with its ratio at 1 (``old_log_probs`` set to the current log-probs, ``advantages`` to ``-g`` over
the service's aggregation weight), then applies verl's update for any policy loss, aggregation and KL term.

**Sampling.** :func:`sample_token` draws one token as verl's sampling parameters mean it (temperature, then
top-k, then top-p; greedy at temperature 0) and returns its log-prob under the temperature-scaled
distribution, which is what verl compares with the trainer's (``rollout_probs_diff``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["actor_loss", "actor_loss_gradient", "response_index", "response_values", "sample_token"]


def _lengths(value: Any) -> torch.Tensor:
    """Row lengths of a jagged tensor, or the lengths themselves."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return value.offsets().diff()
    return torch.as_tensor(value, dtype=torch.long)


def response_index(sequence_lengths: Any, response_lengths: Any) -> torch.Tensor:
    """Positions, in one flat per-token array over whole rows, of the log-prob of every response token.

    Args:
        sequence_lengths: ``n_i`` per row (or the jagged ``input_ids`` itself).
        response_lengths: ``r_i`` per row (or the jagged ``responses`` / ``response_mask``).

    Returns:
        A flat ``LongTensor`` of ``sum(r_i)`` positions, row after row: row ``i``'s token ``j`` is at
        ``offset_i + n_i - r_i - 1 + j``, where ``offset_i`` is the sum of the lengths of the rows before.
    """
    n = _lengths(sequence_lengths)
    r = _lengths(response_lengths)
    if n.shape != r.shape:
        raise ValueError(f"{len(n)} sequences but {len(r)} responses")
    if bool((r >= n).any()):
        raise ValueError("every row needs a prompt of at least one token before its response")
    starts = torch.cumsum(n, 0) - r - 1  # the first response token's position, row by row
    rows = torch.repeat_interleave(torch.arange(len(r)), r)
    first_of_row = torch.cumsum(r, 0) - r
    return starts[rows] + (torch.arange(int(r.sum())) - first_of_row[rows])


def response_values(values: torch.Tensor, response_lengths: Any) -> torch.Tensor:
    """The response-aligned part of per-token values over whole rows, as a jagged tensor of ``r_i`` per row.

    ``values`` is jagged (one row per sequence) or flat with the rows back to back; the result keeps its
    autograd graph, so a loss over it trains the model that produced ``values``.
    """
    r = _lengths(response_lengths)
    if values.is_nested:
        flat, n = values.values(), values.offsets().diff()
    else:
        raise ValueError("flat values need their row lengths: pass a jagged tensor (torch.nested, layout=jagged)")
    picked = flat[response_index(n.to("cpu"), r)]
    offsets = torch.cat([r.new_zeros(1), torch.cumsum(r, 0)]).to(picked.device)
    return torch.nested.nested_tensor_from_jagged(picked, offsets)


def actor_loss(
    log_probs: torch.Tensor,
    mini_batch: Mapping[str, Any],
    meta: Mapping[str, Any],
    actor_config: Any,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's actor loss on one mini-batch, from the model's log-probs over whole rows.

    Args:
        log_probs: jagged, one row per sequence of ``mini_batch["input_ids"]``, predict-next (module
            docstring), at the rollout temperature (``meta["temperature"]``), with the graph to backpropagate.
        mini_batch: what ``backend_forward_backward`` received (a TensorDict, or a mapping of jagged tensors):
            ``prompts``, ``responses``, ``response_mask``, ``old_log_probs``, ``advantages``, and when verl
            sends them ``ref_log_prob`` (``use_kl_loss``) and ``rollout_is_weights``.
        meta: ``backend_forward_backward``'s ``meta``: ``dp_size``, ``batch_num_tokens``, ``global_batch_size``.
        actor_config: ``actor_rollout_ref.actor`` (a DictConfig, a dict, or verl's ``ActorConfig``).
        entropy: jagged like ``log_probs``, when ``meta["calculate_entropy"]``; it enters the loss with
            ``-entropy_coeff``.

    Returns:
        ``(loss, metrics)``: the scalar to call ``backward()`` on, and the metrics to return from
        ``backend_forward_backward`` (``loss``, ``pg_loss``, ``pg_clipfrac``, ``ppo_kl``,
        ``pg_clipfrac_lower``, ``entropy_loss`` with entropy, ``kl_loss``/``kl_coef`` with ``use_kl_loss``;
        floats, without verl's ``actor/`` prefix).
    """
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import Metric
    from verl.workers.utils.losses import ppo_loss

    config = _actor_config(actor_config)
    fields = {key: value for key, value in mini_batch.items() if isinstance(value, torch.Tensor)}
    missing = {"prompts", "responses", "response_mask", "old_log_probs", "advantages"} - set(fields)
    if missing:
        raise ValueError(f"the mini-batch lacks {sorted(missing)}: pass what backend_forward_backward received")
    rows = int(fields["responses"].size(0))
    data = TensorDict(fields, batch_size=[rows])
    tu.assign_non_tensor(
        data,
        dp_size=int(meta.get("dp_size", 1)),
        batch_num_tokens=meta.get("batch_num_tokens"),
        global_batch_size=meta.get("global_batch_size"),
    )
    model_output = {"log_probs": log_probs}
    if entropy is not None:
        model_output["entropy"] = entropy
    loss, raw = ppo_loss(config, model_output, data)
    metrics: dict[str, float] = {"loss": float(loss.detach())}
    for key, value in raw.items():
        value = value.aggregate() if isinstance(value, Metric) else value
        metrics[key.removeprefix("actor/")] = float(value.detach() if torch.is_tensor(value) else value)
    return loss, metrics


def actor_loss_gradient(
    log_probs: torch.Tensor, mini_batch: Mapping[str, Any], meta: Mapping[str, Any], actor_config: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """``dL/dl`` of verl's actor loss (:func:`actor_loss`, without the entropy bonus) at ``log_probs``.

    Args:
        log_probs: jagged, one row per sequence, the current weights' log-probs (no graph needed).
        mini_batch, meta, actor_config: as for :func:`actor_loss`.

    Returns:
        ``(gradient, metrics)``: the gradient jagged like ``log_probs`` (0 outside the responses and wherever a
        token does not count), and the metrics :func:`actor_loss` returns.
    """
    offsets = log_probs.offsets()
    leaf = log_probs.values().detach().to(torch.float32).clone().requires_grad_(True)
    loss, metrics = actor_loss(torch.nested.nested_tensor_from_jagged(leaf, offsets), mini_batch, meta, actor_config)
    (gradient,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    if gradient is None:  # a loss that does not depend on the log-probs (every advantage 0, say)
        gradient = torch.zeros_like(leaf)
    return torch.nested.nested_tensor_from_jagged(gradient.detach(), offsets), metrics


def _actor_config(actor_config: Any) -> Any:
    """verl's ActorConfig dataclass from whatever the caller holds."""
    from omegaconf import DictConfig, OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    if isinstance(actor_config, dict):
        actor_config = OmegaConf.create(actor_config)
    if isinstance(actor_config, DictConfig):
        return omega_conf_to_dataclass(actor_config)
    return actor_config


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> tuple[int, float]:
    """One token from ``logits`` and its log-prob under the temperature-scaled distribution."""
    if temperature <= 0:
        log_probs = F.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(log_probs[token])
    scaled = logits / temperature
    log_probs = F.log_softmax(scaled, dim=-1)
    filtered = scaled.clone()
    if top_k and top_k > 0:
        kth = torch.topk(filtered, min(top_k, filtered.numel())).values[-1]
        filtered[filtered < kth] = float("-inf")
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(filtered, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p
        filtered[order[drop]] = float("-inf")
    token = int(torch.multinomial(torch.softmax(filtered, dim=-1), 1))
    return token, float(log_probs[token])
