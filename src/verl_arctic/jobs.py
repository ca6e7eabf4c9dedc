"""The bodies of Arctic's ``/initialize`` calls, built from a composed run config.

Pure functions of verl's and ``remote_backend.*``'s settings, no I/O: :func:`job_configs` builds the sampling,
reference ``log_prob`` and training jobs' bodies for a protocol generation (docs/arctic-backend.md maps each
key), and :func:`refusal_hint` says what in a body Arctic's DeepSpeed is known to refuse when the server answers
its bare 500. :func:`create_job` sends one body through a client, its refusals explained. (The loss travels
with each update: :mod:`verl_arctic.loss`.)
"""

from __future__ import annotations

import json
import os
from typing import Any

from verl_arctic.client import ArcticClient, ArcticError
from verl_arctic.loss import ENTROPY_PER_RESPONSE
from verl_remote import as_dict

__all__ = ["create_job", "job_configs", "refusal_hint"]


def _training_steps(config: Any, actor: dict[str, Any]) -> int | None:
    """verl's number of training steps, when it is known before verl counts its data (0 when it is not).

    verl sets ``actor.optim.total_training_steps`` from the data set's length after the backend is built;
    Arctic fixes its learning-rate schedule when the training job is created, so only
    ``trainer.total_training_steps`` can size it then.
    """
    for steps in (actor["optim"].get("total_training_steps"), config.trainer.get("total_training_steps")):
        if steps is not None and int(steps) > 0:
            return int(steps)
    return None


def _optim(actor: dict[str, Any], horizon: int) -> tuple[dict[str, Any], float]:
    optim = actor["optim"]
    clip = float(optim.get("clip_grad") or actor.get("grad_clip") or 0.0)
    total = max(horizon, 1)
    warmup = int(optim.get("lr_warmup_steps") or -1)
    if warmup <= 0:
        warmup = round(float(optim.get("lr_warmup_steps_ratio") or 0.0) * horizon)
    return {
        "lr": float(optim["lr"]),
        "weight_decay": float(optim.get("weight_decay") or 0.0),
        "betas": [float(b) for b in optim.get("betas", (0.9, 0.999))],
        "scheduler": str(optim.get("lr_scheduler_type") or "constant"),
        "warmup_steps": warmup,
        "min_lr_ratio": float(optim.get("min_lr_ratio") or 0.0),
        "total": total,
    }, clip


def _zero(deepspeed: dict[str, Any]) -> dict[str, Any]:
    return dict(deepspeed.get("zero_optimization") or {})


def job_configs(config: Any, generation: str) -> dict[str, dict[str, Any]]:
    """The ``/initialize`` bodies, by job type, for a composed run config (docs/arctic-backend.md maps each key)."""
    settings = as_dict(config.remote_backend)
    actor = as_dict(config.actor_rollout_ref.actor)
    model_config = config.actor_rollout_ref.model
    rollout = config.actor_rollout_ref.rollout
    model = str(model_config.path)
    rollout_n = int(rollout.n)
    train_batch = int(actor["ppo_mini_batch_size"]) * rollout_n
    mini_batches = max(int(config.data.train_batch_size) * rollout_n // train_batch, 1)
    steps = _training_steps(config, actor)
    horizon = (steps or 1) * int(actor.get("ppo_epochs", 1)) * mini_batches
    optim, clip = _optim(actor, horizon)
    if steps is None and (optim["scheduler"] == "cosine" or float(actor["optim"].get("lr_warmup_steps_ratio") or 0)):
        raise ValueError(
            f"actor_rollout_ref.actor.optim.lr_scheduler_type={optim['scheduler']} with a warm-up ratio needs the "
            "number of training steps before the run starts: Arctic fixes its learning-rate schedule when the "
            "training job is created; set trainer.total_training_steps"
        )
    if str(actor.get("loss_agg_mode") or "token-mean") == "seq-mean-token-mean" and float(
        actor.get("entropy_coeff") or 0.0
    ):
        raise ValueError(ENTROPY_PER_RESPONSE)  # before the run, not at its first update (verl_arctic.loss)
    deepspeed = dict(settings["train"]["deepspeed"])
    micro = int(actor.get("ppo_micro_batch_size_per_gpu") or 1)
    gpus = max(int(settings.get("training_gpus", 1)), 1)
    if train_batch % (micro * gpus):
        raise ValueError(
            f"Arctic trains each mini-batch of {train_batch} sequences (ppo_mini_batch_size x rollout.n) on "
            f"{gpus} GPU(s) in micro-batches of {micro} (ppo_micro_batch_size_per_gpu); DeepSpeed needs the first "
            "to be a multiple of the product: change ppo_mini_batch_size or ppo_micro_batch_size_per_gpu"
        )
    ds_config = {
        **deepspeed,
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": train_batch,
        "gradient_accumulation_steps": train_batch // (micro * gpus),
    }
    # Arctic's workers load the model with this attention backend (main requires one); verl's override, or
    # the flash-attention default Arctic's own verl integration sends.
    override = model_config.get("override_config") or {}
    worker = {
        "attn_implementation": str(override.get("attn_implementation") or "flash_attention_2"),
        "enable_gradient_checkpointing": bool(model_config.get("enable_gradient_checkpointing", False)),
    }
    determinism = settings["train"]["determinism"]
    arctic_inference = dict(settings["rollout"])
    common = {"model_name": model, "seed": int(determinism["seed"])}
    training: dict[str, Any] = {
        **common,
        "job_type": "training",
        "full_determinism": bool(determinism["full"]),
        "checkpoint_path": os.path.abspath(str(config.trainer.default_local_dir)),
        "ds_worker_config": worker,
    }
    if generation == "main":
        ds = dict(ds_config)
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {k: optim[k] for k in ("lr", "weight_decay", "betas")} | {"eps": 1e-8},
        }
        if clip > 0:
            ds["gradient_clipping"] = clip
        # DeepSpeed's schedulers take only their own keyword arguments and a positive integer warm-up; a
        # constant rate without warm-up is no scheduler at all. DeepSpeed warms up over at least 2 steps.
        if optim["scheduler"] == "cosine":
            ds["scheduler"] = {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": horizon,
                    "warmup_num_steps": max(1, optim["warmup_steps"]),
                    "warmup_min_ratio": 0.0,
                    "cos_min_ratio": optim["min_lr_ratio"],
                    "warmup_type": "linear",
                },
            }
        elif optim["warmup_steps"] > 0:
            ds["scheduler"] = {
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": optim["lr"],
                    "warmup_num_steps": optim["warmup_steps"],
                    "warmup_type": "linear",
                },
            }
        training |= {
            "ds_config": ds,
            "cuda_ipc": bool(settings["weight_sync"]["cuda_ipc"]),
            "low_memory": bool(settings["weight_sync"]["low_memory"]),
        }
    else:
        training |= {
            "ds_config": ds_config,
            "arctic_inference_config": arctic_inference,
            "training_config": {
                "training_horizon": horizon,
                "optimizer": {k: optim[k] for k in ("lr", "weight_decay", "betas")}
                | ({"gradient_clipping": clip} if clip > 0 else {}),
                "lr_scheduler": {
                    "type": optim["scheduler"],
                    "warmup_ratio": optim["warmup_steps"] / max(horizon, 1),
                    "min_lr_ratio": optim["min_lr_ratio"],
                },
            },
        }
    max_model_len = rollout.get("max_model_len") or int(rollout.prompt_length) + int(rollout.response_length)
    sampling = {
        **common,
        "job_type": "sampling",
        "arctic_inference_config": arctic_inference,
        "vllm_config": {
            "tensor_parallel_size": int(settings.get("sampling_tp_size", 1)),
            "gpu_memory_utilization": float(rollout.get("gpu_memory_utilization") or 0.5),
            "max_model_len": int(max_model_len),
            "max_num_seqs": int(rollout.get("max_num_seqs") or 1024),
            "enforce_eager": bool(rollout.get("enforce_eager", True)),
        },
    }
    # The reference engine is forward-only: DeepSpeed refuses ZeRO stages 1 and 2 without an optimizer,
    # so it shards parameters (stage 3) when training does and runs unsharded (stage 0) otherwise.
    zero = _zero(deepspeed)
    reference_zero = {"stage": 3 if int(zero.get("stage", 0)) == 3 else 0}
    if "offload_param" in zero:
        reference_zero["offload_param"] = zero["offload_param"]
    log_prob = {
        **common,
        "job_type": "log_prob",
        "full_determinism": bool(determinism["full"]),
        "ds_config": {k: v for k, v in ds_config.items() if k != "optimizer"},
        "ds_worker_config": worker,
        "log_prob_config": {"zero_optimization": reference_zero},
    }
    # Arctic's creation order: sampling, the reference, then training (the weight-sync root) last.
    jobs = {"sampling": sampling}
    if actor.get("use_kl_loss") or config.algorithm.get("use_kl_in_reward"):
        if int(settings["log_prob_gpus"]) <= 0:
            raise ValueError(
                "verl needs reference log-probs (a KL term is on) but remote_backend.log_prob_gpus is 0: "
                "give the reference job GPUs, or turn the KL terms off"
            )
        jobs["log_prob"] = log_prob
    jobs["training"] = training
    return jobs


def refusal_hint(job_type: str, body: dict[str, Any], generation: str) -> str:
    """What in ``body`` Arctic's DeepSpeed is known to refuse; Arctic answers every such failure with a bare 500."""
    hints = []
    ds = body.get("ds_config") or {}
    if job_type == "training":
        stage = int(_zero(ds).get("stage", 0))
        data_types = ds.get("data_types") or {}
        if stage == 0 and str(data_types.get("grad_accum_dtype", "fp32")) in ("fp32", "float32"):
            hints.append(
                "ZeRO stage 0 with Arctic's bf16 weights and fp32 gradient accumulation is refused by DeepSpeed: "
                "set remote_backend.train.deepspeed.zero_optimization.stage to 1, 2 or 3"
            )
        schedule = (body.get("training_config") or {}).get("lr_scheduler") or {}
        if generation == "v0.1" and (schedule.get("type") == "cosine" or float(schedule.get("warmup_ratio") or 0) > 0):
            hints.append(
                "arctic-platform 0.1.2 hands DeepSpeed a fractional warm-up step count, which DeepSpeed 0.19.8 "
                "refuses: with protocol v0.1 use a constant learning rate without warm-up "
                "(actor_rollout_ref.actor.optim.lr_scheduler_type=constant, lr_warmup_steps_ratio=0)"
            )
    if job_type == "log_prob" and int(_zero(body.get("log_prob_config") or {}).get("stage", 0)) in (1, 2):
        hints.append("a forward-only DeepSpeed engine cannot use ZeRO stage 1 or 2")
    hints.append(f"the server's own log names the cause (the {job_type} job's body is {json.dumps(body)[:2000]})")
    return "; ".join(hints)


def create_job(client: ArcticClient, job_type: str, body: dict[str, Any]) -> int:
    """``/initialize`` of one job; a 409 (the server's one job of that type is another run's) and a bare 500 (what
    DeepSpeed refused, :func:`refusal_hint`) raised as ``ArcticError`` with what to do."""
    try:
        return client.initialize(body)
    except ArcticError as exc:
        if exc.status == 409:
            raise ArcticError(
                f"{exc}. The server holds another run's {job_type} job (Arctic runs one of each per "
                "server): wait until that run ends, or set remote_backend.comms.url to another server",
                status=409,
            ) from exc
        if exc.status != 500:
            raise
        raise ArcticError(f"{exc}. {refusal_hint(job_type, body, client.generation)}", status=500) from exc
