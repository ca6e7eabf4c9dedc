"""The service: a bigram language model (the next token's logits depend on the current token only).

Stands in for your own training and sampling service. It keeps the weights, the optimizer and a frozen copy
of the initial weights (the reference), and it answers in numpy arrays, the way a service over the network
would. Its loss is verl's own, through verl_remote.actor_loss, with the settings each request carries.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from verl_remote import Packed, actor_loss, to_nested


class BigramService:
    def __init__(self, vocab_size: int, actor_config: dict[str, Any], seed: int) -> None:
        torch.manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(vocab_size, vocab_size) * 0.02)  # logits[current, next]
        self.initial = self.weight.detach().clone()
        # What the sampler samples from: the weights of the last publish (the weight sync), not the live ones,
        # so that sampling may go on while the trainer updates (an overlapped run).
        self.sampling = self.weight.detach().clone()
        self.actor_config = actor_config
        optim = actor_config["optim"]
        self.optimizer = torch.optim.AdamW([self.weight], lr=optim["lr"], weight_decay=optim["weight_decay"])

    def _scores(self, weight: torch.Tensor, ids: Packed, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies over whole rows: position t scores token t+1; the last is 0."""
        tokens = torch.from_numpy(np.asarray(ids.values, dtype=np.int64))
        log_softmax = F.log_softmax(weight[tokens] / max(temperature, 1e-6), dim=-1)
        following = torch.roll(tokens, -1)
        log_probs = log_softmax.gather(-1, following[:, None])[:, 0]
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        last = torch.zeros(len(tokens), dtype=torch.bool)
        last[torch.from_numpy(ids.offsets[1:] - 1)] = True  # the last token of each row predicts nothing
        return log_probs.masked_fill(last, 0.0), entropy.masked_fill(last, 0.0)

    def log_probs(self, ids: Packed, temperature: float, reference: bool) -> dict[str, np.ndarray]:
        with torch.no_grad():
            log_probs, entropy = self._scores(self.initial if reference else self.weight, ids, temperature)
        return {"log_probs": log_probs.numpy(), "entropy": entropy.numpy()}

    def forward_backward(self, batch: dict[str, Packed], meta: dict[str, Any]) -> dict[str, float]:
        log_probs, _ = self._scores(self.weight, batch["input_ids"], float(meta["temperature"]))
        rows = to_nested(batch["input_ids"])
        jagged = torch.nested.nested_tensor_from_jagged(log_probs, rows.offsets())
        fields = {key: to_nested(value) for key, value in batch.items()}
        loss, metrics = actor_loss(jagged, fields, meta, meta.get("loss") or self.actor_config)
        loss.backward()
        return metrics

    def optimizer_step(self) -> dict[str, float]:
        grad_norm = torch.nn.utils.clip_grad_norm_([self.weight], max_norm=self.actor_config["optim"]["clip_grad"])
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "lr": lr}

    def flops(self, seqlens: list[int]) -> float:
        # Per token: a softmax over the vocabulary forward (about 5 V) and backward (twice that).
        return 15.0 * self.weight.shape[0] * sum(seqlens)

    def publish(self) -> None:
        """The weight sync: the sampler gets the trained weights."""
        self.sampling = self.weight.detach().clone()

    def sample(
        self, prompt_ids: list[int], max_tokens: int, temperature: float, stop_ids: list[int]
    ) -> tuple[list[int], list[float]]:
        """From the full temperature-scaled distribution (greedy at temperature 0, as verl validates); the
        log-probs of the sampled tokens under it."""
        tokens: list[int] = []
        log_probs: list[float] = []
        current = prompt_ids[-1]
        with torch.no_grad():
            while len(tokens) < max_tokens:
                dist = F.log_softmax(self.sampling[current] / max(temperature, 1e-6), dim=-1)
                current = int(dist.argmax()) if temperature <= 0 else int(torch.multinomial(dist.exp(), 1))
                tokens.append(current)
                log_probs.append(float(dist[current]))
                if current in stop_ids:
                    break
        return tokens, log_probs

    def save(self, folder: str) -> None:
        state = {"weight": self.weight.detach(), "initial": self.initial, "optimizer": self.optimizer.state_dict()}
        torch.save(state, os.path.join(folder, "bigram.pt"))

    def load(self, folder: str) -> None:
        state = torch.load(os.path.join(folder, "bigram.pt"), weights_only=True)
        with torch.no_grad():
            self.weight.copy_(state["weight"])
        self.initial = state["initial"]
        self.optimizer.load_state_dict(state["optimizer"])
