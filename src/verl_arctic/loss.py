"""verl's loss on Arctic's released servers, whatever the policy loss: what travels with a forward-backward call.

Arctic's servers (arctic-platform 0.1.2 and 0.1.4) compute one loss of verl's, ``verl_grpo``
(rl/processors/verl_grpo.py:393-488 in 0.1.2): the vanilla PPO policy loss with its clip ratios fixed at
0.2/0.2 and the dual clip at 3.0 (:data:`ARCTIC_LOSS`), the entropy bonus and the KL loss, each aggregated by
``actor_config.loss_agg_mode`` over the global batch the request names (``batch_num_tokens``,
``global_batch_size``; the server sets ``dp_size`` to its data-parallel ranks and DeepSpeed averages their
gradients, so the sent totals are the whole mini-batch's).

Two ways through it:

- **Single pass** (:func:`single_pass`), where ``verl_grpo`` is verl's loss exactly: the vanilla policy loss at
  Arctic's clip ratios, no rollout-correction weights. The server computes everything.
- **Carried gradient** otherwise. Every term of verl's loss but the entropy bonus is a function of the log-prob
  ``l_t`` of each response token, so its gradient is ``sum_t g_t * dl_t`` (``g`` from
  :func:`verl_remote.actor_loss_gradient`, at the log-probs of one forward pass at the current weights).
  ``verl_grpo`` is then sent ``old_log_probs = l`` (every ratio 1, inside any clip) and advantages
  ``A_t = -g_t / c_t``, where ``c_t`` is the weight the server's aggregation gives token ``t``
  (:func:`carried_advantages`): the gradient of its policy loss is ``g``'s. The KL term is in ``g``; the
  entropy bonus, which is not a function of ``l``, stays the server's own, aggregated as verl aggregates it.

verl's five aggregation modes map onto the two of the servers' that weigh a token alike however rows are
grouped (:func:`aggregation`): ``token-sum`` is ``token-mean`` over one token, ``seq-mean-token-sum-norm`` is
``seq-mean-token-sum`` over ``global_batch_size * loss_scale_factor`` (verl's horizon when it is unset: the
mini-batch's longest response). ``seq-mean-token-mean`` is carried (never the single pass) through
``seq-mean-token-sum``, the 1 / n_i of each response in the carried gradient: the servers pack each
micro-batch's rows into one sequence before the loss (0.1.4 rl/processors/pipeline.py:414, :445 and :176-181;
0.1.2 rl/processors/pipeline.py:377, :403, :135), so their own ``seq-mean-token-mean``
(0.1.4 integrations/verl/grpo_loss.py:183-191) divides by the micro-batch's tokens, not each response's.
For the same reason the entropy bonus, which stays the server's, cannot be aggregated per response:
``seq-mean-token-mean`` with an entropy bonus is refused (:func:`aggregation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ARCTIC_LOSS", "ENTROPY_PER_RESPONSE", "Aggregation", "aggregation", "carried_advantages", "single_pass"]

#: What Arctic's ``verl_grpo`` loss computes whatever verl's config says (arctic-platform 0.1.2
#: rl/processors/verl_grpo.py:195-198, 0.1.4 the same): clip ratios fixed, the vanilla policy loss.
ARCTIC_LOSS = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}


def single_pass(actor: Mapping[str, Any], mini_batch: Mapping[str, Any]) -> bool:
    """Whether Arctic's ``verl_grpo`` is verl's loss for these settings (no forward pass of our own needed)."""
    mode = str((actor.get("policy_loss") or {}).get("loss_mode") or "vanilla")
    clips = {key: actor.get(key) for key in ARCTIC_LOSS}
    same_clips = all(value is None or float(value) == ARCTIC_LOSS[key] for key, value in clips.items())
    per_response = str(actor.get("loss_agg_mode") or "token-mean") == "seq-mean-token-mean"  # packed: see above
    return mode == "vanilla" and same_clips and not per_response and "rollout_is_weights" not in set(mini_batch.keys())


@dataclass(frozen=True)
class Aggregation:
    """What the server is sent for verl's ``loss_agg_mode``: its mode and the global batch it divides by."""

    mode: str
    batch_num_tokens: int
    global_batch_size: float


def aggregation(actor: Mapping[str, Any], meta: Mapping[str, Any], response_mask: Any) -> Aggregation:
    """The server's aggregation equal to verl's for ``actor.loss_agg_mode`` on this mini-batch."""
    mode = str(actor.get("loss_agg_mode") or "token-mean")
    tokens = int(meta["batch_num_tokens"])
    rows = float(meta["global_batch_size"])
    if mode == "token-sum":
        return Aggregation("token-mean", 1, rows)
    if mode == "seq-mean-token-sum-norm":
        factor = actor.get("loss_scale_factor")
        if factor is None:  # verl's horizon: the padded response width of the mini-batch it aggregates
            factor = max(int(row.numel()) for row in response_mask.unbind(0))
        return Aggregation("seq-mean-token-sum", tokens, rows * float(factor))
    if mode == "seq-mean-token-mean":
        if float(actor.get("entropy_coeff") or 0.0) != 0.0:
            raise ValueError(ENTROPY_PER_RESPONSE)
        return Aggregation("seq-mean-token-sum", tokens, rows)  # carried: verl's 1 / n_i is in the gradient
    if mode in ("token-mean", "seq-mean-token-sum"):
        return Aggregation(mode, tokens, rows)
    raise ValueError(f"actor_rollout_ref.actor.loss_agg_mode={mode}: verl has no such aggregation")


#: Why verl's ``seq-mean-token-mean`` cannot carry an entropy bonus through Arctic's servers (module docstring).
ENTROPY_PER_RESPONSE = (
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean with an entropy bonus (actor_rollout_ref.actor."
    "entropy_coeff != 0): Arctic's servers pack each micro-batch into one sequence before their loss, so they "
    "average the entropy over a micro-batch's tokens, not each response's as verl does; set entropy_coeff=0, or "
    "use another loss_agg_mode (token-mean, seq-mean-token-sum)"
)


def carried_advantages(gradient: list[torch.Tensor], masks: list[torch.Tensor], how: Aggregation) -> list[torch.Tensor]:
    """Per row, the advantages whose ratio-1 vanilla loss under ``how`` has the gradient ``gradient``.

    ``gradient`` and ``masks`` are response-aligned rows (``dL/dl`` and the response mask). The server weighs
    every token by ``1 / batch_num_tokens`` (token-mean) or ``1 / global_batch_size`` (seq-mean-token-sum),
    however its micro-batches group the rows; a token outside the mask gets 0.
    """
    if how.mode == "token-mean":
        scale = float(how.batch_num_tokens)
    elif how.mode == "seq-mean-token-sum":
        scale = how.global_batch_size
    else:
        raise ValueError(f"no carried gradient through the servers' {how.mode} (see aggregation)")
    return [
        (-g.to(torch.float64) * scale * mask.to(torch.float64)).to(torch.float32)
        for g, mask in zip(gradient, masks, strict=True)
    ]
