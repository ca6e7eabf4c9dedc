"""The Tinker forwarder: verl's log-prob and actor-update calls as Tinker API requests.

**Log-probs.** A row of ``n`` tokens is one ``Datum``: the first ``n - 1`` tokens in, the last ``n - 1`` as
targets; ``forward`` returns the log-prob of each target, which is verl's predict-next layout less its last
position (0). The reference's come from a sampler of the base model (``compute_logprobs``), the LoRA off.

**The update.** verl's loss (whatever its policy loss, KL term and aggregation) is a function of the current
log-prob ``l_t`` of each response token. Its gradient with respect to the model is ``sum_t g_t * dl_t`` with
``g_t = dL/dl_t`` (:func:`verl_remote.actor_loss_gradient`, from the log-probs at the current weights). The
service is then sent its own ``importance_sampling`` loss, ``-exp(l_t - s_t) * A_t`` per token, with ``s_t = l_t``
(ratio 1) and ``A_t = -g_t * c_i``: its gradient is verl's. ``c_i`` undoes the service's reduction: 1 where the
service sums over tokens (Tinker's documented semantics), ``sum(weights_i) * rows`` where it takes each sequence's
mean and then the mean over the sequences of the step (SkyRL). Where the trainer says the mini-batch's old
log-probs are of the weights as they are (``meta["old_log_probs_current"]``: a step's first mini-batch, its old
log-probs verl's pass at these weights or the sampler's found the same, ``remote_old_log_probs``), the response
tokens' ``l_t`` are those (the prompt's targets carry weight 0); else the service is asked (``forward``, which
answers from the session's cache when ``compute_log_prob`` asked for the same rows at the same weights).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl_remote import RemoteForwarderWorker, actor_loss_gradient
from verl_remote_tinker.backend import TinkerBackend

__all__ = ["TinkerForwarderWorker", "from_old_log_probs", "linearised_datums"]


class TinkerForwarderWorker(RemoteForwarderWorker):
    backend: TinkerBackend

    def backend_log_probs(
        self, data: TensorDict, *, temperature: float, calculate_entropy: bool, reference: bool
    ) -> tuple[Any, Any]:
        if temperature != 1.0:
            raise ValueError(f"a Tinker service scores tokens at temperature 1 only, not {temperature}")
        ids = data["input_ids"]
        rows = _rows(ids)
        values = self.backend.reference(rows) if reference else self.backend.forward(rows)
        flat = torch.from_numpy(np.concatenate([np.append(v, 0.0) for v in values]).astype(np.float32))
        offsets = ids.offsets()
        # Tinker returns no distribution: the entropy metric reads 0 (docs/tinker-backend.md).
        return _jagged(flat, offsets), _jagged(torch.zeros_like(flat), offsets)

    def backend_forward_backward(self, mini_batch: TensorDict, meta: dict[str, Any]) -> dict[str, float]:
        ids = mini_batch["input_ids"]
        rows = _rows(ids)
        if meta.get("old_log_probs_current"):
            current = from_old_log_probs(rows, mini_batch["old_log_probs"])
        else:
            current = self.backend.forward(rows, update=True)
        flat = torch.tensor(np.concatenate([np.append(v, 0.0) for v in current]), dtype=torch.float32)
        gradient, metrics = actor_loss_gradient(_jagged(flat, ids.offsets()), mini_batch, meta, self.config.actor)
        datums = linearised_datums(
            rows, current, gradient.values().numpy(), mini_batch["response_mask"], self.backend.reduction
        )
        self.backend.submit_forward_backward(datums)
        return metrics

    def backend_optimizer_step(self) -> dict[str, float]:
        return self.backend.optim_step()

    def backend_end_of_step(self) -> float | None:
        return self.backend.end_of_step()


def from_old_log_probs(rows: list[list[int]], old_log_probs: Any) -> list[np.ndarray]:
    """Each row's log-probs of its ``n - 1`` targets as ``forward`` returns them, from the step's old log-probs
    (jagged, one per response token, which ends the row): its prompt's targets 0, where datums carry weight 0."""
    out = []
    for row, old in zip(rows, old_log_probs.unbind(), strict=True):
        values = np.zeros(len(row) - 1, dtype=np.float32)
        response = old.to(torch.float32).numpy()
        if len(response):
            values[-len(response) :] = response
        out.append(values)
    return out


def linearised_datums(
    rows: list[list[int]], current: list[np.ndarray], grad: np.ndarray, response_mask: Any, reduction: str
) -> list[dict[str, Any]]:
    """One importance-sampling datum per row whose gradient, under the service's reduction, is ``grad``'s.

    ``grad`` is dL/dl over the rows back to back in verl's layout (``n_i`` values per row, the last one 0);
    ``current`` the service's log-probs (``n_i - 1`` per row); ``response_mask`` the jagged mask (``r_i``).
    """
    masks = [m.to(torch.float32).numpy() for m in response_mask.unbind()]
    out: list[dict[str, Any]] = []
    start = 0
    for row, logprobs, mask in zip(rows, current, masks, strict=True):
        n, r = len(row), len(mask)
        g = grad[start : start + n]
        start += n
        first = n - r - 1  # the target position of the first response token
        weights = np.zeros(n - 1, dtype=np.float32)
        weights[first:] = mask
        scale = 1.0 if reduction == "sum" else float(mask.sum()) * len(rows)
        advantages = np.zeros(n - 1, dtype=np.float32)
        advantages[first:] = -g[first : n - 1] * scale
        out.append(
            {
                "input": [int(t) for t in row[:-1]],
                "target": [int(t) for t in row[1:]],
                "weights": weights.tolist(),
                "logprobs": np.asarray(logprobs, dtype=np.float32).tolist(),
                "advantages": advantages.tolist(),
            }
        )
    return out


def _rows(ids: torch.Tensor) -> list[list[int]]:
    return [[int(t) for t in row.tolist()] for row in ids.unbind()]


def _jagged(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(flat, offsets.to(flat.device))
