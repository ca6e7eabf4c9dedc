"""How far an adapter that leaves the output layer alone can move the demo's answer: a bound from the model's
files alone.

A LoRA adapter on attention and MLP (what SkyRL's Tinker server trains: ``train_unembed`` is never set there)
changes the hidden state ``h`` that reaches the final RMSNorm, and nothing after it: the norm's weight ``g``
and the output matrix ``W`` (the input embeddings themselves when they are tied) stay as they are. The
logits of a position are

    z = W (g * u),   u = h / sqrt(mean(h ** 2) + eps),

and whatever ``h`` is, ``|u|^2 = d * mean(h^2) / (mean(h^2) + eps) < d`` (``d`` the hidden size). So every
logit vector the adapter can produce is ``M u`` for some ``u`` in the ball of radius ``sqrt(d)``, with
``M = W diag(g)`` fixed; this holds for any change to the layers before the norm, a LoRA's or not, so it
is an upper bound on what the adapter reaches (the adapter's own rank and the layers' shapes can only
reach less). Three numbers follow:

- the largest logit a token ``v`` can have: ``sqrt(d) * |M_v|`` (``u`` along ``M_v``; approached as ``|h|`` grows);
- the largest probability a token ``v`` can have, at most ``1 / (1 + sum_{w != v} exp(-sqrt(d) |M_w - M_v| / T))``
  since ``z_w - z_v = (M_w - M_v) u >= -sqrt(d) |M_w - M_v|`` (an upper bound, not always reached: the ``u``
  that bring each ``z_w`` down differ);
- the best expected reward: the demo's reward credits each of the first 8 words of a response 1 when it
  is the asked digit, 0.25 when it is another digit, 0 otherwise (:mod:`verl_remote.demo.reward`); one
  token is one word, and a response's reward is the mean of its words' credits, a word that never came (the
  response stopped) counting 0. So no response can expect more than the best expected credit of one
  sampled token, ``max over |u| <= sqrt(d)`` of ``sum_v softmax(M u / T)_v credit_v`` at the sampling
  temperature ``T``, even if every position could have the distribution it wants. That maximum is found
  numerically (L-BFGS over the ball, in float64, from the asked digit's own output row and two random
  directions; from 256 random starts every one ends at the same value, to 1e-9, on the boundary),
  per asked digit, and averaged over the 10 digits (the demo's prompts ask for each about equally).

``python benchmarks/lora_reach.py`` prints both for the demo's models.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_remote.demo.reward import OTHER_DIGIT

__all__ = ["Reach", "lora_reach"]

DIGITS = [str(d) for d in range(10)]


@dataclass(frozen=True)
class Reach:
    """What an adapter that leaves the final norm and the output matrix alone can reach (see the module)."""

    #: Whether the output matrix is the input embedding matrix.
    tied: bool
    #: The largest logit any token can reach, and the largest a digit can.
    max_logit: float
    max_digit_logit: float
    #: An upper bound on the probability of any one token.
    max_probability: float
    #: The best expected reward of one word, per asked digit ("0" to "9"), and their mean.
    best_reward_per_digit: dict[str, float]

    @property
    def best_reward(self) -> float:
        return sum(self.best_reward_per_digit.values()) / len(self.best_reward_per_digit)


def _output_map(model_path: Path) -> tuple[Any, dict[str, int], bool]:
    """``M = W diag(g)`` in float64, the vocabulary, and whether W is tied to the input embeddings."""
    import torch
    from safetensors.torch import load_file

    config = json.loads((model_path / "config.json").read_text())
    tensors = load_file(model_path / "model.safetensors")
    tied = bool(config.get("tie_word_embeddings", False))
    output = tensors["model.embed_tokens.weight"] if tied else tensors["lm_head.weight"]
    norm = tensors["model.norm.weight"]
    vocab = json.loads((model_path / "tokenizer.json").read_text())["model"]["vocab"]
    return output.to(torch.float64) * norm.to(torch.float64), vocab, tied


def _best_expected_credit(matrix: Any, credit: Any, start: Any, temperature: float) -> float:
    """The largest ``softmax(matrix @ u / temperature) @ credit`` over ``|u| <= sqrt(d)``, by L-BFGS from ``start``."""
    import torch

    radius = math.sqrt(matrix.shape[1])
    # u = radius * sin(a) * v / |v| covers the whole ball, its boundary included, smoothly.
    v = start.clone().requires_grad_()
    a = torch.tensor([math.pi / 2], dtype=torch.float64, requires_grad=True)

    def expected() -> Any:
        u = radius * torch.sin(a) * v / v.norm()
        return torch.softmax(matrix @ u / temperature, dim=-1) @ credit

    best = -math.inf
    for _ in range(20):  # restarted, its memory cleared, until a round gains nothing
        optimizer = torch.optim.LBFGS(
            [v, a], max_iter=200, tolerance_grad=1e-13, tolerance_change=1e-16, line_search_fn="strong_wolfe"
        )

        def closure(optimizer: Any = optimizer) -> Any:
            optimizer.zero_grad()
            loss = -expected()
            loss.backward()
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            value = float(expected())
        if value - best < 1e-14:
            break
        best = value
    return max(best, value)


def lora_reach(model_path: Path | str, *, temperature: float = 1.0, starts: int = 3, seed: int = 0) -> Reach:
    """The bound of the module's docstring for the model folder ``model_path`` (a Llama/Qwen-style causal LM
    with a final RMSNorm, ``model.norm.weight``, and a word-level tokenizer naming the digits). Per digit, the
    best of ``starts`` maximisations: from the digit's own output row, then from random directions."""
    import torch

    matrix, vocab, tied = _output_map(Path(model_path))
    size, hidden = matrix.shape
    largest = math.sqrt(hidden) * matrix.norm(dim=1)
    gaps = math.sqrt(hidden) * torch.cdist(matrix, matrix) / temperature  # [v, w]: the most z_v - z_w can be
    probability = 1.0 / torch.exp(-gaps).sum(dim=1)  # the w == v term is the 1
    digits = [vocab[d] for d in DIGITS]
    generator = torch.Generator().manual_seed(seed)
    best: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only wait on each other, more so on a busy machine
    try:
        for digit in digits:
            credit = torch.zeros(size, dtype=torch.float64)  # a word's credit when `digit` was asked for
            credit[digits] = OTHER_DIGIT
            credit[digit] = 1.0
            found = [_best_expected_credit(matrix, credit, matrix[digit], temperature)]
            for _ in range(starts - 1):
                start = torch.randn(hidden, generator=generator, dtype=torch.float64)
                found.append(_best_expected_credit(matrix, credit, start, temperature))
            best.append(max(found))
    finally:
        torch.set_num_threads(threads)
    return Reach(
        tied=tied,
        max_logit=float(largest.max()),
        max_digit_logit=float(largest[digits].max()),
        max_probability=float(probability.max()),
        best_reward_per_digit=dict(zip(DIGITS, best, strict=True)),
    )
