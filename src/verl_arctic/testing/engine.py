"""The compute behind the test server: one Hugging Face model per Arctic job, on CPU.

It does what an Arctic job does to the tensors it is sent, in Arctic's dense
layout (prompts left-padded to P, responses right-padded to R): forward
log-probs in the roll(-1) convention with pad positions holding
``pad_token_id``; the ``verl_grpo`` update, using verl's own policy loss, entropy
and KL functions from ``verl.trainer.ppo.core_algos`` on the response-aligned
inputs; optimizer steps; sampling; checkpoints. See docs/arctic-protocol.md §3.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from verl_remote.backends.local.engine import next_token_log_probs, sample_token

__all__ = ["ACTOR_DEFAULTS", "JobModel"]

#: verl's ActorConfig defaults for what the verl_grpo loss reads, where meta.actor_config leaves a key out.
ACTOR_DEFAULTS: dict[str, Any] = {
    "clip_ratio": 0.2,
    "clip_ratio_low": None,
    "clip_ratio_high": None,
    "clip_ratio_c": 3.0,
    "loss_agg_mode": "token-mean",
    "entropy_coeff": 0.0,
    "use_kl_loss": False,
    "kl_loss_coef": 0.001,
    "kl_loss_type": "low_var_kl",
    "loss_scale_factor": None,
}


class JobModel:
    """A model, and for training jobs its optimizer and schedule."""

    def __init__(self, model_name: str, *, optim: dict[str, Any] | None, seed: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_name)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.steps = 0
        self.clip = 0.0
        if optim is not None:
            self._build_optimizer(optim)

    def _build_optimizer(self, optim: dict[str, Any]) -> None:
        from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

        betas = tuple(optim.get("betas", (0.9, 0.999)))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=float(optim.get("lr", 1e-5)),
            betas=(float(betas[0]), float(betas[1])),
            eps=float(optim.get("eps", 1e-8)),
            weight_decay=float(optim.get("weight_decay", 0.0)),
        )
        self.clip = float(optim.get("gradient_clipping") or 0.0)
        horizon = max(int(optim.get("training_horizon", 1)), 1)
        warmup = int(optim.get("warmup_steps", round(float(optim.get("warmup_ratio", 0.0)) * horizon)))
        if optim.get("scheduler") == "cosine":
            self.scheduler = get_cosine_schedule_with_warmup(
                self.optimizer, warmup, horizon, min_lr_ratio=float(optim.get("min_lr_ratio", 0.0))
            )
        else:
            self.scheduler = get_constant_schedule_with_warmup(self.optimizer, warmup)

    # -- forward ------------------------------------------------------------------------------

    def _log_probs(self, batch: dict[str, torch.Tensor], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        ids = batch["input_ids"].long()
        mask = batch["attention_mask"].bool()
        positions = batch.get("position_ids")
        if positions is None:
            positions = ((mask.long().cumsum(-1) - 1).clamp(min=0)) * mask.long()
        logits = self.model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, use_cache=False).logits
        logits = logits.float() / (temperature if temperature and temperature != 1.0 else 1.0)
        log_probs, entropy = next_token_log_probs(logits, ids)
        assert entropy is not None
        return log_probs, entropy

    @torch.no_grad()
    def forward(self, batch: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, torch.Tensor]:
        self.model.eval()
        log_probs, entropy = self._log_probs(batch, float(meta.get("temperature", 1.0)))
        self.model.train()
        pad = float(meta["pad_token_id"])
        valid = batch["attention_mask"].bool()
        out = {"logprobs": log_probs.masked_fill(~valid, pad)}
        if meta.get("calculate_entropy"):
            out["entropy"] = entropy.masked_fill(~valid, pad)
        return out

    def forward_backward(self, batch: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, float]:
        """verl_grpo: verl's policy loss (+ entropy, + KL) on response-aligned tensors, then backward."""
        from omegaconf import OmegaConf
        from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

        if self.optimizer is None:
            raise RuntimeError("forward-backward on a job without an optimizer")
        actor = {**ACTOR_DEFAULTS, **dict(meta.get("actor_config") or {})}
        prompt_len = int(batch["prompts"].shape[1])
        log_probs, entropy = self._log_probs(batch, float(meta.get("temperature", 1.0)))
        # roll(-1) puts log p(token i) at i-1: shift by one so response token j sits at P+j, as the inputs do.
        log_probs = torch.roll(log_probs, shifts=1, dims=-1)
        entropy = torch.roll(entropy, shifts=1, dims=-1)
        mask = batch["response_mask"].bool()
        mask[:, :prompt_len] = False
        batch_num_tokens = meta.get("batch_num_tokens")
        config = OmegaConf.create(
            {
                **{k: v for k, v in actor.items() if isinstance(v, int | float | str | bool) or v is None},
                "policy_loss": dict(meta.get("policy_loss_config") or {}),
                "global_batch_info": {
                    "dp_size": int(meta.get("dp_size", 1)),
                    "batch_num_tokens": int(batch_num_tokens) if batch_num_tokens is not None else None,
                    "global_batch_size": meta.get("global_batch_size"),
                    "loss_scale_factor": actor.get("loss_scale_factor"),
                },
            }
        )
        loss_agg_mode = str(actor.get("loss_agg_mode", "token-mean"))
        loss_fn = get_policy_loss_fn(str(config.policy_loss.get("loss_mode", "vanilla")))
        pg_loss, pg_metrics = loss_fn(
            old_log_prob=batch["old_log_probs"].float(),
            log_prob=log_probs,
            advantages=batch["advantages"].float(),
            response_mask=mask,
            loss_agg_mode=loss_agg_mode,
            config=config,
            rollout_is_weights=meta.get("rollout_is_weights"),
        )
        loss = pg_loss
        metrics = {key: float(value) for key, value in pg_metrics.items()}
        metrics["actor/pg_loss"] = float(pg_loss.detach())
        info = dict(config.global_batch_info)
        if meta.get("calculate_entropy") and float(actor.get("entropy_coeff") or 0.0) != 0.0:
            entropy_loss = agg_loss(entropy, mask, loss_agg_mode, **info)
            loss = loss - float(actor["entropy_coeff"]) * entropy_loss
            metrics["actor/entropy_loss"] = float(entropy_loss.detach())
        if actor.get("use_kl_loss") and "ref_log_prob" in batch:
            kld = kl_penalty(log_probs, batch["ref_log_prob"].float(), str(actor.get("kl_loss_type", "low_var_kl")))
            kl_loss = agg_loss(kld, mask, loss_agg_mode, **info)
            loss = loss + float(actor.get("kl_loss_coef", 0.001)) * kl_loss
            metrics["kl_loss"] = float(kl_loss.detach())
            metrics["kl_coef"] = float(actor.get("kl_loss_coef", 0.001))
        loss.backward()
        metrics["loss"] = float(loss.detach())
        return metrics

    def step(self) -> dict[str, float]:
        if self.optimizer is None or self.scheduler is None:
            raise RuntimeError("step on a job without an optimizer")
        clip = self.clip if self.clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=clip))
        last_lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"last_lr": last_lr, "grad_norm": grad_norm}

    # -- sampling and weights -------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt: str, params: dict[str, Any]) -> dict[str, Any]:

        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        max_tokens = int(params.get("max_tokens") or 16)
        temperature = float(params.get("temperature", 1.0))
        want_logprobs = params.get("logprobs") is not None
        stop = {self.tokenizer.eos_token_id}
        self.model.eval()
        ids, past, tokens, logprobs = torch.tensor([prompt_ids]), None, [], []
        finish = "length"
        for _ in range(max_tokens):
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token, lp = sample_token(
                out.logits[0, -1].float(), temperature, float(params.get("top_p", 1.0)), int(params.get("top_k") or -1)
            )
            tokens.append(token)
            logprobs.append({str(token): {"logprob": lp, "rank": None}})
            if token in stop:
                finish = "stop"
                break
            ids = torch.tensor([[token]])
        self.model.train()
        result: dict[str, Any] = {
            "text": self.tokenizer.decode(tokens),
            "token_ids": tokens,
            "finish_reason": finish,
            "prompt_len": len(prompt_ids),
            "generation_len": len(tokens),
            "prefix_cache_len": 0,
        }
        if want_logprobs:
            result["logprobs"] = logprobs
        return result

    @torch.no_grad()
    def weight_norm(self) -> tuple[float, int]:
        """L2 norm over all parameters, and their count (what /weight-norm compares after a sync)."""
        params = list(self.model.parameters())
        return float(torch.sqrt(sum((p.double() ** 2).sum() for p in params))), sum(p.numel() for p in params)

    def load_weights_from(self, other: JobModel) -> None:
        self.model.load_state_dict(copy.deepcopy(other.model.state_dict()))

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        state = {"model": self.model.state_dict(), "steps": self.steps}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.scheduler.state_dict()
        tmp = os.path.join(directory, "state.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(directory, "state.pt"))

    def load(self, directory: str) -> None:
        state = torch.load(os.path.join(directory, "state.pt"), map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.steps = int(state["steps"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
