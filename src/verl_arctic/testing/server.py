"""A protocol-faithful Arctic RL server for tests and demos, backed by small CPU models.

    python -m verl_arctic.testing.server --port 7000 --api main     # or --api v0.1

Our model of Arctic's on-prem HTTP server: arctic-platform 0.1.2
``rl/http_server.py`` for generation v0.1 and 0.1.4 ``common/http_server.py``
for main. Every route of the real server exists here with the same method,
parameters, request models (so the same 422s), status codes, error texts,
answer shapes and containers; the table in docs/arctic-protocol.md §8 maps
each route to the lines of Arctic's code it follows and to the test that
compares it with Arctic's own server (tests/arctic/test_real_server.py).

The routes parse requests and shape answers; what each operation does to the server's jobs is
:mod:`verl_arctic.testing.state`. The engines behind the jobs are :mod:`verl_arctic.testing.engine`: one CPU
model per job standing for ``--training-gpus`` data-parallel DeepSpeed ranks
with their gradient-accumulation micro-batches, and a sampler in
arctic-inference's result shape. Batches are split across ranks and answers
merged as Arctic does (:mod:`verl_arctic.testing.batching`), so a v0.1 forward
on several ranks answers with the ``collections.defaultdict`` Arctic's merge
builds. Weight syncs copy the training job's weights into the sampling job.

It binds 127.0.0.1 only. What it is not: DeepSpeed, vLLM, GPUs, ZoRRO, the load
balancer's reordering, CUDA IPC, the Cortex dialect.
"""

from __future__ import annotations

import argparse
from typing import Any

from fastapi import APIRouter, Body, FastAPI, Response

from verl_arctic import wire
from verl_arctic.routes import GENERATIONS
from verl_arctic.testing.models import (
    GenerateRequest,
    GenerateRequestMain,
    JobConfig,
    JobConfigMain,
    LoadCheckpointRequest,
    LogProbsRequest,
    OperationRequest,
    ResetPrefixCacheRequest,
    SaveRequest,
    StepRequest,
    SyncWeightsRequest,
    WeightNormRequest,
    WeightSyncRequest,
)
from verl_arctic.testing.state import Pool, State

__all__ = ["create_app", "main"]


# -- the routes ------------------------------------------------------------------------------------
#
# One router per protocol generation, and one for the routes both declare alike, mirroring the table in
# verl_arctic/routes.py. The endpoints keep the names, parameter declarations and docstrings they have always
# had: FastAPI serves all three in /openapi.json (operation ids, body schema names, descriptions), and the
# declarations decide what is a query parameter, what a body, and which requests are answered with a 422.


def _routes_common(state: State) -> APIRouter:
    """The routes both generations declare alike (``/initialize`` with each generation's job model)."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "OK"}

    @router.get("/status")
    async def status() -> dict[str, Any]:
        return state.status()

    @router.get("/job/{job_id}")
    async def job_info(job_id: int) -> dict[str, Any]:
        return state.job_info(job_id)

    if state.main_generation:

        @router.post("/initialize")
        def initialize_main(job_config: JobConfigMain = Body(...)) -> dict[str, Any]:  # noqa: B008
            return state.initialize(job_config)

    else:

        @router.post("/initialize")
        def initialize_v01(job_config: JobConfig = Body(...)) -> dict[str, Any]:  # noqa: B008
            return state.initialize(job_config)

    @router.post("/destroy")
    def destroy(job_id: int, job_type: str = Body(..., embed=True)) -> dict[str, Any]:
        return state.destroy(job_id)

    @router.post("/empty-training-cache")
    def empty_training_cache(job_id: int) -> dict[str, Any]:
        return state.empty_training_cache(job_id)

    @router.post("/sleep-log-prob")
    def sleep_log_prob(job_id: int) -> dict[str, Any]:
        return state.log_prob_offload(job_id, to_gpu=False)

    @router.post("/wake-log-prob")
    def wake_log_prob(job_id: int) -> dict[str, Any]:
        return state.log_prob_offload(job_id, to_gpu=True)

    @router.post("/weight-norm")
    def weight_norm(request: WeightNormRequest = Body(...)) -> dict[str, Any]:  # noqa: B008
        return state.weight_norm(request)

    return router


def _routes_v01(state: State) -> APIRouter:
    """Generation v0.1 (arctic-platform 0.1.2 rl/http_server.py): parameters in the query, JSON bodies."""
    router = APIRouter()

    @router.post("/fwd-bwd")
    def fwd_bwd(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
        return state.forward_backward(job_id, body)

    @router.post("/fwd-no-grad")
    def fwd_no_grad(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
        return state.forward(job_id, body)

    @router.post("/step")
    def step_v01(job_id: int) -> dict[str, Any]:
        return state.step(job_id)

    @router.post("/save-checkpoint")
    def save_checkpoint(job_id: int) -> dict[str, Any]:
        return state.save_checkpoint(job_id)

    @router.post("/sleep-inference")
    def sleep_inference_v01(job_id: int, level: int) -> dict[str, Any]:
        return state.sleep_inference(job_id, level)

    @router.post("/wake-inference")
    def wake_inference_v01(job_id: int, tags: list[str] | None = None) -> dict[str, Any]:
        return state.wake_inference(job_id, tags)

    @router.post("/reset-prefix-cache")
    def reset_prefix_cache_v01(job_id: int) -> dict[str, Any]:
        return state.reset_prefix_cache(job_id)

    @router.post("/sleep-training")
    def sleep_training_v01(job_id: int, mode: str = "all") -> dict[str, Any]:
        return state.sleep_training(job_id, mode)

    @router.post("/wake-training")
    def wake_training_v01(job_id: int) -> dict[str, Any]:
        return state.wake_training(job_id)

    @router.post("/generate")
    def generate_v01(job_id: int, request: GenerateRequest = Body(...)) -> dict[str, Any]:  # noqa: B008
        return state.generate(job_id, request.prompts, request.sampling_params)

    @router.post("/sync-weights")
    def sync_weights(request: SyncWeightsRequest = Body(...)) -> dict[str, Any]:  # noqa: B008
        return state.sync(request.training_job_id, request.sampling_job_id)

    @router.post("/log-probs")
    def log_probs_v01(job_id: int, request: LogProbsRequest = Body(...)) -> Response:  # noqa: B008
        return state.log_probs(job_id, request)

    return router


def _routes_main(state: State) -> APIRouter:
    """Generation main (arctic-platform 0.1.4 common/http_server.py): optional JSON bodies beside the query,
    DSSST1 generation, checkpoints by step, /operation."""
    router = APIRouter()

    @router.post("/forward-backward")
    def forward_backward_main(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
        return state.forward_backward(job_id, body)

    @router.post("/forward")
    def forward_main(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
        return state.forward(job_id, body)

    @router.post("/step")
    def step_main(job_id: int, request: StepRequest = Body(default=StepRequest())) -> dict[str, Any]:  # noqa: B008
        return state.step(job_id)  # learning_rate is accepted and not applied, as on Arctic

    @router.post("/save")
    def save(job_id: int, request: SaveRequest = Body(default=SaveRequest())) -> dict[str, Any]:  # noqa: B008
        """0.1.4 common/http_server.py:496-522."""
        return state.save(job_id, request)

    @router.post("/load-checkpoint")
    def load_checkpoint(
        job_id: int,
        request: LoadCheckpointRequest = Body(default=LoadCheckpointRequest()),  # noqa: B008
    ) -> dict[str, Any]:
        """0.1.4 common/http_server.py:525-545: a missing checkpoint loads nothing and answers step 0."""
        return state.load_checkpoint(job_id, request)

    @router.post("/sleep-inference")
    def sleep_inference_main(
        job_id: int,
        level: int = 1,
        body: dict[str, Any] | None = Body(None),  # noqa: B008
    ) -> dict[str, Any]:
        if isinstance(body, dict) and body.get("level") is not None:
            level = int(body["level"])
        return state.sleep_inference(job_id, level)

    @router.post("/wake-inference")
    def wake_inference_main(job_id: int, body: Any = Body(None)) -> dict[str, Any]:  # noqa: B008
        tags = body.get("tags") if isinstance(body, dict) else body
        return state.wake_inference(job_id, tags)

    @router.post("/reset-prefix-cache")
    def reset_prefix_cache_main(
        job_id: int,
        request: ResetPrefixCacheRequest = Body(default=ResetPrefixCacheRequest()),  # noqa: B008
    ) -> dict[str, Any]:
        return state.reset_prefix_cache(job_id)

    @router.post("/sleep-training")
    def sleep_training_main(
        job_id: int,
        mode: str = "all",
        body: dict[str, Any] | None = Body(None),  # noqa: B008
    ) -> dict[str, Any]:
        if isinstance(body, dict) and body.get("mode") is not None:
            mode = str(body["mode"])
        return state.sleep_training(job_id, mode)

    @router.post("/wake-training")
    def wake_training_main(job_id: int, body: dict[str, Any] | None = Body(None)) -> dict[str, Any]:  # noqa: B008
        return state.wake_training(job_id)

    @router.post("/generate")
    def generate_main(job_id: int, body: bytes = Body(..., media_type="application/octet-stream")) -> Response:
        state.verify(job_id, "sampling")
        request = GenerateRequestMain(**wire.decode(state.encoding, body))  # outside FastAPI's validation: a 500
        return state.binary(state.generate(job_id, request.prompts, request.sampling_params))

    @router.post("/weight-sync")
    def weight_sync(job_id: int, request: WeightSyncRequest = Body(...)) -> dict[str, Any]:  # noqa: B008
        return state.weight_sync(request)

    @router.post("/operation")
    def operation(job_id: int, request: OperationRequest = Body(...)) -> dict[str, Any]:  # noqa: B008
        """0.1.4 common/http_server.py:608-624: models built from ``payload`` fail as 500s, not 422s."""
        return state.operation(job_id, request)

    @router.post("/log-probs")
    def log_probs_main(job_id: int, request: LogProbsRequest = Body(...)) -> Response:  # noqa: B008
        return state.log_probs(job_id, request)

    return router


def create_app(
    generation: str,
    *,
    training_gpus: int = 1,
    sampling_gpus: int = 1,
    log_prob_gpus: int = 1,
    log_prob_engine: str = "vllm",
    colocate: bool = False,
    sampled_logprobs: bool = True,
) -> FastAPI:
    """The FastAPI app of one protocol generation, as launched with Arctic's CLI flags of the same names.

    ``sampled_logprobs=False`` is not Arctic's: it answers /generate without ``logprobs`` even when they are
    asked for, as a sampler that cannot return them would, to test clients against such a service.
    """
    if generation not in GENERATIONS:
        raise ValueError(f"unknown generation {generation!r}; known: {', '.join(GENERATIONS)}")
    if training_gpus + sampling_gpus + log_prob_gpus == 0:
        raise ValueError("At least one of --training-gpus, --sampling-gpus, --log-prob-gpus must be > 0")
    state = State(generation, training_gpus, sampling_gpus, log_prob_gpus, log_prob_engine, colocate, sampled_logprobs)
    if log_prob_engine == "vllm":
        state.log_prob_pool = Pool()
    app = FastAPI(title="Arctic RL Local Server")
    app.state.arctic = state
    app.include_router(_routes_common(state))
    app.include_router(_routes_main(state) if state.main_generation else _routes_v01(state))
    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=7000)
    parser.add_argument("--api", choices=GENERATIONS, default="main", help="protocol generation to serve")
    parser.add_argument("--training-gpus", type=int, default=1, help="data-parallel training ranks to stand for")
    parser.add_argument("--sampling-gpus", type=int, default=1)
    parser.add_argument("--log-prob-gpus", type=int, default=1)
    parser.add_argument("--log-prob-engine", choices=["vllm", "deepspeed"], default="vllm")
    parser.add_argument("--colocate", action="store_true")
    parser.add_argument(
        "--without-sampled-logprobs",
        action="store_true",
        help="not Arctic's: answer /generate without log-probs, as a sampler that cannot return them",
    )
    args = parser.parse_args(argv)
    app = create_app(
        args.api,
        training_gpus=args.training_gpus,
        sampling_gpus=args.sampling_gpus,
        log_prob_gpus=args.log_prob_gpus,
        log_prob_engine=args.log_prob_engine,
        colocate=args.colocate,
        sampled_logprobs=not args.without_sampled_logprobs,
    )
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
