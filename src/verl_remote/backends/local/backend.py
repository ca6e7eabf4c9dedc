"""``LocalBackend``: the RemoteBackend contract over one Ray actor running :class:`LocalEngine`.

Neither this module nor the actor's class (:mod:`~verl_remote.backends.local.actor`) imports the engine's module
(torch): the rollout server's process holds a ``LocalBackend`` too, and needs no torch to send it requests. The
engine's module is imported where a checkpoint is exported and in the engine's own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import ray
from omegaconf import OmegaConf

from verl_remote import Packed, RayService, RemoteBackend, SamplingParams, overlapped, resources
from verl_remote.backends.local.actor import LocalEngineActor
from verl_remote.backends.local.requests import GenerateResult, SampleRequest
from verl_remote.backends.local.vllm_sampler import resolve_sampler, vllm_model_problem

__all__ = ["LocalBackend"]

# Where, inside verl's global_step_N/actor folder, the engine's state goes.
CHECKPOINT_SUBDIR = "local_engine"

# remote_backend.max_batch where a group file (a subclass's, say) does not set it: local.yaml's value.
MAX_BATCH = 64

# How long destroy waits for the engine to stop what it started (vLLM's processes) before killing it.
CLOSE_TIMEOUT_S = 30.0


class Batches:
    """Sampling requests to the engine, batched: what arrives while the engine samples goes with the next batch
    (at most ``max_batch`` requests each), so that a step's responses take a forward per token, not one per token
    and request. One event loop (the rollout server's) submits."""

    def __init__(self, engine: Any, max_batch: int) -> None:
        self.engine, self.max_batch = engine, max(1, max_batch)
        self.pending: list[tuple[SampleRequest, asyncio.Future[GenerateResult]]] = []
        self.draining: asyncio.Task[None] | None = None

    async def submit(self, request: SampleRequest) -> GenerateResult:
        future: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        self.pending.append((request, future))
        if self.draining is None or self.draining.done():
            self.draining = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0.002)  # the requests a step sends together arrive within a few milliseconds
        while self.pending:
            batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch :]
            try:
                results = await self.engine.generate_batch.remote([request for request, _ in batch])
            except Exception as exc:  # every request of the batch fails with the engine's error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)


class LocalBackend(RemoteBackend):
    """Every process holds a handle to the same named engine actor (a :class:`RayService`)."""

    def __init__(self, service: RayService, max_batch: int) -> None:
        self.service = service
        self.engine = service.actor()
        self.batches = Batches(self.engine, max_batch)

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> LocalBackend:
        settings = OmegaConf.to_container(main_config.remote_backend, resolve=True)
        assert isinstance(settings, dict)
        max_batch = int(settings.get("max_batch", MAX_BATCH))
        if handle is not None:
            return cls(RayService.from_handle(handle), max_batch)
        device = str(settings.get("device", "auto"))
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
        settings["device"] = device
        settings["overlap"] = overlapped(main_config)
        settings["sampler"], line = resolve_sampler(str(settings.get("sampler", "hf")))
        print(f"verl-remote: {line}", flush=True)
        if settings["sampler"] == "vllm":
            # vLLM's KV cache holds sequences up to the run's longest: verl's prompt plus response length.
            rollout, data = main_config.actor_rollout_ref.rollout, main_config.data
            settings["max_model_len"] = int(
                rollout.get("max_model_len") or int(data.max_prompt_length) + int(data.max_response_length)
            )
        actor_config = OmegaConf.to_container(main_config.actor_rollout_ref.actor, resolve=True)
        service = RayService.start(
            LocalEngineActor,
            str(main_config.actor_rollout_ref.model.path),
            actor_config,
            settings,
            prefix="verl_remote_local_engine",
            num_cpus=resources(settings)["num_cpus"],
            num_gpus=1 if device.startswith("cuda") else 0,
        )
        return cls(service, max_batch)

    @classmethod
    def export(cls, main_config: Any, step: int, path: str, out: str, *, adapter: bool = False) -> None:
        """The engine's saved weights with the run's model's config and tokenizer; no engine is started."""
        if adapter:
            raise ValueError(
                "the local backend trains every weight of the model (no LoRA): there is no adapter to export; "
                "leave out --adapter"
            )
        from verl_remote.backends.local.engine import export_checkpoint

        model = main_config.actor_rollout_ref.model
        export_checkpoint(
            str(model.path),
            str(model.get("tokenizer_path") or model.path),
            str(main_config.remote_backend.get("dtype", "float32")),
            os.path.join(path, CHECKPOINT_SUBDIR),
            out,
        )

    @classmethod
    def preflight(cls, main_config: Any) -> None:
        """remote_backend.device: CUDA on this machine where the run's Ray is its own and asks for it (a cluster's
        GPUs are its nodes': the engine's start refuses a cluster without one); remote_backend.sampler: a known
        value, and for vLLM, an install that loads and a model it can run."""
        device = str(main_config.remote_backend.get("device", "auto"))
        address = OmegaConf.select(main_config, "ray_kwargs.ray_init.address", default=None)
        own_ray = (address or os.environ.get("RAY_ADDRESS") or "local") == "local"
        if device.startswith("cuda") and own_ray:
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    f"remote_backend.device={device}: this machine has no CUDA device torch can use "
                    f"(torch {torch.__version__}, torch.cuda.is_available() is false); set remote_backend.device=cpu, "
                    "or auto (cuda where the run's Ray has a GPU)"
                )
        setting = str(main_config.remote_backend.get("sampler", "hf"))
        if resolve_sampler(setting)[0] == "vllm":
            problem = vllm_model_problem(str(main_config.actor_rollout_ref.model.path), device)
            if problem is not None:
                raise ValueError(f"remote_backend.sampler={setting}: {problem}")

    def reconnect_handle(self) -> dict[str, Any]:
        return self.service.handle()

    @classmethod
    def requires_single_forwarder(cls) -> bool:
        # One engine owns one optimizer: several forwarders would step it once each per mini-batch.
        return True

    # -- lifecycle ----------------------------------------------------------------------------

    async def update_weights(self) -> None:
        await self.service.call_async("update_weights")

    async def save_checkpoint(self, step: int, path: str) -> None:
        await self.service.call_async("save", os.path.join(path, CHECKPOINT_SUBDIR))

    async def load_checkpoint(self, step: int, path: str) -> None:
        await self.service.call_async("load", os.path.join(path, CHECKPOINT_SUBDIR))

    async def destroy(self) -> None:
        # vLLM's engine processes end with a word from the actor; a dead actor took them with it.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.engine.close.remote(), timeout=CLOSE_TIMEOUT_S)
        self.service.stop()

    async def left_on_service(self) -> list[str]:
        """The engine actor, while Ray still has it."""
        try:
            ray.get_actor(self.service.name, namespace=self.service.namespace)
        except ValueError:
            return []
        return [f"the engine actor {self.service.name} (Ray namespace {self.service.namespace})"]

    # -- compute, used by this backend's worker and replica -------------------------------------

    def compute_log_prob(
        self, input_ids: Packed, *, temperature: float, calculate_entropy: bool, reference: bool
    ) -> dict[str, Any]:
        return dict(self.service.call("compute_log_prob", input_ids, temperature, calculate_entropy, reference))

    def forward_backward(self, batch: dict[str, Packed], meta: dict[str, Any]) -> dict[str, float]:
        return dict(self.service.call("forward_backward", batch, meta))

    def optimizer_step(self) -> dict[str, float]:
        return dict(self.service.call("optimizer_step"))

    def lr_scheduler_step(self) -> float:
        return float(self.service.call("lr_scheduler_step"))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateResult:
        return await self.batches.submit(SampleRequest(prompt_ids, params))

    def device_name(self) -> str:
        return str(self.service.call("device_name"))

    def weights_checksum(self) -> str:
        return str(self.service.call("weights_checksum"))
