"""The Arctic test server's state: its jobs, each a pool of workers standing for Arctic's ranks over CPU engines,
and what every operation does to them, as Arctic's server does it (the routes in :mod:`verl_arctic.testing.server`
only parse requests and shape answers)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import HTTPException, Response

from verl_arctic import wire
from verl_arctic.routes import ENCODING
from verl_arctic.testing.batching import combine_rank_metrics, merge_shards, split_rows
from verl_arctic.testing.engine import JobModel, deepspeed_setup, reference_setup
from verl_arctic.testing.models import (
    JobConfig,
    JobConfigMain,
    LoadCheckpointRequest,
    LogProbsRequest,
    ModelConfig,
    OperationRequest,
    ResetPrefixCacheRequest,
    SaveRequest,
    WeightNormRequest,
    WeightSyncRequest,
)

__all__ = ["MEMORY", "Pool", "State", "Workers", "model_config", "prune_checkpoints"]


#: An engine's memory figures after a sleep or wake (arctic-inference server/worker.py reads them off the GPU).
MEMORY = {"gpu_mb": 0.0, "free_mb": 0.0, "reserved_mb": 0.0}


@dataclass
class Pool:
    """arctic-inference's ReplicaPool (one replica) as the server sees it (0.2.0 and 0.3.0
    server/replica_pool.py, server/worker.py): the pool asleep or not, its worker's lifecycle state."""

    config: dict[str, Any] | None = None
    model: JobModel | None = None
    sleeping: bool = False
    worker: str = "ready"  # ready | sleeping | weights_ready

    def require(self) -> JobModel:
        if self.config is None or self.model is None:
            raise RuntimeError("ReplicaPool not initialized")
        return self.model

    def sleep(self, level: int) -> dict[str, Any]:
        """ReplicaPool.sleep: the worker must be awake (worker.py ``sleep``)."""
        self.require()
        if self.sleeping:
            return {"status": "already_sleeping", "level": level}
        if self.worker not in ("ready", "weights_ready"):
            worker: dict[str, Any] = {"status": "error", "message": f"Cannot sleep: worker state is {self.worker}"}
        else:
            self.worker = "sleeping"
            worker = {"status": "sleeping", "level": level, **MEMORY}
        self.sleeping = True
        return {"status": "sleeping", "level": level, "workers": [worker]}

    def wake(self, tags: list[str] | None) -> dict[str, Any]:
        """ReplicaPool.wake_up: ``weights`` alone leaves the pool asleep with its weights ready; waking the KV
        cache straight from sleep is an error of the worker, which a finalizing wake raises (a 500)."""
        self.require()
        finalize = tags is None or "kv_cache" in tags
        if not self.sleeping:
            return {"status": "already_ready"}
        wanted = None if tags is None else set(tags)
        full = wanted is None or wanted >= {"weights", "kv_cache"}
        error = None
        if self.worker == "ready":
            worker: dict[str, Any] = {"status": "already_ready"}
        elif self.worker == "weights_ready":
            if wanted == {"weights"}:
                worker = {"status": "already_weights_ready"}
            elif wanted == {"kv_cache"} or full:
                self.worker = "ready"
                worker = {"status": "ready", **MEMORY}
            else:
                error = f"Cannot wake up from weights_ready with tags={tags!r}; use tags=['kv_cache'] or a full wake"
        elif wanted == {"kv_cache"}:
            error = "Cannot wake kv_cache only from sleeping; wake weights first (tags=['weights'])"
        else:
            self.worker = "ready" if full else "weights_ready"
            worker = {"status": self.worker, **MEMORY}
        if error is not None:
            if finalize:
                raise RuntimeError(f"wake_up failed on 1 worker(s): {error}")
            worker = {"status": "error", "message": error}
        if finalize:
            self.sleeping = False
            return {"status": "ready", "tags": tags, "workers": [worker]}
        return {"status": "weights_ready", "tags": tags, "workers": [worker]}


@dataclass
class Workers:
    """A job's DeepSpeed ranks: one model standing for ``world`` of them, and their offload state."""

    model: JobModel
    world: int
    on_gpu: bool = True
    tokenizer: Any = None


@dataclass
class State:
    """The server's jobs and engines, and what its routes do: the routers below take each route's parameters as
    its generation declares them and call these methods."""

    generation: str
    training_gpus: int
    sampling_gpus: int
    log_prob_gpus: int
    log_prob_engine: str
    colocate: bool
    sampled_logprobs: bool = True
    jobs: dict[int, dict[str, Any]] = field(default_factory=dict)
    next_job_id: int = 1
    training: Workers | None = None
    log_prob: Workers | None = None
    sampling: Pool = field(default_factory=Pool)
    log_prob_pool: Pool | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def main_generation(self) -> bool:
        return self.generation == "main"

    @property
    def encoding(self) -> str:
        return ENCODING[self.generation]

    def binary(self, obj: Any) -> Response:
        return Response(content=wire.encode(self.encoding, obj), media_type="application/octet-stream")

    def verify(self, job_id: int, *types: str) -> dict[str, Any]:
        """``_verify_job`` (0.1.2 rl/http_server.py:100-107, 0.1.4 common/http_server.py:125-132)."""
        info = self.jobs.get(job_id)
        if info is None:
            raise HTTPException(404, f"Job {job_id} not found")
        if info["job_type"] not in types:
            raise HTTPException(400, f"Job {job_id} is not a {', '.join(types)} job")
        return info

    def split(
        self, payload: Any, ranks: int, sp_size: int = 1
    ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
        """``http_split_batch``: the envelope unpacked, position ids rebuilt, rows cut per rank, ``dp_size`` set."""
        batch, meta, processing = payload["batch"], dict(payload["meta"]), payload["processing"]  # KeyError: a 500
        if self.generation == "main" and sp_size > 1:
            raise ValueError(f"sequence-parallel data-plane is not implemented ... Got sp_size={sp_size}.")
        batch = dict(batch)
        if meta.get("drop_position_ids", False) and "position_ids" not in batch:
            mask = batch.get("attention_mask")
            if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
                raise ValueError("Cannot reconstruct position_ids: a 2D [B, S] attention_mask is required")
            mask = mask.long()
            batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0) * mask
        if meta.get("load_balancer", False):
            # reorg_global_batch reads these; the reordering itself does not show in any answer.
            for key in ("max_response_len", "max_token_len_per_gpu"):
                meta[key]
            meta.get("zorro_train_max_rollouts", meta["rollout_n"])
        shards = split_rows(batch, ranks, self.generation)
        meta["dp_size"] = ranks
        meta["worker_return_tensors"] = True
        return shards, meta, processing

    def data_workers(self, job_id: int) -> tuple[dict[str, Any], Workers]:
        info = self.jobs[job_id]  # Arctic looks the job up before verifying it: unknown is a KeyError, a 500
        self.verify(job_id, "training", "log_prob")
        workers = self.log_prob if info["job_type"] == "log_prob" else self.training
        if workers is None:
            raise HTTPException(400, f"Job {job_id} ({info['job_type']}) has no DeepSpeed workers")
        return info, workers

    # -- jobs ------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "training_gpus": self.training_gpus,
            "sampling_gpus": self.sampling_gpus,
            "log_prob_gpus": self.log_prob_gpus,
            "jobs": dict(self.jobs),
        }

    def job_info(self, job_id: int) -> dict[str, Any]:
        info = self.jobs.get(job_id)
        if info is None:
            raise HTTPException(404, f"Job {job_id} not found")
        return info

    def initialize(self, job: JobConfig) -> dict[str, Any]:
        """0.1.2 rl/http_server.py:120-329, 0.1.4 common/http_server.py:145-354."""
        job_type = job.job_type
        with self.lock:
            job_id = self.next_job_id
            self.next_job_id += 1
            engine = None
            if job_type == "training":
                if self.training_gpus == 0:
                    raise HTTPException(400, "No training GPUs configured")
                if self.training is not None:
                    raise HTTPException(409, "Training job already running")
                if self.main_generation and job.checkpoint_path is None:
                    raise HTTPException(400, "checkpoint_path is required for training jobs")
                setup = deepspeed_setup(job.model_dump(), self.generation, self.training_gpus)  # refusal: a 500
                model = JobModel(job.model_name, seed=job.seed, setup=setup)
                self.training = Workers(model, self.training_gpus)
                # v0.1 asserts the checkpoint path only now, with the workers kept: the next training job is a 409.
                assert job.checkpoint_path is not None, "checkpoint_path is required for training jobs"
            elif job_type == "sampling":
                if self.sampling_gpus == 0:
                    raise HTTPException(400, "No sampling GPUs configured")
                if self.sampling.config is not None:
                    raise HTTPException(409, "Sampling job already running")
                config = model_config(job.model_name, job.vllm_config)
                self.sampling.config = config  # set before the engines load, as ReplicaPool.initialize does
                self.sampling.model = JobModel(job.model_name, seed=job.seed)
            elif job_type == "log_prob":
                if self.log_prob_gpus == 0:
                    raise HTTPException(400, "No log-prob GPUs configured")
                if job.ds_config is not None:
                    if self.log_prob is not None:
                        raise HTTPException(409, "Log-prob job already running")
                    reference_setup(job.model_dump(), self.generation)  # refusal: a 500
                    model = JobModel(job.model_name, seed=job.seed, world=self.log_prob_gpus)
                    self.log_prob = Workers(model, self.log_prob_gpus, tokenizer=model.tokenizer)
                    engine = "deepspeed"
                else:
                    pool = self.log_prob_pool
                    if pool is None:  # launched with --log-prob-engine deepspeed: Arctic reads None._config
                        raise AttributeError("'NoneType' object has no attribute '_config'")
                    if pool.config is not None:
                        raise HTTPException(409, "Log-prob job already running")
                    pool.config = model_config(job.model_name, job.vllm_config)
                    pool.model = JobModel(job.model_name, seed=job.seed)
                    engine = "vllm"
            else:
                raise HTTPException(400, f"Unknown job type: {job_type}")
            info: dict[str, Any] = {
                "job_id": job_id,
                "job_type": job_type,
                "model_name": job.model_name,
                "status": "RUNNING",
                "checkpoint_path": None,
                "sync_path": None,
            }
            if isinstance(job, JobConfigMain):
                info["sp_size"] = job.sp_size
            if engine is not None:
                info["engine"] = engine
            if job_type == "training":
                assert job.checkpoint_path is not None
                directory = pathlib.Path(job.checkpoint_path) / f"arctic_rl_job_{job_id}"
                directory.mkdir(parents=True, exist_ok=True)
                info["checkpoint_path"] = str(directory)
                info["sync_path"] = str(directory / "weight_sync.pt")
                if isinstance(job, JobConfigMain):
                    info["cuda_ipc"] = job.cuda_ipc
                    info["low_memory"] = job.low_memory
            self.jobs[job_id] = info
        return {"job_id": job_id, "job_type": job_type, "running": True}

    def destroy(self, job_id: int) -> dict[str, Any]:
        with self.lock:
            info = self.jobs.pop(job_id, None)
            if info is None:
                raise HTTPException(404, f"Job {job_id} not found")
            if info["job_type"] == "training":
                self.training = None
            elif info["job_type"] == "sampling":
                self.sampling = Pool()
            elif info.get("engine") == "deepspeed":
                self.log_prob = None
            elif self.log_prob_pool is not None:
                self.log_prob_pool = Pool()
        return {"job_id": job_id}

    # -- the data plane ----------------------------------------------------------------------------

    def forward_backward(self, job_id: int, body: bytes) -> Response:
        self.verify(job_id, "training")
        assert self.training is not None
        workers = self.training
        shards, meta, processing = self.split(
            wire.decode(self.encoding, body), workers.world, self.jobs[job_id].get("sp_size", 1)
        )
        with self.lock:
            results = [workers.model.forward_backward(s, meta, processing, self.generation) for s in shards]
            for _ in range(results[0]["micro_batches"] - 1):
                workers.model.step()  # the workers' engine.step() after every micro-batch but the last
        metrics = combine_rank_metrics([r["metrics"] for r in results], self.generation)
        if self.main_generation and "loss" in metrics:  # finalize_fwd_bwd_metrics
            avg_loss = float(metrics["loss"])
        else:  # v0.1 sums the ranks' mean micro-batch losses (rl/http_server.py:388-389)
            avg_loss = float(sum(r["avg_loss"] for r in results))
        answer: dict[str, Any] = {"job_id": job_id, "metrics": metrics, "avg_loss": avg_loss}
        if self.main_generation and meta.get("return_fwd_batch", False):
            raise NotImplementedError("return_fwd_batch: the test server does not return the update's batch")
        return self.binary(answer)

    def forward(self, job_id: int, body: bytes) -> Response:
        info, workers = self.data_workers(job_id)
        shards, meta, processing = self.split(wire.decode(self.encoding, body), workers.world, info.get("sp_size", 1))
        with self.lock:
            results = [workers.model.forward(s, meta, processing, self.generation) for s in shards]
        answer: dict[str, Any] = {"job_id": job_id, "batch": merge_shards([r["batch"] for r in results])}
        if self.main_generation:
            answer["metrics"] = combine_rank_metrics([r["metrics"] for r in results], self.generation)
            answer["avg_loss"] = 0.0
        else:
            answer["metrics"] = merge_shards([r["metrics"] for r in results])
        return self.binary(answer)

    def step(self, job_id: int) -> dict[str, Any]:
        self.verify(job_id, "training")
        assert self.training is not None
        with self.lock:
            rank = self.training.model.step()
        ranks = [rank] * self.training.world  # every rank reports the same numbers after the same step
        return {
            "job_id": job_id,
            "metrics": merge_shards([r["metrics"] for r in ranks]),
            "batch": merge_shards([r["batch"] for r in ranks]),
        }

    def empty_training_cache(self, job_id: int) -> dict[str, Any]:
        self.verify(job_id, "training")
        assert self.training is not None
        return {"job_id": job_id, "workers": [{"gpu_mb": 0.0}] * self.training.world}

    def sleep_training(self, job_id: int, mode: str) -> dict[str, Any]:
        self.verify(job_id, "training")
        assert self.training is not None
        workers = self.training
        if mode in ("non_lp", "lp_params"):
            status = {"non_lp": "offloaded_non_lp", "lp_params": "offloaded_lp"}[mode]
        elif not workers.on_gpu:
            status = "already_offloaded"
        else:
            status = "offloaded"
        workers.on_gpu = False
        per_rank = (
            {"status": status} if status == "already_offloaded" else {"status": status, "elapsed": 0.0, "gpu_mb": 0.0}
        )
        return {"job_id": job_id, "workers": [per_rank] * workers.world}

    def wake_training(self, job_id: int) -> dict[str, Any]:
        self.verify(job_id, "training")
        assert self.training is not None
        workers = self.training
        per_rank = {"status": "already_on_gpu"} if workers.on_gpu else {"status": "on_gpu", "elapsed": 0.0}
        workers.on_gpu = True
        return {"job_id": job_id, "workers": [per_rank] * workers.world}

    def log_prob_offload(self, job_id: int, to_gpu: bool) -> dict[str, Any]:
        self.verify(job_id, "log_prob")
        workers = self.log_prob
        if workers is None:  # a vLLM log-prob job: nothing to offload
            return {"job_id": job_id, "workers": []}
        if to_gpu:
            per_rank = {"status": "already_on_gpu"} if workers.on_gpu else {"status": "on_gpu", "elapsed": 0.0}
        else:
            per_rank = (
                {"status": "offloaded", "elapsed": 0.0, "gpu_mb": 0.0}
                if workers.on_gpu
                else {"status": "already_offloaded"}
            )
        workers.on_gpu = to_gpu
        return {"job_id": job_id, "workers": [per_rank] * workers.world}

    # -- sampling --------------------------------------------------------------------------------

    def pools(self) -> list[tuple[str, Pool]]:
        found = [("sampling", self.sampling)]
        if self.log_prob_pool is not None and self.log_prob_pool.config is not None:
            found.append(("log_prob", self.log_prob_pool))
        return found

    def sleep_inference(self, job_id: int, level: int) -> dict[str, Any]:
        self.verify(job_id, "sampling")
        results = {"sampling": self.sampling.sleep(level)}
        lp = self.log_prob_pool
        if lp is not None and lp.config is not None and not lp.sleeping:
            results["log_prob"] = lp.sleep(level)
        return {"job_id": job_id, **results}

    def wake_inference(self, job_id: int, tags: list[str] | None) -> dict[str, Any]:
        self.verify(job_id, "sampling")
        results = {"sampling": self.sampling.wake(tags)}
        lp = self.log_prob_pool
        if lp is not None and lp.config is not None and lp.sleeping:
            results["log_prob"] = lp.wake(tags)
        return {"job_id": job_id, **results}

    def reset_prefix_cache(self, job_id: int) -> dict[str, Any]:
        self.verify(job_id, "sampling")
        results = {}
        for name, pool in self.pools():
            pool.require()
            results[name] = {"status": "prefix_cache_reset"}
        return {"job_id": job_id, **results}

    def generate(self, job_id: int, prompts: list[str], params: dict[str, Any] | None) -> dict[str, Any]:
        self.verify(job_id, "sampling")
        model = self.sampling.require()
        if self.sampling.sleeping:
            raise RuntimeError("Model is sleeping; call /wake_up first")
        with self.lock:
            results = [model.generate(prompt, dict(params or {})) for prompt in prompts]
        if not self.sampled_logprobs:
            for result in results:
                result.pop("logprobs", None)
        return {"job_id": job_id, "results": results}

    def weight_norm(self, request: WeightNormRequest) -> dict[str, Any]:
        self.verify(request.training_job_id, "training")
        self.verify(request.sampling_job_id, "sampling")
        assert self.training is not None
        sampling = self.sampling.require()
        with self.lock:
            training_norm, training_count = self.training.model.weight_norm()
            sampling_norm, sampling_count = sampling.weight_norm()
        return {  # both count parameter tensors (vLLM's fused layers have fewer than Hugging Face's)
            "training_norm": training_norm,
            "sampling_norm": sampling_norm,
            "training_num_params": training_count,
            "sampling_num_params": sampling_count,
        }

    def sync(self, training_job: int, sampling_job: int) -> dict[str, Any]:
        self.verify(training_job, "training")
        self.verify(sampling_job, "sampling")
        assert self.training is not None
        sampling = self.sampling.require()
        with self.lock:
            sampling.load_weights_from(self.training.model)
        return {"job_id": training_job, "status": "ok"}

    def weight_sync(self, request: WeightSyncRequest) -> dict[str, Any]:
        return self.sync(request.source_sub_job_id, request.target_sub_job_ids[0])

    def operation(self, job_id: int, request: OperationRequest) -> dict[str, Any]:
        """0.1.4 common/http_server.py:608-624: models built from ``payload`` fail as 500s, not 422s."""
        payload = request.payload or {}
        if request.operation_type == "weight-sync":
            return self.weight_sync(WeightSyncRequest(**payload))
        if request.operation_type == "reset-prefix-cache":
            ResetPrefixCacheRequest(**payload)
            return self.reset_prefix_cache(job_id)
        if request.operation_type == "sleep-inference":
            return self.sleep_inference(job_id, payload.get("level", 1))
        if request.operation_type == "wake-inference":
            return self.wake_inference(job_id, payload.get("tags"))
        raise HTTPException(status_code=400, detail=f"unknown operation_type {request.operation_type!r}")

    def log_probs(self, job_id: int, request: LogProbsRequest) -> Response:
        """/log-probs (0.1.2 rl/http_server.py:952-983, 0.1.4 common/http_server.py:933-961)."""
        self.verify(job_id, "log_prob")
        info = self.jobs[job_id]
        texts = request.prompts
        if request.completions is not None:
            texts = [p + c for p, c in zip(request.prompts, request.completions, strict=False)]
        if info.get("engine") == "deepspeed":
            assert self.log_prob is not None
            encoded = dict(self.log_prob.tokenizer(texts, return_tensors="pt", padding=True))
            shards = split_rows(encoded, self.log_prob.world, self.generation)
            with self.lock:
                results: Any = torch.cat([self.log_prob.model.log_probs_of_encoded(s) for s in shards], dim=0)
        else:
            assert self.log_prob_pool is not None
            model = self.log_prob_pool.require()
            params = {"max_tokens": 1, "temperature": 0, "prompt_logprobs": request.top_k}
            with self.lock:
                results = [model.generate(text, params) for text in texts]
        return self.binary({"job_id": job_id, "results": results})

    # -- checkpoints -------------------------------------------------------------------------------

    def save_checkpoint(self, job_id: int) -> dict[str, Any]:
        """v0.1's /save-checkpoint: the job's own folder."""
        info = self.verify(job_id, "training")
        path = info.get("checkpoint_path")
        assert path is not None, f"checkpoint_path is required for training job {job_id}"
        assert self.training is not None
        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
        with self.lock:
            self.training.model.save(path)
        return {"job_id": job_id, "path": path}

    def save(self, job_id: int, request: SaveRequest) -> dict[str, Any]:
        """0.1.4 common/http_server.py:496-522."""
        info = self.verify(job_id, "training")
        root = request.path or info.get("checkpoint_path")
        assert root is not None, f"checkpoint_path is required for training job {job_id}"
        assert self.training is not None
        directory = os.path.join(root, f"checkpoint-{int(request.step)}") if request.step is not None else root
        pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
        with self.lock:
            self.training.model.save(directory)
        if request.export_hf:  # rank 0's save_pretrained of the weights, no tokenizer (deepspeed_worker.py:625-656)
            self.training.model.model.save_pretrained(os.path.join(directory, "hf"), safe_serialization=True)
        if request.step is not None:
            pathlib.Path(root, "latest").write_text(str(int(request.step)))
        if request.save_total_limit is not None and int(request.save_total_limit) > 0:
            prune_checkpoints(root, int(request.save_total_limit))
        return {
            "job_id": job_id,
            "path": directory,
            "hf_path": os.path.join(directory, "hf") if request.export_hf else None,
            "global_step": self.training.model.global_steps,
        }

    def load_checkpoint(self, job_id: int, request: LoadCheckpointRequest) -> dict[str, Any]:
        """0.1.4 common/http_server.py:525-545: a missing checkpoint loads nothing and answers step 0."""
        info = self.verify(job_id, "training")
        path = request.path or info.get("checkpoint_path")
        assert path is not None, f"checkpoint_path is required for training job {job_id}"
        assert self.training is not None
        if request.step is not None:
            path = str(pathlib.Path(path) / f"checkpoint-{int(request.step)}")
        elif request.path is None:
            latest = pathlib.Path(path) / "latest"
            if latest.is_file():
                with contextlib.suppress(ValueError):
                    path = str(pathlib.Path(path) / f"checkpoint-{int(latest.read_text().strip())}")
        with self.lock:
            loaded = self.training.model.load(path)
        return {"job_id": job_id, "path": path, "global_step": self.training.model.global_steps if loaded else 0}


def model_config(model_name: str, vllm_config: dict[str, Any] | None) -> dict[str, Any]:
    """``build_model_config``: known ModelConfig fields validated (a 500 when wrong), the rest engine kwargs."""
    config = dict(vllm_config or {})
    config["model"] = model_name
    known = set(ModelConfig.model_fields)
    validated = ModelConfig(**{k: v for k, v in config.items() if k in known})
    return {**validated.model_dump(), "extra_engine_kwargs": {k: v for k, v in config.items() if k not in known}}


def prune_checkpoints(root: str, keep: int) -> None:
    """``prune_checkpoint_dirs`` (0.1.4 common/utils/checkpoint.py:29-53): keep the newest ``keep``."""
    found = sorted(
        (int(m.group(1)), os.path.join(root, name))
        for name in os.listdir(root)
        if (m := re.match(r"^checkpoint-(\d+)$", name))
    )
    for _, path in found[:-keep] if len(found) > keep else []:
        shutil.rmtree(path, ignore_errors=True)
