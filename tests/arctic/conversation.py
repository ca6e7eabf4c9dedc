"""One scripted conversation with an Arctic server, run against Arctic's own server and against ours.

Every route of a generation is called, in the order a client would, with the
requests that succeed and the mistakes a client can make (a missing body, a
wrong job type, an unknown job, a body that fails the request model, too few
rows for the ranks, ...). :func:`converse` returns, per step, what a client can
observe: the status, the kind of body, and the body's shape: containers by
type name (so ``defaultdict`` is not ``dict``), tensors by kind and shape,
strings and integers by value, floats by type. Values that depend on sampling
or on numerics (sampled tokens and text, losses) are compared by shape only.

The servers must be launched with 2 training ranks, 1 sampling and 1 log-prob
GPU, the DeepSpeed log-prob engine and no colocation.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from verl_arctic import wire

TRAINING_RANKS = 2
#: Values that depend on sampling or numerics: compared by shape, not value.
VARYING = {"text", "token_ids", "logprobs", "prompt_logprobs", "finish_reason", "prefix_cache_len"}


@dataclass(frozen=True)
class Observation:
    step: str
    status: int
    kind: str
    shape: Any


def shape(value: Any, *, varying: bool = False, root: str = "") -> Any:
    """What a client can rely on in a decoded body (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        kind = "float" if value.is_floating_point() else "bool" if value.dtype == torch.bool else "int"
        return ("tensor", kind, tuple(value.shape))
    if isinstance(value, dict):
        if varying:  # per-token dicts keyed by sampled token ids
            return (type(value).__name__, len(value), sorted({repr(shape(v, varying=True)) for v in value.values()}))
        return (
            type(value).__name__,
            {str(k): shape(v, varying=varying or k in VARYING, root=root) for k, v in sorted(value.items(), key=str)},
        )
    if isinstance(value, list | tuple):
        return (type(value).__name__, [shape(v, varying=varying, root=root) for v in value])
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float):
        return "float"
    if isinstance(value, int):
        return "int" if varying else value
    if isinstance(value, str):
        if varying:
            return "str"
        return value.replace(root, "<root>") if root else value
    return type(value).__name__


def _torch_load_any(data: bytes) -> Any:
    # Test-only: both peers are processes of this test run; the containers are what is compared.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def observe(step: str, response: httpx.Response, generation: str, root: str) -> Observation:
    kind = response.headers.get("content-type", "").split(";")[0]
    if kind == "application/octet-stream":
        body = _torch_load_any(response.content) if generation == "v0.1" else wire.decode_dssst1(response.content)
        return Observation(step, response.status_code, "binary", shape(body, root=root))
    if kind == "application/json":
        body = response.json()
        if response.status_code == 422:  # pydantic's own messages may differ between versions: type and place
            body = [(e["type"], tuple(e["loc"])) for e in body["detail"]]
            return Observation(step, 422, "json", body)
        return Observation(step, response.status_code, "json", shape(body, root=root))
    return Observation(step, response.status_code, kind, response.text)


def dense_batch(rows: int, pad: int) -> dict[str, torch.Tensor]:
    """``rows`` rows in Arctic's layout: prompts left-padded to P=5, responses right-padded to R=3."""
    prompts = torch.tensor([[3, 13, 15, 2, 8], [pad, 3, 13, 2, 8]] * (rows // 2 + 1))[:rows]
    responses = torch.tensor([[15, 15, 2], [7, pad, pad]] * (rows // 2 + 1))[:rows]
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = (input_ids != pad).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "prompts": prompts, "responses": responses}


def update_payload(rows: int, pad: int, *, load_balancer: bool = False) -> dict[str, Any]:
    batch = dense_batch(rows, pad)
    mask = torch.zeros_like(batch["input_ids"])
    mask[:, 5:] = (batch["responses"] != pad).long()
    advantages = torch.zeros(rows, 8)
    advantages[:, 5:] = torch.linspace(-1, 1, rows).unsqueeze(1)
    meta = {
        **forward_meta(pad, load_balancer=load_balancer),
        "actor_config": {"loss_agg_mode": "token-mean", "entropy_coeff": 0.0, "use_kl_loss": False},
        "policy_loss_config": {"loss_mode": "vanilla"},
        "global_batch_size": rows,
        "batch_num_tokens": mask.sum(),
    }
    return {
        "batch": {
            **batch,
            "response_mask": mask,
            "loss_mask": mask,
            "old_log_probs": -torch.rand(rows, 8) * mask,
            "advantages": advantages * mask,
        },
        "meta": meta,
        "processing": {"post": ["apply_temperature", "compute_entropy_and_logprobs"], "loss_fn": "verl_grpo"},
    }


def forward_meta(pad: int, *, load_balancer: bool = False, entropy: bool = True) -> dict[str, Any]:
    return {
        "temperature": 1.0,
        "calculate_entropy": entropy,
        "pad_token_id": pad,
        "drop_position_ids": True,
        "load_balancer": load_balancer,
        "rollout_n": 2,
        "max_prompt_len": 5,
        "max_response_len": 3,
        "max_token_len_per_gpu": 64,
    }


def forward_payload(rows: int, pad: int, **meta: Any) -> dict[str, Any]:
    return {
        "batch": dense_batch(rows, pad),
        "meta": forward_meta(pad, **meta),
        "processing": {"post": ["compute_entropy_and_logprobs"], "loss_fn": None},
    }


def training_config(
    model: str, checkpoints: str | None, generation: str, *, stage: int = 2, ranks: int = TRAINING_RANKS
) -> dict[str, Any]:
    """A training job of 4 rows per update: ``ranks`` ranks x 4/ranks micro-batches of 1 row."""
    ds: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 4,
        "gradient_accumulation_steps": 4 // ranks,
    }
    job: dict[str, Any] = {
        "model_name": model,
        "job_type": "training",
        "seed": 1,
        "ds_worker_config": {"enable_gradient_checkpointing": False, "attn_implementation": "sdpa"},
        "ds_config": ds,
    }
    optimizer = {"lr": 0.01, "weight_decay": 0.0, "betas": [0.9, 0.999]}
    if generation == "main":
        ds["optimizer"] = {"type": "AdamW", "params": {**optimizer, "eps": 1e-8}}
    else:
        job["training_config"] = {"training_horizon": 4, "optimizer": optimizer}
    if checkpoints is not None:
        job["checkpoint_path"] = checkpoints
    return job


def converse(url: str, generation: str, model: str, workdir: Path) -> Iterator[Observation]:
    """Run the conversation; yields one observation per request."""
    main = generation == "main"
    encode: Callable[[Any], bytes] = wire.encode_dssst1 if main else wire.encode_torch
    root = str(workdir)
    checkpoints = str(workdir / "checkpoints")
    pad = 0
    http = httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0))

    def call(step: str, method: str, path: str, **kwargs: Any) -> Observation:
        return observe(step, http.request(method, path, **kwargs), generation, root)

    def binary(step: str, path: str, job: int | None, payload: Any) -> Observation:
        params = {"job_id": job} if job is not None else None
        headers = {"Content-Type": "application/octet-stream"}
        return call(step, "POST", path, params=params, content=encode(payload), headers=headers)

    fwd = "/forward" if main else "/fwd-no-grad"
    bwd = "/forward-backward" if main else "/fwd-bwd"
    ids: dict[str, int] = {}

    def init(step: str, body: Any) -> Observation:
        response = http.post("/initialize", json=body)
        if response.status_code == 200:
            ids[step] = int(response.json()["job_id"])
        return observe(step, response, generation, root)

    try:
        yield call("health", "GET", "/health")
        yield call("status, no jobs", "GET", "/status")
        yield call("unknown route", "GET", "/nope")
        yield call("initialize by GET", "GET", "/initialize")
        yield call("probe GET /forward-backward", "GET", "/forward-backward")
        yield init("initialize, empty body", {})
        yield call("initialize, no body", "POST", "/initialize")
        yield init("initialize, model_name not a string", {"model_name": 3})
        yield init("initialize, unknown job type", {"model_name": model, "job_type": "bogus"})
        yield init("sampling", {"model_name": model, "job_type": "sampling", "vllm_config": {"max_model_len": 64}})
        yield init("sampling again", {"model_name": model, "job_type": "sampling"})
        yield init("training, ZeRO stage 0 in bf16", training_config(model, checkpoints, generation, stage=0))
        bad_batch = training_config(model, checkpoints, generation)
        bad_batch["ds_config"]["train_batch_size"] = 6
        yield init("training, batch size not micro x accumulation x ranks", bad_batch)
        bad_schedule = training_config(model, checkpoints, generation)
        bad_schedule["ds_config"]["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 2, "warmup_max_lr": 0.01, "total_num_steps": 10},
        }
        yield init("training, WarmupLR given a cosine parameter", bad_schedule)
        if main:
            no_attention = training_config(model, checkpoints, generation)
            del no_attention["ds_worker_config"]["attn_implementation"]
            yield init("training, no attention implementation", no_attention)
        yield init("training", training_config(model, checkpoints, generation))
        reference = {
            "model_name": model,
            "job_type": "log_prob",
            "ds_config": {"zero_optimization": {"stage": 0}},
            "log_prob_config": {"zero_optimization": {"stage": 0}},
            "ds_worker_config": {"attn_implementation": "sdpa"},
        }
        yield init("log_prob, ZeRO stage 2", reference | {"log_prob_config": {"zero_optimization": {"stage": 2}}})
        yield init("log_prob", reference)
        training, sampling, log_prob = ids["training"], ids["sampling"], ids["log_prob"]
        yield call("job, training", "GET", f"/job/{training}")
        yield call("job, unknown", "GET", "/job/999")
        yield call("job, not a number", "GET", "/job/abc")
        yield call("status, three jobs", "GET", "/status")

        yield binary("forward, training job", fwd, training, forward_payload(4, pad))
        yield binary("forward, reference job, no entropy", fwd, log_prob, forward_payload(4, pad, entropy=False))
        yield binary("forward, load balancer", fwd, training, forward_payload(4, pad, load_balancer=True))
        yield binary("forward, unknown job", fwd, 999, forward_payload(4, pad))
        yield binary("forward, sampling job", fwd, sampling, forward_payload(4, pad))
        yield binary("forward, fewer rows than ranks", fwd, training, forward_payload(1, pad))
        missing = forward_payload(4, pad)
        del missing["processing"]
        yield binary("forward, no processing", fwd, training, missing)
        yield call("forward, no body", "POST", fwd, params={"job_id": training})
        yield call("forward, no job_id", "POST", fwd, content=encode(forward_payload(4, pad)))
        other = wire.encode_torch({"a": 1}) if main else wire.encode_dssst1({"a": torch.ones(1)})
        yield call("forward, the other generation's encoding", "POST", fwd, params={"job_id": training}, content=other)

        yield binary("update", bwd, training, update_payload(4, pad))
        yield binary("update, sampling job", bwd, sampling, update_payload(4, pad))
        yield binary("update, load balancer", bwd, training, update_payload(4, pad, load_balancer=True))
        yield call("step", "POST", "/step", params={"job_id": training})
        yield call("step, unknown job", "POST", "/step", params={"job_id": 999})
        if main:
            yield call(
                "step, learning_rate body", "POST", "/step", params={"job_id": training}, json={"learning_rate": None}
            )
            yield call("step, bad body", "POST", "/step", params={"job_id": training}, json={"learning_rate": "x"})

        # Weight sync as verl-arctic does it: sleep, wake the weights, sync, wake the KV cache, reset the cache.
        if main:
            yield call("sleep sampling", "POST", "/sleep-inference", params={"job_id": sampling})
            yield call(
                "sleep sampling, level in body",
                "POST",
                "/sleep-inference",
                params={"job_id": sampling},
                json={"level": 2},
            )
        else:
            yield call("sleep sampling, no level", "POST", "/sleep-inference", params={"job_id": sampling})
            yield call("sleep sampling", "POST", "/sleep-inference", params={"job_id": sampling, "level": 1})
            yield call("sleep sampling again", "POST", "/sleep-inference", params={"job_id": sampling, "level": 1})
        yield call(
            "wake kv cache before weights", "POST", "/wake-inference", params={"job_id": sampling}, json=["kv_cache"]
        )
        prompt = {"prompts": ["user: say 3 <|im_end|> assistant:"], "sampling_params": {"max_tokens": 4}}
        if main:
            yield binary("generate while asleep", "/generate", sampling, prompt)
        else:
            yield call("generate while asleep", "POST", "/generate", params={"job_id": sampling}, json=prompt)
        yield call("wake weights", "POST", "/wake-inference", params={"job_id": sampling}, json=["weights"])
        if main:
            sync = {"source_sub_job_id": training, "target_sub_job_ids": [sampling]}
            yield call("weight sync, no job_id", "POST", "/weight-sync", json=sync)
            yield call("weight sync", "POST", "/weight-sync", params={"job_id": training}, json=sync)
            yield call(
                "weight sync, tags object",
                "POST",
                "/wake-inference",
                params={"job_id": sampling},
                json={"tags": ["kv_cache"]},
            )
        else:
            sync = {"training_job_id": training, "sampling_job_id": sampling, "colocate": True}
            yield call(
                "weight sync, training twice", "POST", "/sync-weights", json={**sync, "sampling_job_id": training}
            )
            yield call("weight sync", "POST", "/sync-weights", json=sync)
            yield call(
                "wake, tags object", "POST", "/wake-inference", params={"job_id": sampling}, json={"tags": ["kv_cache"]}
            )
            yield call("wake kv cache", "POST", "/wake-inference", params={"job_id": sampling}, json=["kv_cache"])
        yield call("wake, already awake", "POST", "/wake-inference", params={"job_id": sampling})
        yield call("reset prefix cache", "POST", "/reset-prefix-cache", params={"job_id": sampling})
        norms = {"training_job_id": training, "sampling_job_id": sampling}
        yield call("weight norms", "POST", "/weight-norm", json=norms)
        yield call("weight norms, no body", "POST", "/weight-norm")

        sample = {
            "prompts": ["user: say 3 <|im_end|> assistant:", "user: say 7 <|im_end|> assistant:"],
            "sampling_params": {"max_tokens": 4, "ignore_eos": True, "logprobs": 0, "temperature": 1.0},
        }
        token_prompts = {"prompts": [[3, 13, 5]], "sampling_params": {"max_tokens": 2}}
        if main:
            yield binary("generate", "/generate", sampling, sample)
            yield binary("generate, token-id prompts", "/generate", sampling, token_prompts)
            yield binary("generate, training job", "/generate", training, sample)
        else:
            yield call("generate", "POST", "/generate", params={"job_id": sampling}, json=sample)
            yield call(
                "generate, token-id prompts", "POST", "/generate", params={"job_id": sampling}, json=token_prompts
            )
            yield call("generate, training job", "POST", "/generate", params={"job_id": training}, json=sample)
        texts = {"prompts": ["say 3", "say 7 and"], "completions": [" 3", " 7"]}
        yield call("log-probs, reference job", "POST", "/log-probs", params={"job_id": log_prob}, json=texts)
        yield call("log-probs, training job", "POST", "/log-probs", params={"job_id": training}, json=texts)

        for mode in ("all", "all", "non_lp"):
            yield call(f"sleep training {mode}", "POST", "/sleep-training", params={"job_id": training, "mode": mode})
        yield call("wake training", "POST", "/wake-training", params={"job_id": training})
        yield call("wake training again", "POST", "/wake-training", params={"job_id": training})
        yield call("empty training cache", "POST", "/empty-training-cache", params={"job_id": training})
        yield call("sleep reference", "POST", "/sleep-log-prob", params={"job_id": log_prob})
        yield call("wake reference", "POST", "/wake-log-prob", params={"job_id": log_prob})
        yield call("sleep reference, training job", "POST", "/sleep-log-prob", params={"job_id": training})
        if main:
            operation = {"operation_type": "weight-sync", "payload": sync}
            yield call("operation weight-sync", "POST", "/operation", params={"job_id": training}, json=operation)
            yield call(
                "operation, bad payload",
                "POST",
                "/operation",
                params={"job_id": training},
                json={"operation_type": "weight-sync", "payload": {}},
            )
            yield call(
                "operation, unknown", "POST", "/operation", params={"job_id": training}, json={"operation_type": "x"}
            )
            yield call(
                "operation reset",
                "POST",
                "/operation",
                params={"job_id": sampling},
                json={"operation_type": "reset-prefix-cache"},
            )

        if main:
            target = str(workdir / "saved")
            job = {"job_id": training}
            yield call("save, no body", "POST", "/save", params={"job_id": training})
            yield call("save at step", "POST", "/save", params={"job_id": training}, json={"path": target, "step": 1})
            yield call(
                "load at step",
                "POST",
                "/load-checkpoint",
                params={"job_id": training},
                json={"path": target, "step": 1},
            )
            yield call(
                "load, nothing there",
                "POST",
                "/load-checkpoint",
                params={"job_id": training},
                json={"path": target, "step": 7},
            )
            # Arctic's own `latest` (a step number) read by DeepSpeed as a checkpoint tag.
            without_step = {"path": target}
            yield call("load, a path without a step", "POST", "/load-checkpoint", params=job, json=without_step)
            yield call("load latest of the job", "POST", "/load-checkpoint", params={"job_id": training})
        else:
            yield call("save", "POST", "/save-checkpoint", params={"job_id": training})
            yield call("save, sampling job", "POST", "/save-checkpoint", params={"job_id": sampling})

        yield call("destroy, no body", "POST", "/destroy", params={"job_id": training})
        yield call("destroy training", "POST", "/destroy", params={"job_id": training}, json={"job_type": "training"})
        yield call(
            "destroy training again", "POST", "/destroy", params={"job_id": training}, json={"job_type": "training"}
        )
        yield call("step after destroy", "POST", "/step", params={"job_id": training})
        yield init("training without a checkpoint path", training_config(model, None, generation))
        yield init("training after that", training_config(model, checkpoints, generation))
    finally:
        try:
            for job_id, info in http.get("/status").json()["jobs"].items():
                http.post("/destroy", params={"job_id": job_id}, json={"job_type": info["job_type"]})
        finally:
            http.close()
