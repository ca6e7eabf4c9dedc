"""``ArcticBackend``: the RemoteBackend contract over Arctic's RL service.

On the driver, :meth:`ArcticBackend.from_config` creates the service's jobs in
Arctic's order (sampling, then the reference ``log_prob`` job when verl needs
reference log-probs, then training) from ``remote_backend.*`` and verl's model
and optimizer settings, and waits until each is ``RUNNING``. Its reconnect
handle is the server URL, the protocol generation and the job ids, so that
forwarders and rollout servers attach without creating anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import tempfile
import uuid
import warnings
from typing import Any

from omegaconf import OmegaConf

from verl_arctic.client import ArcticClient, ArcticError, probe_generation, probe_health
from verl_arctic.export import export_step
from verl_arctic.jobs import create_job, job_configs
from verl_arctic.launch import launch_argv, launch_server, require_free_port, stop_server
from verl_arctic.record import JOBS_FILE, POINTER_FILE, RUN_DIR_PREFIX, clean_up_after_a_dead_run
from verl_arctic.settings import ArcticSettings, check_server_size
from verl_remote import RemoteBackend, as_dict, resumes_from_checkpoint, token_in_clear

__all__ = ["ArcticBackend"]

log = logging.getLogger(__name__)


class ArcticBackend(RemoteBackend):
    """Jobs on one Arctic server; every process holds its own HTTP client to it."""

    def __init__(
        self,
        client: ArcticClient,
        jobs: dict[str, int],
        settings: dict[str, Any],
        server: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.client = client
        self.jobs = jobs
        self.settings = settings
        self.server = server  # the service process this backend launched, if it launched one
        self.record: str | None = None  # where the driver keeps the ids of the jobs it created
        self.checkpoint_path: str | None = None  # the training job's, as sent: unique to this run
        self.model_name: str | None = None
        self._destroyed = False

    def write_record(self) -> None:
        """The jobs this run created, kept in its checkpoint folder until they are destroyed, so that a run
        killed before it could destroy them (SIGKILL, a lost node) is cleaned up by the next one there; with
        what proves they are this run's (the training job's checkpoint path and the model sent)."""
        if self.record is None:
            return
        os.makedirs(os.path.dirname(self.record), exist_ok=True)
        body = {
            "url": self.client.url,
            "generation": self.client.generation,
            "jobs": self.jobs,
            "checkpoint_path": self.checkpoint_path,
            "model_name": self.model_name,
            "pid": os.getpid(),
        }
        # A new temporary file (mkstemp: private, and not a link someone planted at a fixed name), then renamed.
        handle, temporary = tempfile.mkstemp(
            prefix=f".{os.path.basename(self.record)}.", dir=os.path.dirname(self.record)
        )
        try:
            with os.fdopen(handle, "w") as fp:
                json.dump(body, fp)
            os.replace(temporary, self.record)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> ArcticBackend:
        settings = as_dict(main_config.remote_backend)
        if handle is not None:  # a forwarder or a rollout server, attaching (its config has no actor section)
            return cls(ArcticSettings.of(main_config).client(str(handle["generation"])), dict(handle["jobs"]), settings)
        arctic = ArcticSettings.of(main_config)
        server = None
        if arctic.launch:
            server = launch_server(arctic.launch, arctic.url, arctic.startup_timeout, arctic.launch_env)
        try:
            client = arctic.client(arctic.api)
        except BaseException:
            if server is not None:
                stop_server(server)
            raise
        backend = cls(client, {}, settings, server)
        backend.record = os.path.join(str(main_config.trainer.default_local_dir), JOBS_FILE)
        timeout = arctic.job_ready_timeout
        try:
            clean_up_after_a_dead_run(client, backend.record)
            check_server_size(client, settings)
            bodies = job_configs(main_config, client.generation)
            training = bodies["training"]
            training["checkpoint_path"] = os.path.join(training["checkpoint_path"], RUN_DIR_PREFIX + uuid.uuid4().hex)
            backend.checkpoint_path = training["checkpoint_path"]
            backend.model_name = str(training["model_name"])
            for job_type, body in bodies.items():
                if job_type == "sampling" and int(settings.get("sampling_gpus", 1)) <= 0:
                    continue
                job_id = create_job(client, job_type, body)
                backend.jobs[job_type] = job_id
                backend.write_record()
                client.wait_running(job_id, timeout)
                log.info(
                    "verl-arctic: %s job %d is RUNNING on %s (%s)", job_type, job_id, client.url, client.generation
                )
            if "training" not in backend.jobs or "sampling" not in backend.jobs:
                raise ValueError(
                    "verl-arctic needs a training and a sampling job: set training_gpus and sampling_gpus > 0"
                )
        except BaseException:
            asyncio.run(backend.destroy())
            raise
        return backend

    @classmethod
    def probe_service(cls, main_config: Any) -> None:
        """The server answers its health route (one that ``comms.launch`` starts is not there yet)."""
        arctic = ArcticSettings.of(main_config)
        if arctic.launch:
            return
        try:
            probe_health(arctic.url, timeout=arctic.connect_timeout, headers=arctic.headers)
        except ArcticError as exc:
            raise ValueError(str(exc)) from exc

    @classmethod
    def preflight(cls, main_config: Any) -> None:
        """The rollout at temperature 1; the service reachable and Arctic's, its protocol and GPUs as configured,
        the job configs valid."""
        temperature = float(OmegaConf.select(main_config, "actor_rollout_ref.rollout.temperature", default=1.0))
        if temperature != 1.0:
            # verl_arctic/testing/engine.py, generate: vLLM reports the unprocessed distribution's log-prob.
            raise ValueError(
                f"actor_rollout_ref.rollout.temperature={temperature}: Arctic's sampler (vLLM) reports each token's "
                "log-prob under the untempered distribution, and verl scores the old log-probs at the rollout's "
                "temperature, so the two would disagree; set actor_rollout_ref.rollout.temperature=1.0 (validation "
                "may still sample greedily)"
            )
        arctic = ArcticSettings.of(main_config)
        if arctic.token and token_in_clear(arctic.url):
            warnings.warn(
                f"remote_backend.comms.url={arctic.url}: the token goes over plain http to a host that is not this "
                "machine; use https:// (or a tunnel) where the network is not yours",
                UserWarning,
                stacklevel=2,
            )
        if arctic.launch:
            launch_argv(arctic.launch)
            require_free_port(arctic.url)
            job_configs(main_config, arctic.api if arctic.api != "auto" else "main")
            return
        try:
            probe_health(arctic.url, timeout=arctic.connect_timeout, headers=arctic.headers)
            generation = probe_generation(arctic.url, timeout=arctic.connect_timeout, headers=arctic.headers)
        except ArcticError as exc:
            raise ValueError(str(exc)) from exc
        if arctic.api not in ("auto", generation):
            raise ValueError(
                f"remote_backend.comms.api={arctic.api}, but the Arctic server at {arctic.url} speaks protocol "
                f"{generation}; set remote_backend.comms.api={generation} (or auto)"
            )
        if generation != "main" and resumes_from_checkpoint(main_config):
            raise ValueError(
                f"Arctic protocol {generation} at {arctic.url} has no load-checkpoint call, so a run cannot resume on "
                f"it (trainer.default_local_dir={main_config.trainer.default_local_dir} holds a checkpoint); resume "
                "against a server that speaks the main protocol, or set trainer.resume_mode=disable to start over"
            )
        client = arctic.client(generation, retries=0)
        try:
            check_server_size(client, as_dict(main_config.remote_backend))
        except ArcticError as exc:
            raise ValueError(str(exc)) from exc
        finally:
            client.close()
        job_configs(main_config, generation)

    @classmethod
    def export(cls, main_config: Any, step: int, path: str, out: str, *, adapter: bool = False) -> None:
        """The step's weights as Arctic's main protocol exports them (``/save`` with ``export_hf``) from a training
        job with the step loaded, and the run's tokenizer (:mod:`verl_arctic.export`)."""
        if adapter:
            raise ValueError(
                "verl-arctic trains every weight of the model (Arctic's jobs have no LoRA): there is no adapter to "
                "export; leave out --adapter"
            )
        export_step(main_config, step, path, out)

    def reconnect_handle(self) -> dict[str, Any]:
        return {"url": self.client.url, "generation": self.client.generation, "jobs": dict(self.jobs)}

    @classmethod
    def requires_single_forwarder(cls) -> bool:
        # Arctic runs its own data parallelism: one caller per mini-batch, one optimizer step each.
        return True

    #: Overlapped runs (separate engines) may sync beside the next step, where the run asks
    #: (trainer.v1.remote_async.background_weight_sync=true): Arctic's weight sync reads the training
    #: job's weights, and calls to the training job queue behind it on its workers (plain Ray actors, one call at
    #: a time: arctic-platform 0.1.4 common/deepspeed_worker.py:110-111).
    background_weight_sync = True

    #: The command that starts the service: never run from a run's record (``verl-remote export``), only when named.
    program_settings = ("comms.launch",)

    @classmethod
    def cannot_overlap(cls, main_config: Any) -> str | None:
        # Colocated engines take turns on the GPUs: the sampler sleeps while the trainer runs (ArcticRolloutServer).
        if bool(main_config.remote_backend.get("colocate", True)):
            return (
                "remote_backend.colocate=true: its sampling and training engines share their GPUs and take turns; "
                "launch the server with separate GPUs per engine and set remote_backend.colocate=false"
            )
        return None

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def colocated(self) -> bool:
        """Whether the sampling and training engines share GPUs (remote_backend.colocate): the sampler then sleeps
        between rollouts and wakes for each weight sync; separate engines stay awake."""
        return bool(self.settings.get("colocate", True))

    def _sync_weights(self) -> None:
        sampling, training = self.jobs["sampling"], self.jobs["training"]
        sync = self.settings["weight_sync"]
        if self.colocated:
            self.client.wake_inference(sampling, ["weights"])
        self.client.weight_sync(
            training,
            sampling,
            colocate=self.colocated,
            cuda_ipc=bool(sync["cuda_ipc"]),
            low_memory=bool(sync["low_memory"]),
        )
        if self.colocated:
            self.client.wake_inference(sampling, ["kv_cache"])

    async def update_weights(self) -> None:
        """Arctic's weight sync (with the sampler woken around it where the engines share GPUs). The sampler's
        prefix cache, of the old weights, is reset by the rollout server as the run publishes the new version
        (:meth:`reset_prefix_cache`): a training call need not wait for that second request, only the next
        samples do (Arctic's own client sends both, arctic-platform 0.1.4 rl/http_client.py:626-680, as its
        /weight-sync leaves the cache as it is: common/http_server.py:730-776)."""
        await asyncio.to_thread(self._sync_weights)

    async def reset_prefix_cache(self) -> None:
        """Drop what the sampling engines cached of earlier weights (Arctic's /reset-prefix-cache)."""
        await asyncio.to_thread(self.client.reset_prefix_cache, self.jobs["sampling"])

    async def save_checkpoint(self, step: int, path: str) -> None:
        if self.client.generation == "main":
            saved = await asyncio.to_thread(self.client.save, self.jobs["training"], os.path.join(path, "arctic"), step)
        else:  # v0.1 saves where the server decides; remember where
            saved = await asyncio.to_thread(self.client.save, self.jobs["training"], path, step)
        with open(os.path.join(path, POINTER_FILE), "w") as fp:
            json.dump({"step": step, "server": self.client.url, "generation": self.client.generation, **saved}, fp)

    async def load_checkpoint(self, step: int, path: str) -> None:
        if self.client.generation != "main":
            raise ArcticError(
                f"Arctic protocol v0.1 at {self.client.url} has no load-checkpoint call, so a run cannot resume on it; "
                "resume against a server that speaks the main protocol (remote_backend.comms.api=main)"
            )
        loaded = await asyncio.to_thread(
            self.client.load_checkpoint, self.jobs["training"], os.path.join(path, "arctic"), step
        )
        if int(loaded.get("global_step", 0)) == 0:
            raise ArcticError(f"Arctic server {self.client.url} found no checkpoint for step {step} under {path}")

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        left = []
        for job_type in ("training", "log_prob", "sampling"):
            job_id = self.jobs.get(job_type)
            if job_id is None:
                continue
            try:
                await asyncio.to_thread(self.client.destroy, job_id, job_type)
            except ArcticError as exc:  # keep going: the other jobs still hold GPUs
                if exc.status == 404:
                    continue  # gone already (the server restarted)
                left.append(job_type)
                log.warning("verl-arctic: could not destroy %s job %d: %s", job_type, job_id, exc)
        if self.record is not None and os.path.exists(self.record):
            if left:  # the next run in this folder destroys them once the server answers again
                log.warning(
                    "verl-arctic: the %s job(s) stay recorded in %s; the next run in this folder destroys them",
                    " and ".join(left),
                    self.record,
                )
            else:
                os.unlink(self.record)
        self.client.close()
        if self.server is not None:
            await asyncio.to_thread(stop_server, self.server)

    async def left_on_service(self) -> list[str]:
        """The jobs this backend created that the server still has (its ``GET /job/{id}`` answers, a job it no
        longer has answers 404); none once the server this backend launched is stopped, which took them along."""
        if self._destroyed and self.server is not None:
            return []
        return await asyncio.to_thread(self._jobs_on_server)

    def _jobs_on_server(self) -> list[str]:
        arctic = ArcticSettings.of(OmegaConf.create({"remote_backend": self.settings}))
        client = arctic.client(self.client.generation, retries=0)  # this backend's own is closed by destroy
        left = []
        try:
            for job_type, job_id in self.jobs.items():
                try:
                    status = client.job(job_id).get("status")
                except ArcticError as exc:
                    if exc.status == 404:
                        continue
                    raise
                left.append(f"{job_type} job {job_id} ({status}) on {client.url}")
        finally:
            client.close()
        return left

    # -- compute, used by this backend's worker and rollout server ---------------------------------

    def forward(self, payload: dict[str, Any], *, reference: bool) -> dict[str, Any]:
        if reference and "log_prob" not in self.jobs:
            raise ValueError(
                "reference log-probs were asked for, but this run made no reference job: verl-arctic makes one "
                "when a KL term is on (actor_rollout_ref.actor.use_kl_loss or algorithm.use_kl_in_reward)"
            )
        job = self.jobs["log_prob"] if reference else self.jobs["training"]
        return self.client.forward(job, payload)

    def forward_backward(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self.client.forward_backward(self.jobs["training"], payload)

    def step(self) -> dict[str, Any]:
        return self.client.step(self.jobs["training"])

    async def generate(self, prompt: str, sampling_params: dict[str, Any]) -> dict[str, Any]:
        result = await self.client.agenerate(self.jobs["sampling"], [prompt], sampling_params)
        return dict(result["results"][0])

    async def sleep_sampling(self) -> None:
        await asyncio.to_thread(self.client.sleep_inference, self.jobs["sampling"], 1)
