"""A protocol-faithful Arctic RL server for tests and demos, backed by small CPU models.

    python -m verl_arctic.testing.server --port 7000 --api main     # or --api v0.1

It serves one protocol generation, bound to 127.0.0.1, with Arctic's routes,
bodies, job lifecycle, status codes and error texts (docs/arctic-protocol.md):
jobs are integers from 1, at most one per type, always ``RUNNING`` once
created; unknown jobs are ``404 Job N not found``, wrong types ``400 Job N is
not a training job``, duplicates ``409 Training job already running``; any other
failure is a bare ``500 Internal Server Error``. Binary bodies are read with
``torch.load(weights_only=True)`` (v0.1) or as DSSST1 frames (main): nothing is
unpickled. Each job owns its own model, so the sampling job serves stale
weights until ``weight-sync`` copies the training job's, as on a real server.

What it is not: DeepSpeed, vLLM, GPUs, data parallelism, ZoRRO, load
balancing or the Cortex dialect. Meta keys for those are accepted and ignored.
"""

from __future__ import annotations

import argparse
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response

from verl_arctic import wire
from verl_arctic.routes import ENCODING, GENERATIONS

__all__ = ["create_app", "main"]

JOB_TYPES = ("training", "sampling", "log_prob")


@dataclass
class Job:
    job_id: int
    job_type: str
    model_name: str
    checkpoint_path: str | None
    model: Any
    pool: str = "ready"  # sampling jobs: ready | sleeping | weights_ready
    extra: dict[str, Any] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "job_id": self.job_id,
            "job_type": self.job_type,
            "model_name": self.model_name,
            "status": "RUNNING",
            "checkpoint_path": self.checkpoint_path,
            "sync_path": os.path.join(self.checkpoint_path, "weight_sync.pt") if self.checkpoint_path else None,
        }
        if self.job_type == "log_prob":
            info["engine"] = "deepspeed"
        info.update(self.extra)
        return info


def _optimizer_settings(config: dict[str, Any], generation: str) -> dict[str, Any]:
    """The optimizer and schedule a training job asks for, from either generation's JobConfig."""
    if generation == "v0.1":
        training = config.get("training_config") or {}
        optimizer = training.get("optimizer") or {}
        scheduler = training.get("lr_scheduler") or {}
        return {
            **optimizer,
            "training_horizon": training.get("training_horizon", 1),
            "scheduler": scheduler.get("type", "constant"),
            "warmup_ratio": scheduler.get("warmup_ratio", 0.0),
            "min_lr_ratio": scheduler.get("min_lr_ratio", 0.0),
        }
    ds = config.get("ds_config") or {}
    params = (ds.get("optimizer") or {}).get("params") or {}
    scheduler = ds.get("scheduler") or {}
    sched_params = scheduler.get("params") or {}
    total = sched_params.get("total_num_steps", 1)
    return {
        **params,
        "gradient_clipping": ds.get("gradient_clipping"),
        "training_horizon": total,
        "scheduler": "cosine" if scheduler.get("type") == "WarmupCosineLR" else "constant",
        "warmup_steps": sched_params.get("warmup_num_steps", 0),
        "min_lr_ratio": sched_params.get("cos_min_ratio", 0.0),
    }


def create_app(generation: str) -> Any:
    """The FastAPI app for one protocol generation."""
    import torch
    from fastapi import Body, FastAPI, HTTPException, Query

    from verl_arctic.testing.engine import JobModel

    if generation not in GENERATIONS:
        raise ValueError(f"unknown generation {generation!r}; known: {', '.join(GENERATIONS)}")
    encoding = ENCODING[generation]
    app = FastAPI(title="Arctic RL Local Server")
    jobs: dict[int, Job] = {}
    counter = {"next": 1}
    lock = threading.Lock()  # one model call at a time, as one engine would

    def verify(job_id: int, *types: str) -> Job:
        if job_id not in jobs:
            raise HTTPException(404, f"Job {job_id} not found")
        job = jobs[job_id]
        if types and job.job_type not in types:
            raise HTTPException(400, f"Job {job_id} is not a {', '.join(types)} job")
        return job

    def of_type(job_type: str) -> Job | None:
        return next((j for j in jobs.values() if j.job_type == job_type), None)

    def binary(obj: Any) -> Response:
        return Response(content=wire.encode(encoding, obj), media_type="application/octet-stream")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "OK"}

    @app.get("/status")
    def status() -> dict[str, Any]:
        return {
            "training_gpus": 1,
            "sampling_gpus": 1,
            "log_prob_gpus": 1,
            "jobs": {str(i): j.info() for i, j in jobs.items()},
        }

    @app.get("/job/{job_id}")
    def job_info(job_id: int) -> dict[str, Any]:
        if job_id not in jobs:
            raise HTTPException(404, f"Job {job_id} not found")
        return jobs[job_id].info()

    @app.post("/initialize")
    def initialize(config: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        job_type = str(config.get("job_type", "training"))
        with lock:
            job_id = counter["next"]
            counter["next"] += 1  # advances even when initialisation fails, as Arctic's does
            if job_type not in JOB_TYPES:
                raise HTTPException(400, f"Unknown job type: {job_type}")
            if of_type(job_type) is not None:
                raise HTTPException(409, f"{job_type.replace('_', '-').capitalize()} job already running")
            checkpoint_path = config.get("checkpoint_path")
            if job_type == "training" and not checkpoint_path and generation == "main":
                raise HTTPException(400, "checkpoint_path is required for training jobs")
            if job_type == "training" and checkpoint_path:
                checkpoint_path = os.path.join(str(checkpoint_path), f"arctic_rl_job_{job_id}")
                os.makedirs(checkpoint_path, exist_ok=True)
            optim = _optimizer_settings(config, generation) if job_type == "training" else None
            model = JobModel(str(config["model_name"]), optim=optim, seed=int(config.get("seed") or 42))
            job = Job(job_id, job_type, str(config["model_name"]), checkpoint_path, model)
            if generation == "main" and job_type == "training":
                job.extra = {"cuda_ipc": bool(config.get("cuda_ipc")), "low_memory": bool(config.get("low_memory"))}
            jobs[job_id] = job
        return {"job_id": job_id, "job_type": job_type, "running": True}

    @app.post("/destroy")
    def destroy(job_id: int, job_type: str = Body(..., embed=True)) -> dict[str, Any]:
        with lock:
            if job_id not in jobs:
                raise HTTPException(404, f"Job {job_id} not found")
            del jobs[job_id]
        return {"job_id": job_id}

    def data_call(job: Job, body: bytes, train: bool) -> dict[str, Any]:
        payload = wire.decode(encoding, body)
        batch, meta, processing = payload["batch"], payload["meta"], payload["processing"]  # KeyError -> 500
        if meta.get("logits_optimization") == "memory" and not meta.get("zorro_train_enable"):
            raise ValueError("logits_optimization='memory' requires ZoRRO")  # as Arctic's worker: a bare 500
        with lock:
            if train:
                if processing.get("loss_fn") is None:
                    raise ValueError("forward-backward without a loss function")
                metrics = job.model.forward_backward(batch, meta)
                avg_loss = metrics["loss"]
                return {"job_id": job.job_id, "metrics": metrics, "avg_loss": avg_loss}
            out = job.model.forward(batch, meta)
        result: dict[str, Any] = {"job_id": job.job_id, "batch": out, "metrics": {}}
        if generation == "main":
            result["avg_loss"] = 0.0
        return result

    def forward_route(job_id: int, body: bytes) -> Response:
        job = jobs[job_id]  # Arctic indexes before verifying: an unknown job is a 500, not a 404
        verify(job_id, "training", "log_prob")
        return binary(data_call(job, body, train=False))

    def forward_backward_route(job_id: int, body: bytes) -> Response:
        job = verify(job_id, "training")
        return binary(data_call(job, body, train=True))

    def step(job_id: int) -> dict[str, Any]:
        job = verify(job_id, "training")
        with lock:
            metrics = job.model.step()
        return {"job_id": job_id, "metrics": metrics, "batch": {}}

    def wake(job: Job, tags: list[str] | None) -> dict[str, Any]:
        if job.pool == "ready":
            return {"job_id": job.job_id, "sampling": {"status": "already_ready"}}
        if tags is not None and tags == ["weights"]:
            job.pool = "weights_ready"
        else:
            job.pool = "ready"
        return {"job_id": job.job_id, "sampling": {"status": job.pool, "tags": tags, "workers": []}}

    def sync(training: Job, sampling: Job) -> None:
        if sampling.pool == "sleeping":
            raise RuntimeError("sampling weights are asleep: wake 'weights' before syncing")
        with lock:
            sampling.model.load_weights_from(training.model)

    def generate_results(job: Job, request: dict[str, Any]) -> dict[str, Any]:
        if job.pool != "ready":
            raise RuntimeError("Model is sleeping; call /wake_up first")
        prompts = request["prompts"]
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be strings")
        params = dict(request.get("sampling_params") or {})
        with lock:
            results = [job.model.generate(prompt, params) for prompt in prompts]
        return {"job_id": job.job_id, "results": results}

    @app.post("/sleep-inference")
    def sleep_inference(job_id: int, level: int = Query(... if generation == "v0.1" else 1)) -> dict[str, Any]:
        job = verify(job_id, "sampling")
        if job.pool == "sleeping":
            return {"job_id": job_id, "sampling": {"status": "already_sleeping", "level": level}}
        job.pool = "sleeping"
        return {"job_id": job_id, "sampling": {"status": "sleeping", "level": level, "workers": []}}

    @app.post("/weight-norm")
    def weight_norm(request: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        training = verify(int(request["training_job_id"]), "training")
        sampling = verify(int(request["sampling_job_id"]), "sampling")
        with lock:
            norms = {name: job.model.weight_norm() for name, job in (("training", training), ("sampling", sampling))}
        return {
            "training_norm": norms["training"][0],
            "sampling_norm": norms["sampling"][0],
            "training_num_params": norms["training"][1],
            "sampling_num_params": norms["sampling"][1],
        }

    @app.post("/reset-prefix-cache")
    def reset_prefix_cache(job_id: int) -> dict[str, Any]:
        verify(job_id, "sampling")
        return {"job_id": job_id, "sampling": {"status": "prefix_cache_reset"}}

    if generation == "v0.1":

        @app.post("/wake-inference")
        def wake_inference(job_id: int, tags: list[str] | None = Body(None)) -> dict[str, Any]:  # noqa: B008
            return wake(verify(job_id, "sampling"), tags)

        @app.post("/fwd-bwd")
        def fwd_bwd(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
            return forward_backward_route(job_id, body)

        @app.post("/fwd-no-grad")
        def fwd_no_grad(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
            return forward_route(job_id, body)

        @app.post("/step")
        def step_v01(job_id: int) -> dict[str, Any]:
            return step(job_id)

        @app.post("/save-checkpoint")
        def save_checkpoint(job_id: int) -> dict[str, Any]:
            job = verify(job_id, "training")
            assert job.checkpoint_path is not None
            with lock:
                job.model.save(job.checkpoint_path)
            return {"job_id": job_id, "path": job.checkpoint_path}

        @app.post("/sync-weights")
        def sync_weights(request: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
            training = verify(int(request["training_job_id"]), "training")
            sampling = verify(int(request["sampling_job_id"]), "sampling")
            sync(training, sampling)
            return {"job_id": training.job_id, "status": "ok"}

        @app.post("/generate")
        def generate_v01(job_id: int, request: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
            return generate_results(verify(job_id, "sampling"), request)

    else:

        @app.post("/wake-inference")
        async def wake_inference_main(job_id: int, request: Request) -> dict[str, Any]:
            raw = await request.body()
            tags = None
            if raw:
                parsed = (await request.json()) if raw.strip() else None
                tags = parsed.get("tags") if isinstance(parsed, dict) else parsed
            return wake(verify(job_id, "sampling"), tags)

        @app.post("/forward-backward")
        def forward_backward(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
            return forward_backward_route(job_id, body)

        @app.post("/forward")
        def forward(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
            return forward_route(job_id, body)

        @app.post("/step")
        def step_main(job_id: int, request: dict[str, Any] | None = Body(None)) -> dict[str, Any]:  # noqa: B008
            return step(job_id)

        @app.post("/save")
        def save(job_id: int, request: dict[str, Any] | None = Body(None)) -> dict[str, Any]:  # noqa: B008
            job = verify(job_id, "training")
            request = request or {}
            root = request.get("path") or job.checkpoint_path
            assert root is not None
            step_number = request.get("step")
            directory = os.path.join(root, f"checkpoint-{step_number}") if step_number is not None else root
            with lock:
                job.model.save(directory)
            if step_number is not None:
                with open(os.path.join(root, "latest"), "w") as fp:
                    fp.write(str(step_number))
            return {"job_id": job_id, "path": directory, "hf_path": None, "global_step": job.model.steps}

        @app.post("/load-checkpoint")
        def load_checkpoint(job_id: int, request: dict[str, Any] | None = Body(None)) -> dict[str, Any]:  # noqa: B008
            job = verify(job_id, "training")
            request = request or {}
            root = request.get("path") or job.checkpoint_path
            assert root is not None
            step_number = request.get("step")
            if step_number is None and os.path.isfile(os.path.join(root, "latest")):
                with open(os.path.join(root, "latest")) as fp:
                    step_number = int(fp.read().strip())
            directory = os.path.join(root, f"checkpoint-{step_number}") if step_number is not None else root
            if not os.path.isfile(os.path.join(directory, "state.pt")):
                return {"job_id": job_id, "path": directory, "global_step": 0}
            with lock:
                job.model.load(directory)
            return {"job_id": job_id, "path": directory, "global_step": job.model.steps}

        @app.post("/weight-sync")
        def weight_sync(job_id: int, request: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
            training = verify(int(request["source_sub_job_id"]), "training")
            sampling = verify(int(request["target_sub_job_ids"][0]), "sampling")
            sync(training, sampling)
            return {"job_id": training.job_id, "status": "ok"}

        @app.post("/generate")
        def generate_main(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
            job = verify(job_id, "sampling")
            return binary(generate_results(job, wire.decode(encoding, body)))

    del torch  # imported to fail fast when torch is missing; the engine uses it
    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=7000)
    parser.add_argument("--api", choices=GENERATIONS, default="main", help="protocol generation to serve")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.api), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
