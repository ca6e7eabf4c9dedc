"""The Arctic forwarder: verl's jagged batches in Arctic's dense layout, and back.

Arctic's data plane is dense (docs/arctic-protocol.md §3): each row is the prompt
left-padded to P followed by the response right-padded to R, with
``pad_token_id`` in the padding; response-aligned tensors (old log-probs,
advantages, masks) are left-padded with zeros by P to the full length S=P+R.
Forward results come back dense in the roll(-1) convention (position i holds
log p(token i+1)), which is verl's convention too, so converting back is only
cutting each row's padding off (and zeroing the last position, as verl does).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verl_arctic.backend import ArcticBackend
from verl_arctic.loss import ARCTIC_LOSS, Aggregation, aggregation, carried_advantages, single_pass
from verl_remote import RemoteForwarderWorker, actor_loss_gradient, as_dict, response_values

__all__ = ["ArcticRLActorRolloutRefWorker", "from_dense", "to_dense", "verl_grpo_request"]


def _rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(tensor.unbind(0)) if tensor.is_nested else [row for row in tensor]


def to_dense(data: TensorDict, pad: int) -> tuple[dict[str, torch.Tensor], list[int], list[int], int]:
    """Arctic's dense batch from verl's jagged one: (batch, prompt lengths, response lengths, P)."""
    prompts = _rows(data["prompts"])
    responses = _rows(data["responses"])
    p_lens = [len(p) for p in prompts]
    r_lens = [len(r) for r in responses]
    width_p, width_r = max(p_lens), max(r_lens)
    rows = len(prompts)
    dense_prompts = torch.full((rows, width_p), pad, dtype=torch.long)
    dense_responses = torch.full((rows, width_r), pad, dtype=torch.long)
    mask = torch.zeros(rows, width_p + width_r, dtype=torch.long)
    for b, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        dense_prompts[b, width_p - len(prompt) :] = prompt
        dense_responses[b, : len(response)] = response
        mask[b, width_p - len(prompt) : width_p + len(response)] = 1
    batch = {
        "input_ids": torch.cat([dense_prompts, dense_responses], dim=1),
        "attention_mask": mask,
        "prompts": dense_prompts,
        "responses": dense_responses,
    }
    return batch, p_lens, r_lens, width_p


def response_aligned(values: Any, width_p: int, width_r: int, dtype: torch.dtype) -> torch.Tensor:
    """verl's response-length rows (jagged, or a list of rows), right-padded to R and left-padded with zeros by
    P (full length)."""
    rows = values if isinstance(values, list) else _rows(values)
    out = torch.zeros(len(rows), width_p + width_r, dtype=dtype)
    for b, row in enumerate(rows):
        out[b, width_p : width_p + len(row)] = row.to(dtype)
    return out


def from_dense(values: torch.Tensor, p_lens: list[int], r_lens: list[int], width_p: int) -> torch.Tensor:
    """verl's jagged full-sequence rows from Arctic's dense roll(-1) output; the last position of a row is 0."""
    rows = []
    for b, (p, r) in enumerate(zip(p_lens, r_lens, strict=True)):
        row = values[b, width_p - p : width_p + r].float().clone()
        row[-1] = 0.0  # predicts past the end (Arctic leaves garbage there)
        rows.append(row)
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def verl_grpo_request(
    mini_batch: TensorDict,
    pad: int,
    meta: dict[str, Any],
    how: Aggregation,
    actor_config: dict[str, Any],
    old_log_probs: Any,
    advantages: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The body of a ``verl_grpo`` forward-backward call: ``mini_batch`` dense, with these old log-probs and
    advantages (the mini-batch's own when None), aggregated as ``how`` says; ``meta`` is the rest of its meta."""
    batch, _, _, width_p = to_dense(mini_batch, pad)
    width_r = batch["responses"].shape[1]
    mask = response_aligned(mini_batch["response_mask"], width_p, width_r, torch.long)
    batch |= {
        "response_mask": mask,
        "loss_mask": mask,
        "old_log_probs": response_aligned(old_log_probs, width_p, width_r, torch.float32),
        "advantages": response_aligned(
            mini_batch["advantages"] if advantages is None else advantages, width_p, width_r, torch.float32
        ),
    }
    if actor_config.get("use_kl_loss") and "ref_log_prob" in set(mini_batch.keys()):
        batch["ref_log_prob"] = response_aligned(mini_batch["ref_log_prob"], width_p, width_r, torch.float32)
    size = how.global_batch_size
    meta = {
        **meta,
        "max_prompt_len": width_p,
        "max_response_len": width_r,
        "actor_config": actor_config,
        "global_batch_size": int(size) if size.is_integer() else size,
        "batch_num_tokens": torch.tensor(how.batch_num_tokens),
    }
    processing = {"post": ["apply_temperature", "compute_entropy_and_logprobs"], "loss_fn": "verl_grpo"}
    return {"batch": batch, "meta": meta, "processing": processing}


class ArcticRLActorRolloutRefWorker(RemoteForwarderWorker):
    backend: ArcticBackend

    def __init__(self, config: Any, role: str, distillation_config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, role, distillation_config, **kwargs)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(config.model.path))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad)
        self.actor_config = as_dict(config.actor)
        self.rollout_n = int(config.rollout.n)

    def _meta(self, temperature: float, calculate_entropy: bool) -> dict[str, Any]:
        settings = self.backend.settings
        train = settings["train"]
        return {
            "rollout_n": self.rollout_n,
            "temperature": temperature,
            "calculate_entropy": calculate_entropy,
            "pad_token_id": self.pad_token_id,
            "drop_position_ids": bool(settings["comms"].get("drop_position_ids", True)),
            "load_balancer": bool(train["load_balancer"]),
            "zorro_train_enable": bool(train["zorro_train"]["enable"]),
            "zorro_train_max_rollouts": int(train["zorro_train"]["max_rollouts"]),
            "logits_optimization": str(train["logits"]["optimization"]),
            "logits_optimization_peak_mem_size_in_gib": float(train["logits"]["optimization_peak_mem_size_in_gib"]),
            "logits_compute_in_fp32": bool(train["logits"]["compute_in_fp32"]),
            "max_token_len_per_gpu": int(self.actor_config.get("ppo_max_token_len_per_gpu") or 16384),
        }

    def backend_log_probs(
        self, data: TensorDict, *, temperature: float, calculate_entropy: bool, reference: bool
    ) -> tuple[Any, Any]:
        batch, p_lens, r_lens, width_p = to_dense(data, self.pad_token_id)
        meta = self._meta(temperature, calculate_entropy)
        meta |= {"max_prompt_len": width_p, "max_response_len": batch["responses"].shape[1]}
        # verl computes log-probs of logits divided by the rollout temperature, and so does Arctic's update
        # (apply_temperature in its post list): the forward must too, or the first PPO ratio is not 1.
        payload = {
            "batch": batch,
            "meta": meta,
            "processing": {"post": ["apply_temperature", "compute_entropy_and_logprobs"], "loss_fn": None},
        }
        out = self.backend.forward(payload, reference=reference)["batch"]
        log_probs = from_dense(out["logprobs"], p_lens, r_lens, width_p)
        entropy = out.get("entropy")
        entropy = from_dense(entropy, p_lens, r_lens, width_p) if entropy is not None else torch.zeros_like(log_probs)
        return log_probs, entropy

    def backend_forward_backward(self, mini_batch: TensorDict, meta: dict[str, Any]) -> dict[str, float]:
        """verl's loss on one mini-batch through Arctic's ``verl_grpo``: in one pass where it is verl's loss,
        otherwise verl's gradient carried through it after a forward pass (:mod:`verl_arctic.loss`)."""
        how = aggregation(self.actor_config, meta, mini_batch["response_mask"])
        actor_config = {k: v for k, v in self.actor_config.items() if not isinstance(v, dict | list)}
        actor_config["loss_agg_mode"] = how.mode
        if single_pass(self.actor_config, mini_batch):
            metrics = self._verl_grpo(mini_batch, meta, how, actor_config, mini_batch["old_log_probs"])
        else:
            current, _ = self.backend_log_probs(
                mini_batch, temperature=float(meta["temperature"]), calculate_entropy=False, reference=False
            )
            gradient, ours = actor_loss_gradient(current, mini_batch, meta, self.config.actor)
            lengths = mini_batch["response_mask"]
            masks = list(lengths.unbind(0))
            carried = carried_advantages(list(response_values(gradient, lengths).unbind(0)), masks, how)
            # Every ratio 1 (the current log-probs as the old ones), the KL term in the gradient, the entropy
            # bonus the server's, aggregated as verl aggregates it.
            actor_config |= {"use_kl_loss": False, **ARCTIC_LOSS}
            theirs = self._verl_grpo(
                mini_batch, meta, how, actor_config, response_values(current, lengths), advantages=carried
            )
            metrics = {**ours, **{k: v for k, v in theirs.items() if k.startswith("entropy")}}
            if "entropy_loss" in metrics:
                metrics["loss"] -= float(self.actor_config.get("entropy_coeff") or 0.0) * metrics["entropy_loss"]
        if "loss" not in metrics:
            raise ValueError(f"Arctic's forward-backward returned no 'loss' metric (got {sorted(metrics)})")
        return metrics

    def _verl_grpo(
        self,
        mini_batch: TensorDict,
        meta: dict[str, Any],
        how: Aggregation,
        actor_config: dict[str, Any],
        old_log_probs: Any,
        advantages: list[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One ``/forward-backward`` (``/fwd-bwd``) call of Arctic's ``verl_grpo`` loss; its metrics."""
        wire_meta = self._meta(float(meta["temperature"]), bool(meta["calculate_entropy"]))
        wire_meta["policy_loss_config"] = dict(self.actor_config.get("policy_loss") or {})
        payload = verl_grpo_request(
            mini_batch, self.pad_token_id, wire_meta, how, actor_config, old_log_probs, advantages
        )
        result = self.backend.forward_backward(payload)
        return {key.removeprefix("actor/"): float(value) for key, value in result["metrics"].items()}

    def backend_optimizer_step(self) -> dict[str, float]:
        metrics = self.backend.step()["metrics"]

        def mean(value: Any) -> float:  # one value per data-parallel rank when the server has several
            return float(sum(value) / len(value)) if isinstance(value, list) else float(value)

        out = {"lr": mean(metrics["last_lr"])}
        if metrics.get("grad_norm") is not None:
            out["grad_norm"] = mean(metrics["grad_norm"])
        return out
