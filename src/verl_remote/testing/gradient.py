"""The gradient check: the update a backend applies for a loss is the one verl's loss asks for.

Nothing of a backend's service is needed but what the contract has: from one saved state (``save_checkpoint``,
weights and optimizer), two updates are compared, each from that state (``load_checkpoint``):

- **the backend's**: verl's mini-batch for the loss under test, through the forwarder of a run configured with
  it (old log-probs off the current ones, so that clips bite; advantages of both signs; rows of 1 to 7
  response tokens, so that aggregations differ);
- **the probe**: the same gradient, computed here with verl's own loss
  (:func:`verl_remote.actor_loss_gradient`: ``g_t = dL/dl_t`` at the current log-probs ``l``), carried by the
  one loss every backend has: the vanilla policy loss at ratio 1 (``old_log_probs``: the service's own scores of
  the probe's rows, so inside any clip) with one response token per row (so that every aggregation weighs a token
  alike), ``advantages = -g_t`` over that weight, a KL term's reference at ``l`` (where it is flat). Its
  gradient with respect to the model is ``sum_t g_t * dl_t``: verl's. It trains through the run's own forwarder
  when the run's loss is vanilla, so a backend that fixes its loss when it starts is probed as configured, and
  through one built with :data:`PROBE`'s settings otherwise.

On a service that computes in bf16 a row's log-probs depend on the batch it is computed in, and the probe's rows
of one token land off the backend's update by that rounding alone; there (``precision="bf16"``) the probe trains
on the update's own rows instead, summed over tokens (:func:`own_rows_batch`).

Equal gradients make equal updates, whatever the optimizer does with them (Adam included: the saved state is
the same), so the log-probs after the two updates agree; an update of another loss moves them elsewhere. The
check names the loss, how far apart the two updates landed against how far they moved, and, when the backend's
matches a usual mistake (the vanilla loss whatever the mode, no clip, the other aggregation), which.

The entropy bonus is not a function of the log-probs, so no probe carries it: the check leaves it out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from verl_remote.testing.rows import responses_of as _responses_of
from verl_remote.testing.rows import split as _split

__all__ = ["GRADIENT_RTOL", "PROBE", "LossUnderTest", "apart", "every_loss", "loss_label"]

#: How far apart the two updates may land on a service that computes in fp32: the norm of the difference of the
#: log-probs after them, as a share of the norm of the probe's move (``Conformance(precision="fp32")``).
GRADIENT_RTOL = 0.05

#: The probe's loss settings: verl's vanilla policy loss per token, nothing else (the ratio is 1, inside any clip).
PROBE: dict[str, Any] = {
    "policy_loss.loss_mode": "vanilla",
    "loss_agg_mode": "token-mean",
    "use_kl_loss": False,
    "entropy_coeff": 0.0,
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
}

#: What the check sets besides a policy loss's name: what verl itself needs (its own errors say so), and for
#: clip_cov, which clips a random share of its candidate tokens (``clip_cov_ratio``), a share that takes them all:
#: the same tokens on both sides.
NEEDS: dict[str, dict[str, Any]] = {
    "dro": {"policy_loss.dro_beta": 0.1},
    "clip_cov": {"policy_loss.clip_cov_ratio": 1.0},
}

#: verl's loss aggregations (verl.trainer.ppo.core_algos.agg_loss).
AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")

#: Old log-probs off the current ones by these (ratios of 0.61 to 1.65: a clip of 0.2 bites on some), by token.
OFFSETS = (0.5, -0.5, 0.1, -0.1, 0.0, 0.3, -0.3)
#: Each row's advantage, row by row.
ADVANTAGES = (1.0, -1.0, 0.5, -1.5, 2.0, -0.5)
#: Response lengths, row by row: 4 on average, 1 to 7.
LENGTHS = (1, 7, 2, 6, 3, 5, 4, 4)


def verl_meta(tokens: int, rows: int) -> dict[str, Any]:
    """The meta verl hands ``backend_forward_backward`` for a mini-batch of ``rows`` rows and ``tokens`` response
    tokens, one forwarder, at temperature 1, without entropy."""
    return {
        "temperature": 1.0,
        "calculate_entropy": False,
        "dp_size": 1,
        "batch_num_tokens": tokens,
        "global_batch_size": rows,
    }


def every_loss() -> list[dict[str, Any]]:
    """Every policy loss verl has (with what it needs), every aggregation with the vanilla loss, the KL loss."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    losses = [{"policy_loss.loss_mode": mode, **NEEDS.get(mode, {})} for mode in sorted(POLICY_LOSS_REGISTRY)]
    losses += [{"loss_agg_mode": agg} for agg in AGGREGATIONS if agg != "token-mean"]
    losses.append({"use_kl_loss": True, "kl_loss_coef": 0.5, "kl_loss_type": "low_var_kl"})
    return losses


def loss_label(settings: Mapping[str, Any], actor: Any) -> str:
    """The loss under test, in the keys that make it: the settings asked for, or the configured loss's."""
    if not settings:
        settings = {"policy_loss.loss_mode": actor.policy_loss.loss_mode, "loss_agg_mode": actor.loss_agg_mode}
        if actor.use_kl_loss:
            settings["kl_loss_type"] = actor.kl_loss_type
    shown = {key.removeprefix("policy_loss."): value for key, value in settings.items()}
    return ", ".join(f"{key}={value}" for key, value in shown.items())


@dataclass
class LossUnderTest:
    """One loss's comparison; ``run`` is the backend's update, ``probe`` an update by a given gradient."""

    settings: dict[str, Any]
    actor: Any  # actor_rollout_ref.actor (a DictConfig) with ``settings`` applied
    rows: list[list[int]]
    responses: list[list[int]]
    current: np.ndarray  # the log-probs over whole rows at the saved weights

    def mini_batch(self) -> tuple[dict[str, list[list[float]]], dict[str, Any]]:
        """The mini-batch verl would send for these rows (response-aligned fields) and its meta."""
        now = _responses_of(self.current, self.rows, self.responses)
        old = [[v + OFFSETS[(i + k) % len(OFFSETS)] for k, v in enumerate(row)] for i, row in enumerate(now)]
        advantages = [[ADVANTAGES[i % len(ADVANTAGES)]] * len(r) for i, r in enumerate(self.responses)]
        fields = {"old_log_probs": old, "advantages": advantages}
        if bool(self.actor.use_kl_loss):
            fields["ref_log_prob"] = [[v - OFFSETS[(i + k + 3) % len(OFFSETS)] / 2 for k, v in enumerate(row)]
                                      for i, row in enumerate(now)]  # fmt: skip
        return fields, verl_meta(sum(len(r) for r in self.responses), len(self.rows))

    def gradient(self, actor: Any | None = None) -> list[np.ndarray]:
        """``dL/dl`` of verl's loss (this one's, or ``actor``'s) on :meth:`mini_batch`, per response token."""
        fields, meta = self.mini_batch()
        return self._verl_gradient(fields, meta, self.actor if actor is None else actor)

    def weights(self, actor: Any) -> list[np.ndarray]:
        """Each response token's weight in verl's aggregation (``actor.loss_agg_mode``) over these rows: the
        gradient of verl's vanilla loss at ratio 1 with every advantage -1, without a KL term."""
        now = _responses_of(self.current, self.rows, self.responses)
        fields = {"old_log_probs": [list(r) for r in now], "advantages": [[-1.0] * len(r) for r in now]}
        plain = with_settings(actor, {"policy_loss.loss_mode": "vanilla", "use_kl_loss": False, "entropy_coeff": 0.0})
        return self._verl_gradient(fields, self.mini_batch()[1], plain)

    def _verl_gradient(
        self, fields: dict[str, list[list[float]]], meta: dict[str, Any], actor: Any
    ) -> list[np.ndarray]:
        import torch

        from verl_remote.kit.compute import actor_loss_gradient

        prompts = [row[: len(row) - len(r)] for row, r in zip(self.rows, self.responses, strict=True)]
        batch = {
            "input_ids": _nested(self.rows, torch.long),
            "prompts": _nested(prompts, torch.long),
            "responses": _nested(self.responses, torch.long),
            "response_mask": _nested([[1] * len(r) for r in self.responses], torch.long),
            **{key: _nested(value, torch.float32) for key, value in fields.items()},
        }
        lengths = [len(r) for r in self.rows]
        current = _nested([list(v) for v in _split(self.current, lengths)], torch.float32)
        gradient, _ = actor_loss_gradient(current, batch, meta, actor)
        return _responses_of(gradient.values().double().numpy(), self.rows, self.responses)


#: KL estimators whose gradient is 0 where the log-probs equal the reference's (verl's kl_penalty): a probe of a
#: run with such a KL term sets the reference to the current log-probs.
FLAT_KL = {"low_var_kl", "k3", "mse", "k2", "low_var_kl+", "k3+", "mse+", "k2+"}


def probe_settings(actor: Any) -> dict[str, Any]:
    """The settings of the forwarder the probe trains through: the run's own where its loss can carry the probe
    (the vanilla policy loss, any aggregation, a KL term flat at the reference, so that a backend that fixes its
    loss when it starts is probed as configured), :data:`PROBE` otherwise."""
    kl_flat = not bool(actor.use_kl_loss) or str(actor.kl_loss_type) in FLAT_KL
    return {} if str(actor.policy_loss.loss_mode) == "vanilla" and kl_flat else dict(PROBE)


def probe_rows(rows: list[list[int]], responses: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """The probe's rows: one per response token, its prompt the tokens before it (the same for every loss)."""
    out_rows, out_responses = [], []
    for row, response in zip(rows, responses, strict=True):
        start = len(row) - len(response)
        for k, token in enumerate(response):
            out_rows.append(row[: start + k + 1])
            out_responses.append([token])
    return out_rows, out_responses


def probe_batch(
    rows: list[list[int]],
    responses: list[list[int]],
    own: Sequence[float],
    gradient: list[np.ndarray],
    multiple: int,
    actor: Any,
) -> tuple[list[list[int]], list[list[int]], dict[str, list[list[float]]], list[list[int]], dict[str, Any]]:
    """The probe's mini-batch for a forwarder whose actor config is ``actor``: one row per response token
    (:func:`probe_rows`), old log-prob ``own`` (and the reference's, under a KL term), advantage ``-g_t`` over the
    weight ``actor.loss_agg_mode`` gives each token of rows of one token; rows of no token (mask 0) pad it to a
    multiple of ``multiple`` rows, as many as a service may need to split it.

    ``own``: each probe row's token's log-prob as the service scores the probe's own rows, so that the ratio is 1
    (on a service in fp32 the same as the current log-probs over whole rows; in bf16 a row's log-probs depend on
    the batch they are scored in).

    Returns ``(rows, responses, fields, masks, meta)``."""
    tokens = sum(len(r) for r in responses)
    size = -(-tokens // multiple) * multiple
    mode = str(actor.loss_agg_mode)
    # Each token's weight in verl's agg_loss over rows of one token (dp_size 1): the horizon of
    # seq-mean-token-sum-norm is 1, the padded width of such rows.
    weight = {
        "token-mean": 1.0 / tokens,
        "token-sum": 1.0,
        "seq-mean-token-sum": 1.0 / size,
        "seq-mean-token-mean": 1.0 / size,
        "seq-mean-token-sum-norm": 1.0 / (size * float(actor.get("loss_scale_factor") or 1)),
    }[mode]
    out_rows, out_responses = probe_rows(rows, responses)
    old = [[float(v)] for v in own]
    advantages = [[-float(v) / weight] for g in gradient for v in g]
    masks = [[1] for _ in out_rows]
    while len(out_rows) < size:
        out_rows.append(out_rows[0])
        out_responses.append(out_responses[0])
        old.append(old[0])
        advantages.append([0.0])
        masks.append([0])
    fields = {"old_log_probs": old, "advantages": advantages}
    if bool(actor.use_kl_loss):
        fields["ref_log_prob"] = old
    return out_rows, out_responses, fields, masks, verl_meta(tokens, size)


def apart(landed: np.ndarray, expected: np.ndarray, start: np.ndarray) -> tuple[float, float]:
    """How far apart two updates from ``start`` landed (the norm of the difference of the log-probs after them)
    and how far the second moved them (the norm of its move).

    The norm, not the largest difference: in bf16 a log-prob near -8 moves in steps of 1/16, and the one token
    that rounds the other way sets the largest difference, while the norm weighs every token (measured on
    Arctic's own 0.1.4 server: docs/measurements.md, "Every loss on every backend")."""
    return float(np.linalg.norm(landed - expected)), float(np.linalg.norm(expected - start))


def own_rows_batch(
    under_test: LossUnderTest, gradient: list[np.ndarray], actor: Any
) -> tuple[list[list[int]], list[list[int]], dict[str, list[list[float]]], list[list[int]], dict[str, Any]]:
    """The probe on the rows under test themselves, for a forwarder whose actor config is ``actor``: old log-probs
    the current ones (the service's scores of these very rows: ratio 1), advantage ``-g_t`` over the weight verl's
    aggregation gives token ``t`` in these rows (:meth:`LossUnderTest.weights`).

    The rows, and so the service's rounding, are those of the backend's own update: on a service in bf16, where a
    row's log-probs depend on the batch they are computed in, this probe lands where the backend's update does
    (within 2.2 % of the move on Arctic's own 0.1.4 server, where :func:`probe_batch`'s rows of one token land
    23-58 % off by rounding alone). It goes through the backend's aggregation of these rows, so the check runs it
    summed over tokens (``loss_agg_mode=token-sum``, each weight 1): a backend that weighs the loss under test's
    tokens otherwise than verl then lands elsewhere, unless it weighs token-sum's tokens wrongly in just the same
    way, which only :func:`probe_batch` tells. Returns ``(rows, responses, fields, masks, meta)``."""
    now = _responses_of(under_test.current, under_test.rows, under_test.responses)
    weights = under_test.weights(actor)
    old = [[float(v) for v in row] for row in now]
    advantages = [
        [-float(g) / float(w) for g, w in zip(gs, ws, strict=True)] for gs, ws in zip(gradient, weights, strict=True)
    ]
    fields = {"old_log_probs": old, "advantages": advantages}
    if bool(actor.use_kl_loss):
        fields["ref_log_prob"] = old
    masks = [[1] * len(r) for r in under_test.responses]
    _, meta = under_test.mini_batch()
    return [list(r) for r in under_test.rows], [list(r) for r in under_test.responses], fields, masks, meta


def explain(
    under_test: LossUnderTest,
    landed: np.ndarray,
    start: np.ndarray,
    rtol: float,
    probe: Callable[[list[np.ndarray]], np.ndarray],
) -> str:
    """Which usual mistake the backend's update matches (the log-probs after it, ``landed``; before it,
    ``start``), if one does within ``rtol`` (:func:`apart`): each candidate is verl's gradient of another loss,
    sent through ``probe``."""
    actor = under_test.actor
    mode = str(actor.policy_loss.loss_mode)
    candidates: list[tuple[str, dict[str, Any]]] = []
    if mode != "vanilla":
        candidates.append(
            ("it trains verl's vanilla loss whatever loss_mode says", {"policy_loss.loss_mode": "vanilla"})
        )
    big = 1e9
    unclipped = {"clip_ratio": big, "clip_ratio_low": big, "clip_ratio_high": big, "clip_ratio_c": big * 10}
    candidates.append(("it does not clip the ratio", unclipped))
    other = "seq-mean-token-mean" if str(actor.loss_agg_mode) == "token-mean" else "token-mean"
    candidates.append((f"it aggregates as loss_agg_mode={other} does", {"loss_agg_mode": other}))
    for said, settings in candidates:
        after = probe(under_test.gradient(with_settings(actor, settings)))
        distance, moved = apart(landed, after, start)
        if distance <= rtol * moved:
            return f"; {said}"
    return ""


def with_settings(actor: Any, settings: Mapping[str, Any]) -> Any:
    """A copy of ``actor`` (a DictConfig) with ``settings`` (dotted keys) applied."""
    from omegaconf import OmegaConf, open_dict

    changed = OmegaConf.create(OmegaConf.to_container(actor, resolve=True))
    with open_dict(changed):
        for key, value in settings.items():
            OmegaConf.update(changed, key, value, force_add=True)
    return changed


def _nested(rows: Sequence[Sequence[float]], dtype: Any) -> Any:
    import torch

    return torch.nested.as_nested_tensor([torch.tensor(list(r), dtype=dtype) for r in rows], layout=torch.jagged)
