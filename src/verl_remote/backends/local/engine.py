"""The local backend's engine: a Hugging Face causal LM that really trains and samples.

It runs inside one Ray actor (see :mod:`verl_remote.backends.local.backend`) and
owns the model, its optimizer and learning-rate schedule, and a frozen copy of
the initial weights for reference log-probs. The policy update is verl's own,
through :func:`verl_remote.actor_loss`, on log-probs computed here.

Batches arrive packed (see :mod:`verl_remote.kit.payload`): one flat array of token
ids per field plus the sequence offsets, which is verl's jagged layout. Log-probs
follow verl's convention: position ``t`` holds ``log p(token[t+1] | tokens[:t+1])``
over the whole prompt+response sequence; the last position of each sequence is 0.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from verl_remote import Packed, sample_token, to_nested
from verl_remote.backends.local.requests import GenerateResult, SampleRequest

if TYPE_CHECKING:
    from verl_remote.backends.local.vllm_sampler import VllmSampler

log = logging.getLogger(__name__)

__all__ = ["GenerateResult", "LocalEngine", "SampleRequest", "next_token_log_probs", "sample_token"]

CHECKPOINT_FILE = "local_engine.pt"


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LocalEngine:
    """Owns the model; every method is a complete, synchronous unit of work."""

    def __init__(self, model_path: str, actor_config: dict[str, Any], settings: dict[str, Any]) -> None:
        from omegaconf import OmegaConf
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass

        torch.manual_seed(int(settings.get("seed", 0)))
        threads = settings.get("torch_threads")
        if threads:
            torch.set_num_threads(int(threads))
        self.device = _resolve_device(str(settings.get("device", "auto")))
        dtype = getattr(torch, str(settings.get("dtype", "float32")))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        self.model.train()
        self._reference: torch.nn.Module | None = None
        self.actor_config = omega_conf_to_dataclass(OmegaConf.create(actor_config))
        self._loss_configs: dict[str, Any] = {}  # the loss settings updates carried, converted once each
        self.optimizer, self.scheduler = self._build_optimizer()
        self.weights_version = 0
        self.optimizer_steps = 0
        # remote_backend.sampler, as LocalBackend.from_config resolved it: "hf" samples with self.model itself,
        # or, when the run samples while it trains (overlap), with a copy holding the last published weights.
        self.sampling_model: torch.nn.Module = self.model
        if settings.get("overlap") and settings.get("sampler", "hf") != "vllm":
            self.sampling_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.vllm: VllmSampler | None = None
        if settings.get("sampler", "hf") == "vllm":
            from verl_remote.backends.local.vllm_sampler import VllmSampler

            self.vllm = VllmSampler(
                model_path,
                dtype=str(settings.get("dtype", "float32")),
                seed=int(settings.get("seed", 0)),
                max_model_len=int(settings["max_model_len"]),
                kv_cache_bytes=int(settings["vllm_kv_cache_bytes"]),
                device=str(self.device),
            )

    # -- optimisation setup -------------------------------------------------------------

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
        from verl.workers.config.optimizer import build_optimizer

        optim = self.actor_config.optim
        optimizer = build_optimizer(self.model.parameters(), optim)
        total = max(int(optim.total_training_steps), 1)
        warmup = int(optim.lr_warmup_steps)
        if warmup <= 0:
            warmup = int(optim.lr_warmup_steps_ratio * total)
        if optim.lr_scheduler_type == "cosine":
            scheduler = get_cosine_schedule_with_warmup(
                optimizer,
                num_warmup_steps=warmup,
                num_training_steps=total,
                min_lr_ratio=optim.min_lr_ratio,
                num_cycles=optim.num_cycles,
                zero_indexed_step=optim.zero_indexed_step,
            )
        else:
            scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
        return optimizer, scheduler

    @property
    def reference(self) -> torch.nn.Module:
        """The initial weights, frozen: reference log-probs for KL terms."""
        if self._reference is None:
            raise RuntimeError("no reference model: it is captured before the first optimizer step")
        return self._reference

    def _capture_reference(self) -> None:
        if self._reference is None:
            self._reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    # -- forward passes -----------------------------------------------------------------

    def _dense(self, input_ids: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-pad packed sequences: ids [B, L], attention mask [B, L], lengths [B]."""
        values = torch.from_numpy(input_ids.values)
        offsets = torch.from_numpy(input_ids.offsets)
        lengths = offsets.diff()
        batch, width = len(lengths), int(lengths.max())
        ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.arange(width).expand(batch, width) < lengths[:, None]
        ids[mask] = values.long()
        return ids.to(self.device), mask.to(self.device), lengths

    def _token_log_probs(
        self, model: torch.nn.Module, input_ids: Packed, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flat predict-next log-probs (and entropy) in the packed layout of ``input_ids``."""
        ids, mask, lengths = self._dense(input_ids)
        logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits.float()
        dense_lp, dense_ent = next_token_log_probs(logits / max(temperature, 1e-6), ids, with_entropy)
        # The last real position of each sequence predicts nothing: 0, as in verl.
        last = torch.arange(ids.shape[1], device=ids.device)[None, :] >= (lengths.to(ids.device) - 1)[:, None]
        dense_lp = dense_lp.masked_fill(last, 0.0)
        entropy = dense_ent.masked_fill(last, 0.0)[mask] if dense_ent is not None else None
        return dense_lp[mask], entropy

    @torch.no_grad()
    def compute_log_prob(
        self, input_ids: Packed, temperature: float, calculate_entropy: bool, reference: bool
    ) -> dict[str, np.ndarray]:
        """Log-probs (and entropy) of every sequence, flat in the packed layout."""
        if reference:
            self._capture_reference()
        model = self.reference if reference else self.model
        was_training = model.training
        model.eval()
        try:
            lp, ent = self._token_log_probs(model, input_ids, temperature, calculate_entropy)
        finally:
            model.train(was_training)
        out = {"log_probs": lp.cpu().numpy()}
        out["entropy"] = (ent if ent is not None else torch.zeros_like(lp)).cpu().numpy()
        return out

    def forward_backward(self, batch: dict[str, Packed], meta: dict[str, Any]) -> dict[str, float]:
        """verl's PPO loss on one mini-batch, backward; gradients accumulate until :meth:`optimizer_step`.

        ``batch`` holds packed ``input_ids``, ``prompts``, ``responses`` and the
        response-aligned ``response_mask``, ``old_log_probs``, ``advantages`` and,
        when present, ``ref_log_prob`` and ``rollout_is_weights``. ``meta`` holds
        ``temperature``, ``calculate_entropy`` and verl's global batch info
        (``dp_size``, ``batch_num_tokens``, ``global_batch_size``), and ``loss``: the forwarder's actor config
        (``actor_rollout_ref.actor``, plain data), whose loss settings this update applies, as a service is sent
        the loss with each request.
        """
        from verl_remote import actor_loss

        self._capture_reference()  # before the first update, so the reference is the initial model
        log_probs, entropy = self._token_log_probs(
            self.model, batch["input_ids"], float(meta["temperature"]), bool(meta["calculate_entropy"])
        )
        layout = batch["input_ids"]
        loss, metrics = actor_loss(
            _jagged(log_probs, layout),
            {key: to_nested(value) for key, value in batch.items()},
            meta,
            self._loss_config(meta.get("loss")),
            entropy=None if entropy is None else _jagged(entropy, layout),
        )
        loss.backward()
        return metrics

    def _loss_config(self, sent: dict[str, Any] | None) -> Any:
        """verl's ActorConfig for the loss a request asks for (the engine's own when it names none), converted
        once per distinct config."""
        from omegaconf import OmegaConf
        from verl.utils.config import omega_conf_to_dataclass

        if sent is None:
            return self.actor_config
        key = json.dumps(sent, sort_keys=True, default=str)
        if key not in self._loss_configs:
            self._loss_configs[key] = omega_conf_to_dataclass(OmegaConf.create(sent))
        return self._loss_configs[key]

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, zero the gradients. Returns grad_norm and the learning rate used."""
        clip = float(self.actor_config.optim.clip_grad or 0.0) or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=clip)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            log.warning("grad_norm is not finite (%s); skipping this optimizer step", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return {"grad_norm": float(grad_norm), "lr": lr}

    def lr_scheduler_step(self) -> float:
        """Advance the schedule by one global step (verl steps it once per training step)."""
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    # -- sampling -------------------------------------------------------------------------

    def generate_batch(self, requests: list[SampleRequest]) -> list[GenerateResult]:
        """Sample a response for each request, all at once, each with its own sampling parameters, stop ids and
        length (greedy when its temperature is 0): with vLLM, or with the model itself (:meth:`_generate_hf`)."""
        if self.vllm is not None:
            return [
                GenerateResult(tokens, log_probs, "completed", self.weights_version)
                for tokens, log_probs in self.vllm.generate(requests)
            ]
        results: list[GenerateResult] = self._generate_hf(requests)
        return results

    @torch.no_grad()
    def _generate_hf(self, requests: list[SampleRequest]) -> list[GenerateResult]:
        """The prompts left-padded into one batch, one forward per token for the whole batch with a KV cache. A
        row that is done still rides along until the longest is."""
        model = self.sampling_model
        model.eval()
        try:
            batch = len(requests)
            width = max(len(r.prompt_ids) for r in requests)
            ids = torch.zeros(batch, width, dtype=torch.long)
            mask = torch.zeros(batch, width, dtype=torch.long)
            for row, request in enumerate(requests):
                ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids, dtype=torch.long)
                mask[row, width - len(request.prompt_ids) :] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
            tokens: list[list[int]] = [[] for _ in requests]
            token_log_probs: list[list[float]] = [[] for _ in requests]
            done = [r.params.max_tokens <= 0 for r in requests]
            past = None
            while not all(done):
                out = model(
                    input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True
                )
                past = out.past_key_values
                logits = out.logits[:, -1].float()
                next_ids = torch.zeros(batch, 1, dtype=torch.long)
                for row, request in enumerate(requests):
                    if done[row]:
                        continue
                    token, lp = sample_token(
                        logits[row], request.params.temperature, request.params.top_p, request.params.top_k
                    )
                    tokens[row].append(token)
                    token_log_probs[row].append(lp)
                    next_ids[row, 0] = token
                    done[row] = token in request.params.stop_token_ids or len(tokens[row]) >= request.params.max_tokens
                ids = next_ids.to(self.device)
                mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long, device=self.device)], dim=1)
                positions = positions[:, -1:] + 1
        finally:
            self.model.train()  # the snapshot, when sampling has its own, stays in eval mode
        return [
            GenerateResult(row, lps if request.params.logprobs else None, "completed", self.weights_version)
            for row, lps, request in zip(tokens, token_log_probs, requests, strict=True)
        ]

    def update_weights(self) -> int:
        """Publish the trained weights to the sampler: a version bump when it is the model itself, and the weights
        pushed into the running engine when it is vLLM, or copied into the sampling snapshot."""
        self._publish()
        self.weights_version += 1
        return self.weights_version

    def _publish(self) -> None:
        if self.vllm is not None:
            self.vllm.push(self.model)
        elif self.sampling_model is not self.model:
            self.sampling_model.load_state_dict(self.model.state_dict())

    def close(self) -> None:
        """Stop what the engine started outside its own process (vLLM's engine processes)."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    # -- state ------------------------------------------------------------------------------

    def save(self, path: str) -> str:
        """Write model, optimizer, schedule and counters to ``path`` atomically."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            state = {
                "model": self.model.state_dict(),
                "reference": None if self._reference is None else self._reference.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "weights_version": self.weights_version,
                "optimizer_steps": self.optimizer_steps,
                "torch_rng": torch.get_rng_state(),
            }
            torch.save(state, staging / CHECKPOINT_FILE)
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return str(target)

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote."""
        file = Path(path) / CHECKPOINT_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no local-engine checkpoint at {file}")
        state = torch.load(file, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        if state["reference"] is not None:
            self._capture_reference()
            self.reference.load_state_dict(state["reference"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.weights_version = int(state["weights_version"])
        self.optimizer_steps = int(state["optimizer_steps"])
        torch.set_rng_state(state["torch_rng"])
        self._publish()
        print(f"verl-remote: local engine loaded {path} (weights sha256 {self.weights_checksum()})", flush=True)

    def device_name(self) -> str:
        """The device's name as verl's FLOPs table knows it ("CPU", or the CUDA device name)."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"

    def weights_checksum(self) -> str:
        """SHA-256 over the model's parameters, in name order (tests compare runs with it)."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()


def export_checkpoint(model_path: str, tokenizer_path: str, dtype: str, state_dir: str, out: str) -> None:
    """The model a :meth:`LocalEngine.save` folder holds, as a Hugging Face model folder in ``out``: the engine's
    model class and dtype from ``model_path``, the saved weights, the tokenizer. The optimizer's state, saved
    beside the weights, is mapped from disk and never read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the command says what it exports, and when it is done
    file = Path(state_dir) / CHECKPOINT_FILE
    if not file.is_file():
        raise ValueError(f"no local-engine checkpoint at {file}")
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model.load_state_dict(state["model"])
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)


def _jagged(values: torch.Tensor, layout: Packed) -> torch.Tensor:
    """``values`` (keeping their autograd graph) in the rows of ``layout``."""
    lengths = layout.lengths
    offsets = torch.from_numpy(layout.offsets).to(values.device)
    return torch.nested.nested_tensor_from_jagged(
        values, offsets, min_seqlen=int(lengths.min()), max_seqlen=int(lengths.max())
    )


def next_token_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense [B, L] ``log p(ids[:, t+1])`` at each position ``t`` (roll(-1)), and the entropy there.

    ``logits`` are already divided by the temperature. Positions past a row's end
    hold whatever the roll brings; callers mask them in their own layout.
    """
    log_softmax = F.log_softmax(logits.float(), dim=-1)
    next_ids = torch.roll(ids, shifts=-1, dims=-1)
    log_probs = log_softmax.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) if with_entropy else None
    return log_probs, entropy
