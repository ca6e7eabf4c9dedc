"""The compute behind the test server: what Arctic's DeepSpeed workers and vLLM pool do, on CPU.

Our model of Arctic's engines, each behaviour traced to Arctic's code
(arctic-platform 0.1.2 for generation v0.1, 0.1.4 for main; DeepSpeed 0.19.8,
the newest release Arctic's ``deepspeed>=0.19.2`` admits):

- :func:`deepspeed_setup`: the DeepSpeed config a training job's
  ``/initialize`` body turns into (``deepspeed_worker.ds_training_config``: the
  high-level ``training_config`` folded into ``ds_config``, then the server's
  defaults: bf16, fp32 gradient accumulation, micro batch 1), and what
  DeepSpeed itself refuses when the engine is built: a batch size that is not
  micro batch x accumulation steps x ranks, bf16 with fp32 gradient
  accumulation without ZeRO, a warmup scheduler whose step count is not a
  positive integer. A refusal is a :class:`DeepSpeedRefusal`, a bare 500.
- :class:`JobModel`: one Hugging Face model per job. A training job stands for
  ``world`` data-parallel ranks sharing one set of weights: each rank's shard is
  cut into ``gradient_accumulation_steps`` micro-batches, each runs forward,
  Arctic's ``verl_grpo`` loss and backward (unscaled: ``scale_wrt_gas=False``),
  and an optimizer step happens at the accumulation boundary, on gradients
  averaged over the ranks, as DeepSpeed's ``engine.step`` does. Learning rates
  follow DeepSpeed's ``WarmupLR`` / ``WarmupCosineLR`` formulas.
- Forward outputs are dense ``[B, S]`` in the roll(-1) convention over the
  packed valid tokens of a micro-batch (so a row's last valid position scores
  the next row's first token, as Arctic's packed forward does), with
  ``pad_token_id`` at padded positions. Temperature divides the logits only
  when the request's ``post`` list has ``apply_temperature``.

What it is not: DeepSpeed, vLLM, bf16 numerics (the model trains in float32, as
a GPU server with the flash-attention loss returns float32 log-probs), ZoRRO,
the load balancer's reordering (invisible to a client: Arctic restores the
order of forward outputs, and a loss summed over ranks does not depend on it;
which rows share a micro-batch does matter to a per-response aggregation of
the packed rows, seq-mean-token-mean, which verl-arctic therefore never sends).
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from verl_arctic.testing.batching import combine_microbatch_metrics, merge_shards, split_rows
from verl_remote import sample_token

__all__ = [
    "VLLM_SAMPLING_PARAMS",
    "DeepSpeedRefusal",
    "JobModel",
    "TrainingSetup",
    "check_sampling_params",
    "deepspeed_setup",
    "reference_setup",
]


class DeepSpeedRefusal(ValueError):
    """A job config DeepSpeed would refuse when Arctic builds the engine (a bare 500 on /initialize)."""


@dataclass
class TrainingSetup:
    world: int
    micro_batch: int
    accumulation: int
    train_batch: int
    optimizer: dict[str, Any]
    clip: float
    scheduler: dict[str, Any] | None


def _merged_ds_config(job: dict[str, Any], generation: str) -> dict[str, Any]:
    """``ds_training_config`` (0.1.2 deepspeed_worker.py:228-299, 0.1.4 common/deepspeed_worker.py)."""
    ds = copy.deepcopy(job.get("ds_config") or {})
    training = job.get("training_config")
    if training is not None:
        opt = training.get("optimizer", {})
        betas = opt.get("betas")
        if betas is None:
            betas = [opt.get("beta1", 0.9), opt.get("beta2", 0.999)]
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": opt.get("lr", 1e-5),
                "betas": list(betas),
                "eps": opt.get("eps", 1e-8),
                "weight_decay": opt.get("weight_decay", 0.0),
            },
        }
        if "gradient_accumulation_steps" in training:
            ds["gradient_accumulation_steps"] = training["gradient_accumulation_steps"]
        if "gradient_clipping" in opt:
            ds["gradient_clipping"] = opt["gradient_clipping"]
        elif generation == "main" and "gradient_clipping" in training:
            ds["gradient_clipping"] = training["gradient_clipping"]
        elif generation == "main" and "max_grad_norm" in opt:
            ds["gradient_clipping"] = opt["max_grad_norm"]
        schedule = training.get("lr_scheduler")
        horizon = training.get("training_horizon", 0)
        if schedule is not None and horizon > 0:
            lr = opt.get("lr", 1e-5)
            if generation == "main" and "warmup_steps" in schedule:
                warmup: float | int = round(float(schedule["warmup_steps"]))
            else:
                warmup = schedule.get("warmup_ratio", 0.0) * horizon
                if generation == "main":  # main rounds; v0.1 passes the float on (DeepSpeed then refuses it)
                    warmup = round(warmup)
            if schedule.get("type", "constant") == "cosine":
                ds["scheduler"] = {
                    "type": "WarmupCosineLR",
                    "params": {
                        "total_num_steps": horizon,
                        "warmup_num_steps": warmup,
                        "warmup_min_ratio": 0.0,
                        "cos_min_ratio": schedule.get("min_lr_ratio") or 0.0,
                        "warmup_type": "linear",
                    },
                }
            elif warmup > 0:
                ds["scheduler"] = {
                    "type": "WarmupLR",
                    "params": {
                        "warmup_min_lr": 0.0,
                        "warmup_max_lr": lr,
                        "warmup_num_steps": warmup,
                        "warmup_type": "linear",
                    },
                }
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    if not (ds.get("fp16") or {}).get("enabled"):
        ds.setdefault("bf16", {"enabled": True})
    ds.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8}})
    ds.setdefault("data_types", {"grad_accum_dtype": "fp32"})
    return ds


def _batch_sizes(ds: dict[str, Any], world: int) -> tuple[int, int, int]:
    """DeepSpeed's ``_configure_train_batch_size`` and ``_batch_assertion`` (runtime/config.py)."""
    train = ds.get("train_batch_size")
    micro = ds.get("train_micro_batch_size_per_gpu")
    accumulation = ds.get("gradient_accumulation_steps")
    if train is not None and micro is not None and accumulation is None:
        accumulation = train // micro // world
    elif train is not None and accumulation is not None and micro is None:
        micro = train // world // accumulation
    elif micro is not None and accumulation is not None and train is None:
        train = micro * accumulation * world
    elif train is not None and micro is None and accumulation is None:
        accumulation, micro = 1, train // world
    elif micro is not None and train is None and accumulation is None:
        accumulation, train = 1, micro * world
    assert train is not None and micro is not None and accumulation is not None
    if not (train > 0 and micro > 0 and accumulation > 0) or train != micro * accumulation * world:
        raise DeepSpeedRefusal(
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {train} != {micro} * {accumulation} * {world}"
        )
    return int(train), int(micro), int(accumulation)


#: The keyword arguments of DeepSpeed's schedulers (runtime/lr_schedules.py); the test server models these two.
#: The names vLLM's ``SamplingParams`` takes (vllm 0.31.0 ``sampling_params.py:211-380``, its public fields), which
#: Arctic builds from ``/generate``'s ``sampling_params`` as they come (arctic-inference 0.3.0
#: ``server/worker.py:200``, 0.2.0 ``:188``: ``SamplingParams(**sampling_params)``): another name is msgspec's
#: ``TypeError``, which
#: no handler of Arctic's ``/generate`` catches (arctic-platform 0.1.4 ``common/http_server.py:697-705``): a bare 500.
VLLM_SAMPLING_PARAMS = frozenset(
    {
        "allowed_token_ids", "bad_words", "detokenize", "extra_args", "flat_logprobs", "frequency_penalty",
        "ignore_eos", "include_stop_str_in_output", "logit_bias", "logprob_token_ids", "logprobs", "max_tokens",
        "min_p", "min_tokens", "n", "output_kind", "output_text_buffer_length", "presence_penalty",
        "prompt_logprob_start", "prompt_logprob_token_ids", "prompt_logprobs", "repetition_detection",
        "repetition_penalty", "routed_experts_prompt_start", "seed", "skip_clone", "skip_reading_prefix_cache",
        "skip_special_tokens", "spaces_between_special_tokens", "stop", "stop_token_ids", "stream_interval",
        "structured_outputs", "temperature", "thinking_token_budget", "top_k", "top_p", "trace_decode_token_ids",
        "watermarking",
    }
)  # fmt: skip


def check_sampling_params(params: dict[str, Any]) -> None:
    """What vLLM's ``SamplingParams(**params)`` refuses by name, refused alike (msgspec's words)."""
    for name in params:
        if name not in VLLM_SAMPLING_PARAMS:
            raise TypeError(f"Unexpected keyword argument {name!r}")


SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupCosineLR": {
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "last_batch_iteration",
    },
}


def _model_spec(job: dict[str, Any], generation: str) -> None:
    """main builds every DeepSpeed job's model from ``ds_worker_config`` (0.1.4 model/config.py:81-95)."""
    worker = job.get("ds_worker_config") or {}
    if generation == "main" and worker.get("attn_implementation") is None:
        raise DeepSpeedRefusal(
            "from_ds_worker_config requires attn_implementation (ZoRRo Train needs a flash-attention backend)."
        )


def reference_setup(job: dict[str, Any], generation: str) -> None:
    """A DeepSpeed log-prob job's engine: forward-only, so ZeRO stages 1 and 2 (which shard optimizer state)
    are refused (``ds_inference_config``, then DeepSpeed's engine.py ``zero stage N requires an optimizer``)."""
    _model_spec(job, generation)
    zero = (job.get("log_prob_config") or {}).get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if stage in (1, 2):
        raise DeepSpeedRefusal(f"zero stage {stage} requires an optimizer")


def deepspeed_setup(job: dict[str, Any], generation: str, world: int) -> TrainingSetup:
    """The training engine Arctic would build from ``job``, or the refusal DeepSpeed would raise."""
    _model_spec(job, generation)
    ds = _merged_ds_config(job, generation)
    train, micro, accumulation = _batch_sizes(ds, world)
    zero_stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    bf16 = bool((ds.get("bf16") or {}).get("enabled"))
    accumulate_fp32 = str((ds.get("data_types") or {}).get("grad_accum_dtype", "fp32")) in ("fp32", "float32")
    if zero_stage == 0 and bf16 and accumulate_fp32:  # engine.py _do_optimizer_sanity_check
        raise DeepSpeedRefusal(
            "unsupported mix of model_dtype=torch.bfloat16 and grad_accum_dtype=torch.float32 (ZeRO stage 0)"
        )
    scheduler = ds.get("scheduler")
    if scheduler is not None:
        kind, params = scheduler.get("type"), dict(scheduler.get("params") or {})
        if kind not in SCHEDULER_PARAMS:
            raise DeepSpeedRefusal(
                f"the test server models DeepSpeed's {' and '.join(SCHEDULER_PARAMS)} only, not {kind}"
            )
        unexpected = sorted(set(params) - SCHEDULER_PARAMS[kind])
        if unexpected:
            raise DeepSpeedRefusal(f"{kind}.__init__() got an unexpected keyword argument '{unexpected[0]}'")
        if kind == "WarmupCosineLR" and "total_num_steps" not in params:
            raise DeepSpeedRefusal(
                "WarmupCosineLR.__init__() missing 1 required positional argument: 'total_num_steps'"
            )
        steps = params.get("warmup_num_steps", 1000)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:  # lr_schedules.py __init__s
            raise DeepSpeedRefusal(f"warmup_num_steps must be a positive integer, got {steps}")
    return TrainingSetup(
        world=world,
        micro_batch=micro,
        accumulation=accumulation,
        train_batch=train,
        optimizer=dict((ds.get("optimizer") or {}).get("params") or {}),
        clip=float(ds.get("gradient_clipping") or 0.0),
        scheduler=scheduler,
    )


class _DeepSpeedSchedule:
    """DeepSpeed's WarmupLR and WarmupCosineLR (runtime/lr_schedules.py), or a constant rate."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: dict[str, Any] | None) -> None:
        self.optimizer = optimizer
        self.kind = (scheduler or {}).get("type")
        self.params = dict((scheduler or {}).get("params") or {})
        self.base = float(optimizer.param_groups[0]["lr"])
        self.iteration = -1
        if self.kind is not None:
            self._apply()

    def _gamma(self, warmup: int, linear: bool) -> float:
        if linear:
            return self.iteration / warmup
        return math.log(self.iteration + 1) / math.log(warmup)

    def rate(self) -> float:
        warmup = max(2, int(self.params.get("warmup_num_steps", 1000)))
        linear = self.params.get("warmup_type", "log") == "linear"
        if self.kind == "WarmupLR":
            low = float(self.params.get("warmup_min_lr", 0.0))
            high = float(self.params.get("warmup_max_lr", self.base))
            if self.iteration < 0:
                return low
            gamma = self._gamma(warmup, linear) if self.iteration < warmup else 1.0
            return low + (high - low) * gamma
        if self.kind == "WarmupCosineLR":
            if self.iteration < 0:
                return 0.0
            if self.iteration < warmup:
                low = float(self.params.get("warmup_min_ratio", 0.0))
                return self.base * (low + self._gamma(warmup, linear) * (1.0 - low))
            total = int(self.params["total_num_steps"])
            progress = min(1.0, (self.iteration - warmup + 1) / max(1, total - warmup))
            floor = float(self.params.get("cos_min_ratio", 0.0001))
            return self.base * max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)
        return self.base

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.rate()

    def step(self) -> None:
        self.iteration += 1
        if self.kind is not None:
            self._apply()

    def restore(self, iteration: int) -> None:
        self.iteration = iteration
        if self.kind is not None:
            self._apply()


def _dense_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Arctic's roll(-1) over the packed valid tokens of a micro-batch, back in the dense layout."""
    valid = mask.bool()
    packed_logits = logits[valid]  # [T, V], rows one after the other
    labels = torch.roll(ids[valid], shifts=-1, dims=0)
    log_z = torch.logsumexp(packed_logits, dim=-1)
    packed = packed_logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_z
    dense = torch.zeros(ids.shape, dtype=packed.dtype)
    dense[valid] = packed
    if not entropy:
        return dense, None
    probs = torch.softmax(packed_logits, dim=-1)
    packed_entropy = log_z - (probs * packed_logits).sum(-1)
    dense_entropy = torch.zeros(ids.shape, dtype=packed.dtype)
    dense_entropy[valid] = packed_entropy
    return dense, dense_entropy


def _packed(values: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """A micro-batch's rows as Arctic's pipeline hands them to the loss: packed into one sequence of the tokens
    the attention mask keeps, ``[1, nnz]`` (``pack_with_unpad``: 0.1.4 rl/processors/pipeline.py:414 and :445,
    ``padded_tensor_2d_dict_to_unpadded_tensor_1d_dict`` :176-181; 0.1.2 rl/processors/pipeline.py:377, :403,
    :135). So the loss sees one "sequence" per micro-batch: a per-sequence aggregation counts the micro-batch's
    tokens, not each response's."""
    return values[attention].unsqueeze(0)


def _agg_loss(values: torch.Tensor, mask: torch.Tensor, mode: str, info: dict[str, Any]) -> torch.Tensor:
    """``agg_loss`` of Arctic's verl_grpo (0.1.2 rl/processors/verl_grpo.py:98-160, 0.1.4
    integrations/verl/grpo_loss.py:134-195): verl's, with the global batch info, on :func:`_packed` rows."""
    dp = int(info.get("dp_size") or 1)
    masked = torch.where(mask, values, torch.zeros_like(values))
    if mode == "token-mean":
        tokens = info.get("batch_num_tokens")
        if tokens is None:
            if dp > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            tokens = mask.sum()
        return masked.sum() / tokens * dp
    per_sequence = (values * mask).sum(-1)
    rows = (mask.sum(-1) > 0).float()
    size = info.get("global_batch_size")
    if size is None:
        if dp > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        size = rows.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = (per_sequence * rows).sum() / size * dp
        return loss / mask.shape[-1] if mode == "seq-mean-token-sum-norm" else loss
    if mode == "seq-mean-token-mean":
        counts = mask.sum(-1)
        return ((per_sequence / (counts + 1e-8)) * rows).sum() / size * dp
    raise ValueError(f"Invalid loss_agg_mode: {mode}")


def _kl(log_probs: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """verl_grpo's ``kl_penalty`` (verl_grpo.py:300-378), straight-through for the ``+`` variants."""
    if kind.endswith("+"):
        forward = _kl(log_probs, ref, kind[:-1])
        backward = 0.5 * (log_probs - ref).square()
        return backward - backward.detach() + forward.detach()
    if kind in ("kl", "k1"):
        return log_probs - ref
    if kind == "abs":
        return (log_probs - ref).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (log_probs - ref).square()
    if kind in ("low_var_kl", "k3"):
        kl = torch.clamp(ref - log_probs, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise NotImplementedError(kind)


def _total(values: torch.Tensor) -> float:
    return float(values.detach().sum())


def verl_grpo(
    log_probs: torch.Tensor, entropy: torch.Tensor | None, batch: dict[str, torch.Tensor], meta: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Arctic's ``verl_grpo`` loss (rl/processors/verl_grpo.py:380-488) on one micro-batch.

    Arctic's policy loss is PPO's clipped objective with its clip ratios fixed at
    0.2/0.2 and the dual-clip bound at 3.0, whatever ``actor_config`` says, and
    ``policy_loss_config.loss_mode`` is read but not used. Metrics are the paired
    ``X.sum``/``X.tokens`` partial sums the server folds into token means.
    """
    actor = dict(meta.get("actor_config") or {})
    mode = str(actor.get("loss_agg_mode", "token-mean"))
    info = {key: meta.get(key) for key in ("dp_size", "batch_num_tokens", "global_batch_size")}
    if isinstance(info["batch_num_tokens"], torch.Tensor):
        info["batch_num_tokens"] = info["batch_num_tokens"].item()
    mask = batch["response_mask"].bool()
    # roll(-1) holds log p(token i+1) at i: shift by one inside each response window (mask_and_pad_for_log_probs).
    shifted = torch.zeros_like(log_probs)
    shifted[:, 1:] = log_probs[:, :-1]
    shifted = torch.where(mask, shifted, torch.zeros_like(shifted))
    old = batch["old_log_probs"].float()
    advantages = batch["advantages"].float()
    negative_kl = torch.clamp(shifted - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 0.8, 1.2)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * 3.0
    per_token = torch.where(advantages < 0, torch.min(loss3, clipped), clipped)
    weights = meta.get("rollout_is_weights")
    if weights is not None:
        per_token = per_token * weights
    attention = batch["attention_mask"].bool()
    packed_mask = _packed(mask, attention)
    loss = _agg_loss(_packed(per_token, attention), packed_mask, mode, info)
    maskf = mask.float()
    tokens = float(maskf.sum())
    metrics: dict[str, Any] = {
        "actor/pg_clipfrac.sum": _total(torch.gt(loss2, loss1).float() * maskf),
        "actor/pg_clipfrac.tokens": tokens,
        "actor/ppo_kl.sum": _total(-negative_kl * maskf),
        "actor/ppo_kl.tokens": tokens,
        "actor/pg_clipfrac_lower.sum": _total(torch.gt(clipped, loss3).float() * (advantages < 0).float() * maskf),
        "actor/pg_clipfrac_lower.tokens": tokens,
        "actor/pg_loss.sum": _total(per_token * maskf),
        "actor/pg_loss.tokens": tokens,
    }
    loss_sum = metrics["actor/pg_loss.sum"]
    if entropy is not None:
        coefficient = float(actor.get("entropy_coeff", 0.0))
        loss = loss - coefficient * _agg_loss(_packed(entropy, attention), packed_mask, mode, info)
        entropy_sum = _total(entropy * maskf)
        metrics["actor/entropy_loss.sum"] = entropy_sum
        metrics["actor/entropy_loss.tokens"] = tokens
        loss_sum -= coefficient * entropy_sum
    if actor.get("use_kl_loss", False):
        kld = _kl(shifted, batch["ref_log_prob"].float(), str(actor.get("kl_loss_type", "low_var_kl")))
        coefficient = float(actor.get("kl_loss_coef", 0.001))
        loss = loss + coefficient * _agg_loss(_packed(kld, attention), packed_mask, mode, info)
        kl_sum = _total(kld * maskf)
        metrics["kl_loss.sum"] = kl_sum
        metrics["kl_loss.tokens"] = tokens
        metrics["kl_coef"] = coefficient
        loss_sum += coefficient * kl_sum
    metrics["loss.sum"] = loss_sum
    metrics["loss.tokens"] = tokens
    return loss, metrics


class JobModel:
    """One job's model; for a training job also its optimizer, schedule and DeepSpeed step counting."""

    def __init__(self, model_name: str, *, seed: int, setup: TrainingSetup | None = None, world: int = 1) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_name)
        self.setup = setup
        self.world = setup.world if setup is not None else world
        self.accumulation = setup.accumulation if setup is not None else 1
        self.optimizer: torch.optim.Optimizer | None = None
        self.schedule: _DeepSpeedSchedule | None = None
        self.micro_steps = 0
        self.global_steps = 0
        self.grad_norm: float | None = None
        if setup is not None:
            params = setup.optimizer
            betas = params.get("betas", (0.9, 0.999))
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=float(params.get("lr", 1e-3)),
                betas=(float(betas[0]), float(betas[1])),
                eps=float(params.get("eps", 1e-8)),
                weight_decay=float(params.get("weight_decay", 0.0)),
            )
            self.schedule = _DeepSpeedSchedule(self.optimizer, setup.scheduler)

    # -- the data plane, one data-parallel rank at a time ---------------------------------------

    def _forward(
        self, batch: dict[str, torch.Tensor], meta: dict[str, Any], post: list[str], grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = batch["input_ids"].long()
        mask = batch["attention_mask"].long()
        positions = batch.get("position_ids")
        if positions is None:
            if not meta.get("drop_position_ids", False):
                raise KeyError("position_ids")  # Arctic rebuilds them only when the client dropped them
            positions = (mask.cumsum(-1) - 1).clamp(min=0) * mask
        with torch.set_grad_enabled(grad):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            logits = logits.float()
            if "apply_temperature" in post:
                temperature = float(meta["temperature"])
                if temperature != 1.0:
                    logits = logits / max(temperature, 1e-8)
            if "compute_entropy_and_logprobs" not in post:
                raise KeyError("logprobs")  # the loss and the answer need what this post-processor makes
            logits_mode = meta.get("logits_optimization", "none")
            if logits_mode == "memory":
                raise ValueError("arctic_rl.train.logits.optimization=memory requires zorro enabled")
            if logits_mode not in ("none", "compute"):
                raise ValueError(f"Unknown arctic_rl.train.logits.optimization={logits_mode!r}")
            return _dense_log_probs(logits, ids, mask, bool(meta.get("calculate_entropy")))

    def _micro_batches(self, shard: dict[str, Any], generation: str) -> list[dict[str, Any]]:
        return split_rows(shard, self.accumulation, generation)

    @torch.no_grad()
    def forward(
        self, shard: dict[str, Any], meta: dict[str, Any], processing: dict[str, Any], generation: str
    ) -> dict[str, Any]:
        """``forward_no_grad`` of one rank: ``{"batch": {logprobs, entropy?}, "metrics": {}}``."""
        post = list(processing.get("post") or [])
        outputs = []
        self.model.eval()
        try:
            for micro in self._micro_batches(shard, generation):
                log_probs, entropy = self._forward(micro, meta, post, grad=False)
                pad = float(meta["pad_token_id"])
                valid = micro["attention_mask"].bool()
                out = {"logprobs": log_probs.masked_fill(~valid, pad)}
                if entropy is not None:
                    out["entropy"] = entropy.masked_fill(~valid, pad)
                outputs.append(out)
        finally:
            self.model.train()
        # The worker merges its micro-batches, then copies the result into plain dicts (deepspeed_worker.py:443-462).
        return {"batch": dict(merge_shards(outputs)), "metrics": {}}

    def forward_backward(
        self, shard: dict[str, Any], meta: dict[str, Any], processing: dict[str, Any], generation: str
    ) -> dict[str, Any]:
        """``forward_backward`` of one rank: ``{"avg_loss": mean over micro-batches, "metrics": {...}}``.

        Arctic's worker also calls ``engine.step()`` after each micro-batch but the
        last (deepspeed_worker.py:439-441); with one model standing for all ranks,
        the server makes those calls once all ranks are done (:meth:`step`).
        """
        if self.optimizer is None:
            raise RuntimeError("forward-backward on a job without an optimizer")
        loss_fn = processing.get("loss_fn", "grpo")
        if loss_fn != "verl_grpo":
            raise ValueError(f"the test server implements Arctic's verl_grpo loss only, not {loss_fn!r}")
        post = list(processing.get("post") or [])
        meta = dict(meta)
        actor = meta.get("actor_config")
        entropy_unused = isinstance(actor, dict) and float(actor.get("entropy_coeff", 1.0)) == 0.0
        if meta.get("calculate_entropy") and entropy_unused:  # pipeline.py:337-346
            meta["calculate_entropy"] = False
        losses, metrics = [], []
        for micro in self._micro_batches(shard, generation):
            log_probs, entropy = self._forward(micro, meta, post, grad=True)
            loss, micro_metrics = verl_grpo(log_probs, entropy, micro, meta)
            loss.backward()  # gradients of every rank and micro-batch add up in this one model
            losses.append(float(loss.detach()))
            metrics.append(micro_metrics)
        return {
            "avg_loss": sum(losses) / len(losses),
            "metrics": combine_microbatch_metrics(metrics, generation),
            "micro_batches": len(losses),
        }

    def step(self) -> dict[str, Any]:
        """DeepSpeed's ``engine.step``: an optimizer step at each gradient-accumulation boundary only."""
        if self.optimizer is None or self.schedule is None:
            raise RuntimeError("step on a job without an optimizer")
        if (self.micro_steps + 1) % self.accumulation == 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            for param in params:
                param.grad.div_(self.world)  # data-parallel ranks' gradients are averaged
            clip = self.setup.clip if self.setup is not None and self.setup.clip > 0 else float("inf")
            self.grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm=clip)) if params else 0.0
            self.optimizer.step()
            self.schedule.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_steps += 1
        self.micro_steps += 1
        metrics: dict[str, Any] = {"last_lr": float(self.optimizer.param_groups[0]["lr"])}
        if self.grad_norm is not None:
            metrics["grad_norm"] = self.grad_norm
        return {"metrics": metrics, "batch": {}}

    # -- sampling, weights and checkpoints --------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
        """One completion in arctic-inference's result shape (0.2.0 server/worker.py:182-227)."""
        check_sampling_params(params)
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        max_tokens = int(params.get("max_tokens") or 16)
        temperature = float(params.get("temperature", 1.0))
        want = params.get("logprobs")
        # Arctic hands the dict to vLLM's SamplingParams (arctic-inference 0.3.0 server/worker.py:200): ignore_eos
        # drops the EOS only; stop_token_ids stop the response too, the stop token kept in its ids (vllm 0.31.0
        # sampling_params.py:269-272).
        stop = set() if params.get("ignore_eos") else {self.tokenizer.eos_token_id}
        stop.update(int(t) for t in params.get("stop_token_ids") or ())
        self.model.eval()
        ids, past, tokens, logprobs = torch.tensor([prompt_ids]), None, [], []
        finish = "length"
        for _ in range(max_tokens):
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            token, _ = sample_token(
                logits, temperature, float(params.get("top_p", 1.0)), int(params.get("top_k") or -1)
            )
            tokens.append(token)
            if want is not None:
                full = torch.log_softmax(logits, dim=-1)  # vLLM reports the unprocessed distribution's log-prob
                entry = {str(token): {"logprob": float(full[token]), "rank": int((full > full[token]).sum()) + 1}}
                for alt in torch.topk(full, int(want)).indices.tolist() if int(want) > 0 else []:
                    entry.setdefault(str(alt), {"logprob": float(full[alt]), "rank": int((full > full[alt]).sum()) + 1})
                logprobs.append(entry)
            if token in stop:
                finish = "stop"
                break
            ids = torch.tensor([[token]])
        self.model.train()
        result: dict[str, Any] = {
            "text": self.tokenizer.decode(tokens, skip_special_tokens=True),
            "token_ids": tokens,
            "finish_reason": finish,
            "prompt_len": len(prompt_ids),
            "generation_len": len(tokens),
            "prefix_cache_len": 0,
        }
        if want is not None:
            result["logprobs"] = logprobs
        return result

    @torch.no_grad()
    def log_probs_of_encoded(self, encoded: dict[str, torch.Tensor]) -> torch.Tensor:
        """``compute_log_probs`` of a DeepSpeed log-prob rank: ``[B, S-1]`` next-token log-probs."""
        logits = self.model(**encoded).logits.float()
        log_probs = torch.log_softmax(logits, dim=-1)[:, :-1]
        return log_probs.gather(-1, encoded["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def weight_norm(self) -> tuple[float, int]:
        """L2 norm over all parameters, and how many parameter tensors there are (DeepSpeedWorker.weight_norm)."""
        params = list(self.model.parameters())
        return float(torch.sqrt(sum((p.double() ** 2).sum() for p in params))), len(params)

    def load_weights_from(self, other: JobModel) -> None:
        self.model.load_state_dict(copy.deepcopy(other.model.state_dict()))

    def save(self, directory: str) -> None:
        """DeepSpeed's ``save_checkpoint(directory)``: the state under ``global_step<N>/``, then a ``latest`` file
        naming that tag (runtime/engine.py ``save_checkpoint``), written atomically here."""
        tag = f"global_step{self.global_steps}"
        os.makedirs(os.path.join(directory, tag), exist_ok=True)
        state: dict[str, Any] = {"model": self.model.state_dict(), "global_steps": self.global_steps}
        if self.optimizer is not None and self.schedule is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["schedule_iteration"] = self.schedule.iteration
            state["micro_steps"] = self.micro_steps
        tmp = os.path.join(directory, tag, "state.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(directory, tag, "state.pt"))
        with open(os.path.join(directory, "latest.tmp"), "w") as fp:
            fp.write(tag)
        os.replace(os.path.join(directory, "latest.tmp"), os.path.join(directory, "latest"))

    def load(self, directory: str) -> bool:
        """DeepSpeed's ``load_checkpoint(directory)``: nothing loaded (False) without a ``latest`` file; the tag it
        names must hold a checkpoint, else DeepSpeed fails (as when Arctic's own step-number ``latest`` is read)."""
        latest = os.path.join(directory, "latest")
        if not os.path.isfile(latest):
            return False
        with open(latest) as fp:
            tag = fp.read().strip()
        state = torch.load(os.path.join(directory, tag, "state.pt"), map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.global_steps = int(state["global_steps"])
        if self.optimizer is not None and self.schedule is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.schedule.restore(int(state["schedule_iteration"]))
            self.micro_steps = int(state["micro_steps"])
        return True
