"""A CPU stand-in for arctic_inference's vLLM ``ReplicaPool`` (arctic-inference 0.2.0 and 0.3.0).

Arctic's HTTP server drives its sampling engine through this class only. The
real pool is pure Python, but it cannot be imported without vLLM (its
``Scheduler`` imports ``server/metrics.py``, whose lines 36-38 import
``vllm``), and the GPU engine behind it (vLLM ``AsyncLLM`` inside each
``InferenceWorker`` Ray actor) is what cannot run on a CPU. The two releases
have the same pool and worker API; 0.3.0 only adds a per-replica ``VLLM_PORT``
(replica_pool.py:268-273) and picks vanilla engine args when Arctic's vLLM
plugin is off (worker.py:151-160). Everything the server sees is modelled on
them (line numbers of 0.3.0; in 0.2.0 the pool's methods after ``initialize``
sit 6 lines earlier, the worker's after ``initialize`` 12 lines earlier):

- ``ReplicaPool.initialize`` (replica_pool.py:165-283): "Already initialized.
  Call shutdown() first.", the checks on ``ray_num_gpus``, ``bundle_indices``
  and ``placement_groups``, ``num_replicas=None`` meaning every GPU // TP
  (``ensure_ray`` 24-37), and each worker's Ray options from
  ``_worker_ray_options`` (107-144): with placement groups (Arctic's colocated
  mode) the worker is pinned to its bundle with the fractional GPU claim. Without
  placement groups the stand-in claims no GPU (the real one claims ``tp`` GPUs):
  the harness's non-colocated cluster counts only the training and log-prob GPUs.
- ``generate`` (329-378): a ``str`` or a token-id list is one prompt, anything
  else a batch; ``routing_key`` length checks (359-366, scheduler.py:280-285);
  "ReplicaPool not initialized", "Model is sleeping; call /wake_up first".
  ``strict`` and ``routing_key`` only steer the real scheduler's replica choice;
  here prompts go round-robin.
- ``sleep`` (462-488), ``wake_up`` (491-551: ``weights`` alone leaves the pool
  asleep, ``weights_ready``; a wake that finalizes raises when a worker
  failed), ``reset_prefix_cache`` (553-564), ``compute_weight_norm`` (609-618),
  ``close_weight_sync`` (929-933), ``shutdown`` (285-323).
- the worker (``InferenceWorker``, worker.py:117-531): its lifecycle states
  (90-115: ready, sleeping, weights_ready) and the errors of every transition;
  ``generate``'s result (194-240: text, token_ids, finish_reason, prompt_len,
  generation_len, prefix_cache_len, and ``logprobs`` / ``prompt_logprobs`` as one
  ``{token_id: {"logprob", "rank"}}`` dict per position, the first prompt
  position ``None``); ``compute_weight_norm`` (514-525 with the extension's
  receiver.py:705-722: ``num_params`` counts parameter tensors);
  ``load_weights_from_shm_path`` (483-489, receiver.py:569-598 and 92-108: a
  ``torch.save``d list of ``(name, tensor)``, the parameter names checked
  against the model's as in receiver.py:114-190, the result ``status`` "done").

The model is a Hugging Face causal LM on CPU in one Ray actor per replica;
sampling is plain ancestral sampling with vLLM's parameter names (max_tokens,
temperature, top_p, top_k, seed, logprobs, prompt_logprobs, ignore_eos,
stop_token_ids), capped at ``max_model_len`` as vLLM does. Unknown sampling
parameters are ignored, where vLLM's ``SamplingParams(**params)`` would refuse
them. The parameter count is the Hugging Face model's; vLLM's fused layers
(qkv_proj, gate_up_proj) hold fewer tensors, so a real pool reports fewer.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import ray
import torch

_READY, _SLEEPING, _WEIGHTS_READY, _UNINITIALIZED = "ready", "sleeping", "weights_ready", "uninitialized"


#: The engine's memory figures after a sleep or wake (worker.py:18-36 reads them from the GPU); none here.
_MEMORY = {"gpu_mb": 0.0, "free_mb": 0.0, "reserved_mb": 0.0}


def _full_wake(tags: list[str] | None) -> bool:
    return tags is None or set(tags) >= {"weights", "kv_cache"}


@ray.remote(num_cpus=0)
class CpuSamplingWorker:
    """Stands in for ``InferenceWorker`` (worker.py:117-531) with a Hugging Face model instead of vLLM."""

    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.max_model_len: int | None = None
        self.state = _UNINITIALIZED

    def initialize(self, engine_kwargs: dict[str, Any], env: dict[str, str] | None = None) -> bool:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if env:
            os.environ.update(env)
        self.model = AutoModelForCausalLM.from_pretrained(engine_kwargs["model"], dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(engine_kwargs["model"])
        self.max_model_len = engine_kwargs.get("max_model_len")
        self.state = _READY
        return True

    def _position_logprobs(self, full: torch.Tensor, token: int, top: int) -> dict[int, dict[str, Any]]:
        entry = {token: {"logprob": float(full[token]), "rank": int((full > full[token]).sum()) + 1}}
        for alt in torch.topk(full, top).indices.tolist() if top > 0 else []:
            entry.setdefault(int(alt), {"logprob": float(full[alt]), "rank": int((full > full[alt]).sum()) + 1})
        return entry

    @torch.no_grad()
    def generate(self, prompt: str | list[int], params: dict[str, Any]) -> dict[str, Any]:
        if self.state != _READY:
            raise RuntimeError(f"Worker not ready: state={self.state}")
        # vLLM adds special tokens to text prompts
        prompt_ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if self.max_model_len is not None and len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_ids)}) is longer than the maximum model length of "
                f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        max_tokens = int(params.get("max_tokens") or 16)
        if self.max_model_len is not None:
            max_tokens = min(max_tokens, self.max_model_len - len(prompt_ids))
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k") or 0)
        want = params.get("logprobs")
        want_prompt = params.get("prompt_logprobs")
        generator = None
        if params.get("seed") is not None:
            generator = torch.Generator().manual_seed(int(params["seed"]))
        stop = set(params.get("stop_token_ids") or [])
        if not params.get("ignore_eos"):
            stop.add(self.tokenizer.eos_token_id)
        ids, past, tokens, logprobs, finish = torch.tensor([prompt_ids]), None, [], [], "length"
        prompt_logprobs: list[Any] | None = None
        for step in range(max_tokens):
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            if step == 0 and want_prompt is not None:
                every = torch.log_softmax(out.logits[0].float(), dim=-1)
                prompt_logprobs = [None] + [
                    self._position_logprobs(every[i - 1], prompt_ids[i], int(want_prompt))
                    for i in range(1, len(prompt_ids))
                ]
            logits = out.logits[0, -1].float()
            full = torch.log_softmax(logits, dim=-1)  # vLLM's default: log-probs of the unprocessed distribution
            if temperature <= 0:
                token = int(torch.argmax(logits))
            else:
                scaled = logits / temperature
                if top_k > 0:
                    kth = torch.topk(scaled, min(top_k, scaled.numel())).values[-1]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                if top_p < 1.0:
                    sorted_logits, order = torch.sort(scaled, descending=True)
                    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
                    drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p
                    scaled[order[drop]] = float("-inf")
                token = int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))
            tokens.append(token)
            if want is not None:
                logprobs.append(self._position_logprobs(full, token, int(want)))
            if token in stop:
                finish = "stop"
                break
            ids = torch.tensor([[token]])
        result: dict[str, Any] = {
            "text": self.tokenizer.decode(tokens, skip_special_tokens=True),
            "token_ids": tokens,
            "finish_reason": finish,
            "prompt_len": len(prompt_ids),
            "generation_len": len(tokens),
            "prefix_cache_len": 0,
        }
        if prompt_logprobs is not None:
            result["prompt_logprobs"] = prompt_logprobs
        if want is not None:
            result["logprobs"] = logprobs
        return result

    def load_weights_from_shm_path(self, path: str) -> dict[str, Any]:
        from arctic_inference.server.weight_sync.utils import _name_is_non_synced

        start = time.time()
        weights = torch.load(path, map_location="cpu", weights_only=True)
        sent = {name for name, _ in weights if not _name_is_non_synced(name)}
        expected = {name for name, _ in self.model.named_parameters() if not _name_is_non_synced(name)}
        if sent != expected and os.environ.get("ARCTIC_WEIGHT_SYNC_STRICT_NAMES", "1") != "0":
            raise RuntimeError(
                "Weight-sync param name mismatch [cpu_to_gpu]:\n"
                f"  Sender shipped names the model does NOT expect: {sorted(sent - expected)[:10]}\n"
                f"  Model expects names the sender did NOT ship: {sorted(expected - sent)[:10]}\n"
                f"  (sender_count={len(sent)}, expected_count={len(expected)})"
            )
        state = self.model.state_dict()
        for name, tensor in weights:
            state[name].copy_(tensor.to(state[name].dtype))
        return {
            "status": "done",
            "params_loaded": len(weights),
            "elapsed": time.time() - start,
            "update_path": "cpu_to_gpu",
            "mem_before_bytes": 0,
            "mem_peak_bytes": 0,
            "mem_after_bytes": 0,
            "mem_extra_bytes": 0,
        }

    @torch.no_grad()
    def compute_weight_norm(self) -> dict[str, Any]:
        params = [p for _, p in self.model.named_parameters()]
        sq_sum = float(sum(p.double().pow(2).sum().item() for p in params))
        return {"norm": sq_sum**0.5, "sq_sum": sq_sum, "num_params": len(params)}

    def sleep(self, level: int = 1, offload_weights: bool = False) -> dict[str, Any]:
        if self.state not in (_READY, _WEIGHTS_READY):
            raise RuntimeError(f"Cannot sleep: worker state is {self.state}")
        self.state = _SLEEPING
        return {"status": "sleeping", "level": level, **_MEMORY}

    def wake_up(self, tags: list[str] | None = None, restore_weights: bool = False) -> dict[str, Any]:
        tag_set = None if tags is None else set(tags)
        if self.state == _READY:
            return {"status": "already_ready"}
        if self.state == _WEIGHTS_READY:
            if tag_set == {"weights"}:
                return {"status": "already_weights_ready"}
            if not (tag_set == {"kv_cache"} or _full_wake(tags)):
                raise RuntimeError(
                    f"Cannot wake up from weights_ready with tags={tags!r}; use tags=['kv_cache'] or a full wake"
                )
            self.state = _READY
        elif self.state != _SLEEPING:
            raise RuntimeError(f"Cannot wake up: worker state is {self.state}")
        elif tag_set == {"kv_cache"}:
            raise RuntimeError("Cannot wake kv_cache only from sleeping; wake weights first (tags=['weights'])")
        else:
            self.state = _READY if _full_wake(tags) else _WEIGHTS_READY
        return {
            "status": "ready" if self.state == _READY else "weights_ready",
            **_MEMORY,
        }

    def reset_prefix_cache(self) -> dict[str, Any]:
        if self.state not in (_READY, _SLEEPING, _WEIGHTS_READY):
            raise RuntimeError(f"Cannot reset prefix cache: worker state is {self.state}")
        return {"status": "prefix_cache_reset"}

    def close_weight_sync(self) -> dict[str, Any]:
        return {"status": "ok"}

    def shutdown(self) -> None:
        self.model, self.state = None, _UNINITIALIZED


class ReplicaPool:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._config: Any = None
        self._model_id: str | None = None
        self._ray_num_gpus: float | int | None = None
        self._placement_groups: list[Any] | None = None
        self._bundle_indices: list[int] | None = None
        self._workers: list[Any] = []
        self._sleeping = False
        self._next = 0
        self._lock = asyncio.Lock()

    @property
    def config(self) -> Any:
        if self._config is None:
            raise RuntimeError("ReplicaPool not initialized")
        return self._config

    @property
    def model_id(self) -> str | None:
        return self._model_id

    @property
    def tp_size(self) -> int:
        return int(self.config.tensor_parallel_size)

    @property
    def num_replicas(self) -> int:
        return len(self._workers)

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def _check_model_id(self, model_id: str | None) -> None:
        if model_id is not None and self._model_id is not None and model_id != self._model_id:
            raise ValueError(f"model_id mismatch: got {model_id!r}, expected {self._model_id!r}")

    def _worker_ray_options(self, replica_idx: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict[str, Any] = {}  # the real worker is an async actor with max_concurrency=2048; this one is serial
        if self._placement_groups and self._bundle_indices is not None and replica_idx < len(self._bundle_indices):
            pg = self._placement_groups[replica_idx % len(self._placement_groups)]
            tp = self.tp_size
            opts["num_gpus"] = 0 if tp > 1 else self._ray_num_gpus
            bundle = self._bundle_indices[replica_idx] * tp if tp > 1 else self._bundle_indices[replica_idx]
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle
            )
        return opts

    async def initialize(
        self,
        config: Any,
        model_id: str | None = None,
        num_replicas: int | None = None,
        ray_num_gpus: float | int | None = None,
        placement_groups: list[Any] | None = None,
        bundle_indices: list[int] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> int:
        if self._config is not None:
            raise RuntimeError("Already initialized. Call shutdown() first.")
        self._config = config
        self._model_id = model_id
        tp = int(config.tensor_parallel_size)
        if ray_num_gpus is not None and tp > 1 and not placement_groups:
            raise ValueError(
                f"ray_num_gpus={ray_num_gpus} is not supported with tensor_parallel_size={tp}. "
                "Fractional GPU colocation requires a placement group for TP>1."
            )
        self._ray_num_gpus = ray_num_gpus if ray_num_gpus is not None else tp
        self._placement_groups = placement_groups
        self._bundle_indices = bundle_indices
        if num_replicas is None:
            total_gpus = ensure_ray()
            num_replicas = total_gpus // tp
            if num_replicas == 0:
                raise RuntimeError(f"Not enough GPUs: TP={tp} needs at least {tp} GPUs but only {total_gpus} available")
        if bundle_indices is not None and len(bundle_indices) != num_replicas:
            raise ValueError(f"bundle_indices length ({len(bundle_indices)}) must match num_replicas ({num_replicas})")
        if placement_groups is not None and len(placement_groups) not in (1, num_replicas):
            raise ValueError(
                f"placement_groups length ({len(placement_groups)}) must be "
                f"either 1 (shared) or num_replicas ({num_replicas}) (per-replica)"
            )
        self._workers = [CpuSamplingWorker.options(**self._worker_ray_options(i)).remote() for i in range(num_replicas)]
        env = dict(getattr(config, "extra_env", None) or {})
        env.update(extra_env or {})
        await asyncio.gather(*[w.initialize.remote(config.to_engine_kwargs(), env or None) for w in self._workers])
        return len(self._workers)

    async def shutdown(self, model_id: str | None = None) -> None:
        self._check_model_id(model_id)
        for worker in self._workers:
            ray.kill(worker)
        self._workers, self._config, self._model_id, self._sleeping = [], None, None, False
        self._ray_num_gpus, self._placement_groups, self._bundle_indices = None, None, None

    async def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: dict[str, Any] | None = None,
        model_id: str | None = None,
        routing_key: str | list[str | None] | None = None,
        strict: bool = False,
    ) -> list[dict[str, Any]]:
        self._check_model_id(model_id)
        if self._config is None:
            raise RuntimeError("ReplicaPool not initialized")
        if self._sleeping:
            raise RuntimeError("Model is sleeping; call /wake_up first")
        params = sampling_params or {}
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            if isinstance(routing_key, list) and len(routing_key) != 1:
                raise ValueError(f"Got {len(routing_key)} routing keys for a single prompt")
            prompts = [prompts]  # type: ignore[list-item]
        elif isinstance(routing_key, list) and len(routing_key) != len(prompts):
            raise ValueError(f"routing_key list length ({len(routing_key)}) must match prompts length ({len(prompts)})")
        refs = []
        for prompt in prompts:
            refs.append(self._workers[self._next % len(self._workers)].generate.remote(prompt, params))
            self._next += 1
        return list(await asyncio.gather(*refs))

    async def sleep(self, model_id: str | None = None, level: int = 1, offload_weights: bool = False) -> dict[str, Any]:
        self._check_model_id(model_id)
        if self._config is None:
            raise RuntimeError("ReplicaPool not initialized")
        if self._sleeping:
            return {"status": "already_sleeping", "level": level}
        async with self._lock:
            results = await asyncio.gather(
                *[w.sleep.remote(level=level, offload_weights=offload_weights) for w in self._workers],
                return_exceptions=True,
            )
            self._sleeping = True
            workers = [{"status": "error", "message": str(r)} if isinstance(r, Exception) else r for r in results]
            return {"status": "sleeping", "level": level, "workers": workers}

    async def wake_up(
        self,
        model_id: str | None = None,
        tags: list[str] | None = None,
        restore_weights: bool = False,
        finalize: bool | None = None,
    ) -> dict[str, Any]:
        self._check_model_id(model_id)
        if self._config is None:
            raise RuntimeError("ReplicaPool not initialized")
        if finalize is None:
            finalize = tags is None or "kv_cache" in tags
        if not self._sleeping:
            return {"status": "already_ready"}
        async with self._lock:
            results = await asyncio.gather(
                *[w.wake_up.remote(tags=tags, restore_weights=restore_weights) for w in self._workers],
                return_exceptions=True,
            )
            errors = [r for r in results if isinstance(r, Exception)]
            if errors and finalize:
                raise RuntimeError(f"wake_up failed on {len(errors)} worker(s): {errors[0]}")
            workers = [{"status": "error", "message": str(r)} if isinstance(r, Exception) else r for r in results]
            if finalize:
                self._sleeping = False
                return {"status": "ready", "tags": tags, "workers": workers}
            return {"status": "weights_ready", "tags": tags, "workers": workers}

    async def reset_prefix_cache(self, model_id: str | None = None) -> dict[str, Any]:
        self._check_model_id(model_id)
        if self._config is None:
            raise RuntimeError("ReplicaPool not initialized")
        async with self._lock:
            await asyncio.gather(*[w.reset_prefix_cache.remote() for w in self._workers], return_exceptions=True)
            return {"status": "prefix_cache_reset"}

    async def compute_weight_norm(self, model_id: str | None = None) -> dict[str, Any]:
        self._check_model_id(model_id)
        if not self._workers:
            raise RuntimeError("ReplicaPool not initialized")
        return await self._workers[0].compute_weight_norm.remote()

    async def close_weight_sync(self, model_id: str | None = None) -> dict[str, Any]:
        self._check_model_id(model_id)
        async with self._lock:
            workers = await asyncio.gather(*[w.close_weight_sync.remote() for w in self._workers])
            return {"status": "ok", "workers": list(workers)}

    async def sync_weights(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("NCCL weight sync needs GPUs; the CPU harness syncs through the training job's file")


def ensure_ray() -> int:
    """``ensure_ray`` (replica_pool.py:24-37): the cluster's GPU count, refusing a cluster without GPUs."""
    ray.init(ignore_reinit_error=True, log_to_driver=True)
    total = int(ray.cluster_resources().get("GPU", 0))
    if total == 0:
        raise RuntimeError("No GPUs available in the Ray cluster")
    return total
