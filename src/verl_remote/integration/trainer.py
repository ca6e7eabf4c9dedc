"""verl's sync PPO trainer, with CPU-only forwarder workers in front of a remote backend.

Everything here goes through seams that stock verl 0.9.x has; nothing in verl is
patched or copied. The seams, and what each one is used for:

- ``register_trainer("remote")`` + ``trainer.v1.trainer_mode=remote``: verl's
  TaskRunner builds :class:`RemotePPOTrainer` instead of its own sync trainer.
  Once selected it presents itself as ``"sync"``, because verl switches to its
  asynchronous code paths (replay buffer, TransferQueue checkpoints) for any
  other mode name.
- ``register_trainer("remote_async")``: the same trainer on verl's asynchronous
  paths, which it keeps (its mode name stays ``remote_async``): verl's
  ``ReplayBufferAsync`` bounds staleness (``trainer.v1.sampler.*``), its
  TransferQueue checkpoints carry the prompts in flight, and one batch of
  prompts more than the step trains on is sampled ahead
  (``trainer.v1.remote_async.num_warmup_batches``), so the service samples the
  next step while this one computes log-probs and updates. Unlike verl's
  ``colocate_async``, nothing is aborted or put to sleep at a step's end: the
  service's sampler keeps the previous weights until the weight sync.
- ``PPOTrainer._init_resource_pool_mgr`` (private; checked against verl 0.9.1):
  the actor/rollout/ref worker class becomes the backend's forwarder worker and
  the resource pools become CPU-only. verl's own ``separate_async`` trainer
  overrides the same method the same way.
- ``actor_rollout_ref.rollout.custom`` (verl's extension field): carries the
  backend's name, reconnect handle and settings to every forwarder and replica
  (:mod:`verl_remote.integration.handoff`).
- ``RolloutReplicaRegistry.register("verl_remote", ...)`` +
  ``actor_rollout_ref.rollout.name=verl_remote``: verl's rollout servers become the
  backend's rollout replica.
- ``on_init_end`` / ``on_step_end``: after verl's weight sync (which calls the
  forwarder's ``update_weights``), the replicas learn the new weights version.

The backend is built once, here, in verl's TaskRunner process, and destroyed
exactly once whatever ends the run (see :class:`RemoteTaskRunner`).
"""

from __future__ import annotations

from verl_remote.discovery.compat import require_supported_verl

require_supported_verl()  # before importing verl internals that a newer verl may have moved

import asyncio
import contextvars
import copy
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextvars import ContextVar
from typing import Any

import ray
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.single_controller.ray.base import RayResourcePool, ResourcePoolManager
from verl.trainer.main_ppo import TaskRunnerV1
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.seqlen_balancing import log_seqlen_unbalance

from verl_remote.discovery.registry import load_backend_class, load_worker_class
from verl_remote.integration import names
from verl_remote.integration.agent_loop import reward_workers_deferred
from verl_remote.integration.balancer import use_run_balancer
from verl_remote.integration.client import OneServerClient
from verl_remote.integration.forwarder_view import TensorFieldsOnly
from verl_remote.integration.handoff import attach as attach_handoff
from verl_remote.integration.names import ASYNC_MODE, MODE, ROLLOUT_NAME
from verl_remote.integration.old_log_probs import OldLogProbs, max_difference, old_log_probs_problem
from verl_remote.integration.rollout import discard_server_ahead, start_server_ahead
from verl_remote.integration.worker import OLD_LOG_PROBS_CURRENT
from verl_remote.kit.backend import RemoteBackend
from verl_remote.kit.errors import one_line
from verl_remote.kit.secrets import secret_keys
from verl_remote.runtime.checkpoints import resume_target, seal
from verl_remote.runtime.export import check_export_setting, export_at_end
from verl_remote.runtime.layout import lora_problem, single_forwarder_problem
from verl_remote.runtime.record import resume_problem, write_run_record
from verl_remote.runtime.summary import REWARD_METRIC, RunSummary

__all__ = [
    "ASYNC_MODE",
    "MODE",
    "ROLLOUT_NAME",
    "BackendStart",
    "RemotePPOTrainer",
    "RemoteTaskRunner",
    "RolloutError",
    "RunStopped",
    "SingleForwarderError",
]

log = logging.getLogger(__name__)

#: Seconds an overlapped run waits, once its last step is done, for the samples still in flight (the next step's,
#: which no step will train on) before it destroys the backend: a service is not torn down under its requests.
DRAIN_TIMEOUT_S = 120.0


class RolloutError(RuntimeError):
    """The backend's sampler failed requests of a step: the step stops with the sampler's own error.

    ``transient``: whether that first error was a fault of the moment (verl_remote.kit.faults), which the
    sampler's own retries did not outlast: ``verl-remote train`` then restarts the run from its last checkpoint.
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class SingleForwarderError(ValueError):
    """The backend needs one forwarder but the layout asks for more."""


class RunStopped(RuntimeError):
    """The run is stopping (Ctrl-C or SIGTERM on the driver) and its backend is destroyed: the loop, still
    running in the TaskRunner's other thread, makes no further call to the backend."""


class CPUResourcePoolManager(ResourcePoolManager):
    """verl's pool manager, but with CPU-only bundles of one logical CPU each.

    verl's ``create_resource_pool`` hard-codes GPU bundles and refuses to start
    without GPUs; forwarders never need one.
    """

    def create_resource_pool(self) -> None:
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes, use_gpu=False, max_colocate_count=1, name_prefix=name
            )


def _overlap(config: DictConfig, backend_class: type[RemoteBackend]) -> tuple[bool, str | None]:
    """Whether the run samples while it trains (``trainer_mode=remote_async``), and the backend's reason when it
    asked for that and the backend cannot."""
    if str(config.trainer.v1.trainer_mode) != ASYNC_MODE:
        return False, None
    reason = backend_class.cannot_overlap(config)
    return not reason, reason or None


#: The longest verl's replay buffer waits between its looks at TransferQueue where verl-remote's agent loop says when
#: samples arrive (each look reads every key's tags: 20 a second during a minute of sampling is a CPU-minute).
ARRIVAL_WAIT_S = 1.0


def _waits_for_arrivals(buffer: Any, arrivals: Any) -> Any:
    """verl's replay buffer's wait between its looks at TransferQueue (``_wait_for_next_poll``), ended by the agent
    loop's arrivals where there are any (at most :data:`ARRIVAL_WAIT_S`), and verl's own otherwise."""
    wait = buffer._wait_for_next_poll

    def next_poll(partition_id: str, last_debug_time: float) -> float:
        arrived = arrivals()
        if arrived is None:
            return float(wait(partition_id, last_debug_time))
        arrived.wait(ARRIVAL_WAIT_S)
        arrived.clear()
        interval, buffer.poll_interval = buffer.poll_interval, 0.0
        try:
            return float(wait(partition_id, last_debug_time))  # its log line, without its sleep
        finally:
            buffer.poll_interval = interval

    return next_poll


#: Seconds between the console's lines while the trainer waits for the backend (its service) to be made.
WAIT_NOTE_S = 30.0


class BackendStart:
    """The run's backend made in a thread of its own while verl starts its processes.

    ``verl-remote train``'s TaskRunner begins it before verl's ``run`` starts TransferQueue's processes and the
    trainer, which takes the backend where it would have made it (``from_config``, on the run's config as the
    trainer then has it: its mode set). A backend's start-up (a service's actor importing its libraries, a
    session opened with a service) then overlaps verl's own, one after the other before (docs/measurements.md,
    "Start-up, phase by phase"). What ``from_config`` raises is raised where the trainer takes it.

    The thread lives until the run releases it (:meth:`release`, once the backend is destroyed), as the
    TaskRunner's own thread did when it made the backend: what ``from_config`` started may be tied to the thread
    that started it (a service launched with Linux's ``PR_SET_PDEATHSIG`` ends when that thread does).
    """

    def __init__(self, config: DictConfig) -> None:
        backend_class = load_backend_class(str(config.remote_backend.name))
        own = copy.deepcopy(config)  # verl's run resolves and edits its config meanwhile
        with open_dict(own):  # as the trainer sets it (its __init__)
            own.trainer.v1.trainer_mode = ASYNC_MODE if _overlap(own, backend_class)[0] else "sync"
        self._lock = threading.Lock()
        self._taken = False
        self._made: Future[RemoteBackend] = Future()
        #: When the backend began to be made, and when it was (``time.monotonic()``).
        self.began = time.monotonic()
        self.ready_at = self.began
        self._released = threading.Event()
        self.thread = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._run, backend_class, own),
            name="verl-remote-backend-start",
            daemon=True,
        )
        self.thread.start()

    def _run(self, backend_class: type[RemoteBackend], config: DictConfig) -> None:
        try:
            made = self._make(backend_class, config)
            self.ready_at = time.monotonic()
            self._made.set_result(made)
        except BaseException as exc:
            self._made.set_exception(exc)
        self._released.wait()

    @staticmethod
    def _make(backend_class: type[RemoteBackend], config: DictConfig) -> RemoteBackend:
        backend = backend_class.from_config(config)
        try:  # the first replica's server too, with the hand-off the trainer attaches to its own config
            attach_handoff(config, str(config.remote_backend.name), backend.reconnect_handle())
            start_server_ahead(config)
        except Exception as exc:  # the replica starts its own, as verl has it
            log.warning("verl-remote: the rollout server could not start ahead: %s", one_line(exc))
        return backend

    def release(self) -> None:
        """The run is over and its backend destroyed: the thread that made it ends."""
        self._released.set()

    def take(self) -> RemoteBackend:
        """The backend, once made, for the trainer, which destroys it from then on. While the trainer waits for it
        (a service being provisioned, a launched one loading its model), the console says so every
        :data:`WAIT_NOTE_S`, and when it answered."""
        with self._lock:
            if self._taken:
                raise RunStopped("the run is stopping: its backend was destroyed before the trainer was built")
            self._taken = True
        waited = False
        while True:
            try:
                backend = self._made.result(timeout=WAIT_NOTE_S)
            except FutureTimeout:
                waited = True
                print(f"verl-remote: waiting for the service ({time.monotonic() - self.began:.0f} s)", flush=True)
                continue
            if waited:
                print(f"verl-remote: the service answered after {self.ready_at - self.began:.0f} s", flush=True)
            return backend

    def discard(self) -> bool:
        """Destroy the backend when no trainer took it (verl's start-up failed first, or the run is stopping),
        once it is made; whether it did."""
        with self._lock:
            if self._taken:
                return False
            self._taken = True
        try:
            backend = self._made.result()
        except BaseException:  # made nothing: what it raised is the trainer's to report, or no one's
            return False
        log.info("verl-remote: destroying the backend no trainer took")
        asyncio.run(backend.destroy())
        return True


#: The backend being made for the trainer that verl builds in this context (set by RemoteTaskRunner).
_BACKEND_START: ContextVar[BackendStart | None] = ContextVar("verl_remote_backend_start", default=None)


@register_trainer(ASYNC_MODE)
@register_trainer(MODE)
class RemotePPOTrainer(PPOTrainerSync):
    """verl's sync trainer driving a :class:`~verl_remote.RemoteBackend`; with ``trainer_mode=remote_async``, on
    verl's asynchronous replay buffer, sampling the next step while this one trains (:attr:`overlap`)."""

    #: verl's worker group of the forwarders (verl's ``_setup`` makes it; :meth:`init` narrows what it fetches).
    actor_rollout_wg: Any
    ref_policy_wg: Any

    def __init__(self, config: DictConfig) -> None:
        #: Whether ``verl-remote train`` launched the run (its TaskRunner), which checked the layout and the
        #: cluster's paths before Ray started and prints the summary itself; else verl's own launcher did.
        self.launched_by_cli = names.LAUNCHER.get() == "cli"
        self.restarts = names.RESTARTS.get()
        self.backend_name = str(config.remote_backend.name)
        self.summary = RunSummary()
        self._destroy_lock = threading.Lock()
        self._destroyed = False
        backend_class = load_backend_class(self.backend_name)
        if not self.launched_by_cli:
            from verl_remote.runtime.cluster import check_cluster_paths

            for key in secret_keys(OmegaConf.to_container(config.get("ray_kwargs") or {}), "ray_kwargs."):
                print(
                    f"verl-remote: {key} looks like a secret, and verl's own launcher printed it into the run's log "
                    "with the rest of its config (`verl-remote train` shows it as ***, and the run's record holds "
                    "***): give a service's token with the backend's token file or environment variable setting",
                    flush=True,
                )

            problem = names.unknown_name_problem(config) or names.estimator_problem(config)
            if problem := problem or resume_problem(config) or old_log_probs_problem(config):
                raise ValueError(problem)
            if problem := single_forwarder_problem(
                config, self.backend_name, backend_class.requires_single_forwarder()
            ):
                raise SingleForwarderError(problem)
            if problem := lora_problem(config, self.backend_name, backend_class.verl_lora):
                raise ValueError(problem)
            check_cluster_paths(config)
            check_export_setting(config)
            print(
                "verl-remote: under verl's own launcher a transient fault (a lost connection, an HTTP 502) stops the "
                "run; run it with `verl-remote train` to have it restart from its last checkpoint (remote_restart)",
                flush=True,
            )
        self.overlap, reason = _overlap(config, backend_class)
        if reason:
            print(
                f"verl-remote: backend '{self.backend_name}' cannot sample while it trains ({reason}): "
                f"this run is synchronous (trainer.v1.trainer_mode={MODE})",
                flush=True,
            )
        with open_dict(config):
            config.trainer.v1.trainer_mode = ASYNC_MODE if self.overlap else "sync"
        #: Where each step's old log-probs come from (:mod:`verl_remote.integration.old_log_probs`).
        self.old_log_probs = OldLogProbs.of(config, overlap=self.overlap)
        self._old_log_probs_plan = "recompute"  # this step's (OldLogProbs.plan)
        #: An overlapped run's weight sync runs beside the next step where the backend can
        #: (RemoteBackend.background_weight_sync); the one in flight. While it runs, the rollout servers hold the
        #: requests that would start (so a step trains on samples at most one update old), unless the run asks them
        #: not to (:meth:`_holds_for_sync`).
        self.background_sync = self.overlap and backend_class.background_weight_sync
        self.hold_for_sync = self._holds_for_sync(config, backend_class) if self.overlap else True
        self._sync: Future[float] | None = None
        self._sync_read: Future[Any] | None = None
        self._syncer: ThreadPoolExecutor | None = None
        use_run_balancer(config)  # under verl's own launcher; verl-remote train's TaskRunner named it already
        start = _BACKEND_START.get()
        self.backend: RemoteBackend = start.take() if start is not None else backend_class.from_config(config)
        try:
            attach_handoff(config, self.backend_name, self.backend.reconnect_handle())
            super().__init__(config)
        except BaseException:
            self.destroy_backend()
            raise

    def _holds_for_sync(self, config: DictConfig, backend_class: type[RemoteBackend]) -> bool:
        """Whether requests wait for the weight sync beside the next step: by default they do, so that a step
        trains on samples at most one update old (verl's trajectory_staleness 1). A run that asks
        (``trainer.v1.remote_async.background_weight_sync=true``) lets them start on the weights before the sync,
        two updates old when they train; said in one line."""
        key = f"trainer.v1.{ASYNC_MODE}.background_weight_sync"
        if not bool(OmegaConf.select(config, key, default=False)):
            return True
        if not backend_class.background_weight_sync:
            print(
                f"verl-remote: backend '{self.backend_name}' syncs its weights between steps (it does not declare "
                f"background_weight_sync): {key}=true changes nothing",
                flush=True,
            )
            return True
        print(
            f"verl-remote: the next step's requests do not wait for the weight sync ({key}=true): a step may train "
            "on samples two updates old (verl's training/off_policy/trajectory_staleness up to 2)",
            flush=True,
        )
        return False

    #: Seconds between verl's checks that a step's samples are in, where verl's own agent-loop workers sample (each
    #: check reads every key's tags from TransferQueue). verl's replay buffer waits 2 s between checks, so every
    #: step's generation took a multiple of 2 s however fast the service sampled (docs/measurements.md). Where
    #: verl-remote's agent loop samples, the buffer checks when it put samples there (:data:`ARRIVAL_WAIT_S`).
    replay_poll_s = 0.05

    def _build_replay_buffer(self) -> Any:
        buffer = super()._build_replay_buffer()
        if hasattr(buffer, "poll_interval"):
            buffer.poll_interval = min(float(buffer.poll_interval), self.replay_poll_s)
        if type(buffer) in (ReplayBuffer, ReplayBufferAsync):  # verl's own, not a user's custom sampler
            buffer._wait_for_next_poll = _waits_for_arrivals(buffer, self._arrivals)
        return buffer

    def _arrivals(self) -> threading.Event | None:
        """The agent loop's signal that samples went into TransferQueue, where it alone puts them."""
        manager = getattr(self, "agent_loop_manager", None)  # verl's fit sets it
        return getattr(manager, "arrivals", None)

    def get_llm_client(self) -> Any:
        """verl's client; a run with one rollout server sends each request straight to it (OneServerClient)."""
        manager = self.llm_server_manager
        servers = dict(zip(manager.server_addresses, manager.server_handles, strict=True))
        return manager.get_client(client_cls=OneServerClient, servers=servers)

    def init(self) -> None:
        try:
            # verl's reward workers serve verl's agent-loop workers only: where verl-remote's agent loop scores the
            # run's batches in its own process, they are made when a batch first goes to verl's (agent_loop.py).
            with reward_workers_deferred(self.config):
                super().init()
        except BaseException:
            self.destroy_backend()
            raise
        # The forwarders fetch a batch's tensors, not its text and records (forwarder_view.py).
        group = self.actor_rollout_wg
        self.actor_rollout_wg = TensorFieldsOnly(group)
        if getattr(self, "ref_policy_wg", None) is group:
            self.ref_policy_wg = self.actor_rollout_wg

    def fit(self, agent_loop_manager: Any) -> None:
        """verl's loop; the backend is destroyed once whatever ends it (verl's own TaskRunner does not)."""
        try:
            write_run_record(self.config)  # what `verl-remote export` reads of the run
            super().fit(agent_loop_manager)
            self._wait_for_sync()
            if self.overlap:
                self._drain_rollouts()
            export_at_end(self.config)  # before the backend goes: a service's checkpoints may go with it
        finally:
            self.destroy_backend()
            if not self.launched_by_cli:  # verl-remote train prints the summary it is returned, after Ray's output
                if waits := self.summary.waits_line():
                    print(waits, flush=True)
                print(self.summary.line(), flush=True)

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        worker_cls = ray.remote(load_worker_class(self.backend_name))
        for role in list(self.role_worker_mapping):
            if role in (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor, Role.RefPolicy):
                self.role_worker_mapping[role] = worker_cls
            else:
                raise ValueError(
                    f"verl-remote runs the actor, rollout and reference roles on the backend; "
                    f"role {role} is not supported: disable the critic (use a critic-free estimator such as "
                    "algorithm.adv_estimator=grpo) and the reward model (reward.reward_model.enable=false)"
                )
        spec = self.resource_pool_manager.resource_pool_spec
        self.resource_pool_manager: ResourcePoolManager = CPUResourcePoolManager(
            resource_pool_spec=spec, mapping=self.mapping
        )

    def _save_checkpoint(self) -> None:
        """verl's save, then the completion record that makes it count (:mod:`verl_remote.runtime.checkpoints`)."""
        self._stop_if_destroyed()
        self._wait_for_sync()
        super()._save_checkpoint()
        folder = os.path.join(str(self.config.trainer.default_local_dir), f"global_step_{self.global_steps}")
        if os.path.isdir(folder):
            seal(folder)

    def _load_checkpoint(self) -> Any:
        """verl's resume, from the newest complete checkpoint when the latest is not (``resume_mode=auto``)."""
        if str(self.config.trainer.resume_mode) == "auto":
            choice = resume_target(str(self.config.trainer.default_local_dir))
            if choice.note:
                log.warning("verl-remote: %s", choice.note)
        return super()._load_checkpoint()

    def _check_rollouts(self, what: str, cause: BaseException | None = None) -> None:
        """Stop with the sampler's first error when any request failed since the last check.

        verl's agent loop logs a failed request and counts its prompt as failed; the step then trains on the
        rest, padded, or verl's replay buffer stops with its own words. A backend's sampler that fails is a
        fault of the run: it stops here, naming the backend's error.
        """
        servers = self._rollout_servers()
        failures = [failure for each in ray.get([s.take_failures.remote() for s in servers]) for failure in each]
        if not failures:
            return
        more = f" (and {len(failures) - 1} more failed requests)" if len(failures) > 1 else ""
        first, transient = failures[0]
        raise RolloutError(f"sampling failed {what}: {first}{more}", transient=transient) from cause

    def _stop_if_destroyed(self) -> None:
        """Refuse to go on once the backend is destroyed: the driver destroys it from the TaskRunner's second
        thread while this loop may be mid-step, and nothing may reach a destroyed backend (a sync, a save)."""
        if self._destroyed:
            raise RunStopped(f"the run is stopping: backend '{self.backend_name}' is destroyed")

    def _step_once(self, metrics: dict[str, Any], timing_raw: dict[str, Any], sample_batch_size: int) -> Any:
        self._stop_if_destroyed()
        try:
            return super()._step_once(metrics, timing_raw, sample_batch_size)
        except RolloutError:
            raise
        except Exception as exc:  # e.g. verl's replay buffer finding only failed prompts
            self._check_rollouts(f"at step {self.global_steps}", exc)
            raise

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        """verl's replay buffer refilling the groups it evicted. An overlapped run's buffer evicts failed groups and
        resubmits their prompts, so a sampler that fails every request (a dead service) was asked again for ever:
        a failed request stops the run here first, as it does at the end of a synchronous step's sampling."""
        self._check_rollouts(f"at step {self.global_steps}")
        return int(super()._add_prompts_to_generate(num_prompts))

    def on_train_begin(self) -> None:
        if self.overlap:  # the batch sampled ahead: the next step's prompts go out while this step trains
            # verl reads its mode's section the same way: trainer.v1.get(trainer_mode, {}).
            settings = self.config.trainer.v1.get(ASYNC_MODE) or {}
            self._add_async_warmup_batches(float(settings.get("num_warmup_batches", 1)))

    def on_sample_end(self) -> None:
        self._check_rollouts(f"at step {self.global_steps}")
        if not self.overlap:  # verl's sync hook: replicas sleep between rollouts
            super().on_sample_end()
        elif self.curr_step_profile:
            self._stop_rollout_profiling()

    def _rollout_servers(self) -> list[Any]:
        """Every rollout server actor of every replica."""
        return [server for replica in self.llm_server_manager.get_replicas() for server in replica.servers]

    def _drain_rollouts(self) -> None:
        """Wait for the samples still in flight after the last step, so the backend is destroyed idle."""
        servers = self._rollout_servers()
        left = sum(ray.get([server.wait_idle.remote(DRAIN_TIMEOUT_S) for server in servers]))
        if left:
            log.warning("verl-remote: %d sampling requests still in flight after %.0f s", left, DRAIN_TIMEOUT_S)

    def _validate(self) -> Any:
        self._stop_if_destroyed()
        self._wait_for_sync()  # validation samples the weights the last step trained
        self._service_waits()  # the start-up's (before the first validation), or none: not a step's
        try:
            result = super()._validate()
        except Exception as exc:
            self._check_rollouts("during validation", exc)
            raise
        self._check_rollouts("during validation")
        self._service_waits()  # the validation's sampling is not the next step's generation
        return result

    def _service_waits(self) -> dict[str, float]:
        """The backend's waits on its service since it was last asked (RemoteBackend.service_waits)."""
        if self._destroyed or type(self.backend).service_waits is RemoteBackend.service_waits:
            return {}  # a backend that reports none: no event loop made for it at every step
        try:
            waits = asyncio.run(self.backend.service_waits()) or {}
            return {str(phase): float(seconds) for phase, seconds in waits.items()}
        except Exception as exc:  # a report, never a reason to stop the run
            log.warning("verl-remote: backend '%s' could not report its waits: %s", self.backend_name, one_line(exc))
            return {}

    def _consume_sync_metrics(self) -> dict[str, Any]:
        """verl's weight-sync metrics, and the step's waits on the service with their share of each phase."""
        metrics: dict[str, Any] = dict(super()._consume_sync_metrics())
        waits = self._service_waits()
        for phase, seconds in sorted(waits.items()):
            metrics[f"service/wait_s/{phase}"] = seconds
            took = float(self.timing_raw.get(phase) or 0.0)
            if took > 0:
                metrics[f"service/wait_share/{phase}"] = seconds / took
                self.summary.shares.setdefault(phase, []).append(seconds / took)
        return metrics

    def _publish_weights_version(self, version: int | None = None) -> None:
        """Tell every rollout server which training step its weights come from (by default, this one)."""
        version = int(self.global_steps) if version is None else version
        servers = self._rollout_servers()
        ray.get([server.set_global_steps.remote(version) for server in servers])

    def _compute_metrics(self, batch: Any, metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        result = super()._compute_metrics(batch, metrics, *args, **kwargs)
        # What the run met and went on from (docs/reliability.md): the command's restarts so far, and this step's
        # sampling requests sent again after a transient fault.
        metrics["verl_remote/restarts"] = self.restarts
        servers = self._rollout_servers()
        metrics["verl_remote/sample_retries"] = sum(ray.get([server.take_retried.remote() for server in servers]))
        if REWARD_METRIC in metrics:
            if not self.summary.rewards:
                self.summary.first_step = int(self.global_steps)
            self.summary.rewards.append(float(metrics[REWARD_METRIC]))
        return result

    def on_init_end(self, **kwargs: Any) -> None:
        super().on_init_end(**kwargs)
        self._publish_weights_version()
        self._service_waits()  # the start-up's waits are not the first step's

    def on_step_end(self, **kwargs: Any) -> None:
        self._stop_if_destroyed()  # the weight sync
        if self.background_sync:
            self._wait_for_sync()  # one at a time
            self._sync_beside_next_step()
            return
        super().on_step_end(**kwargs)
        self._publish_weights_version()

    def _compute_old_log_prob(self, batch: Any, metrics: dict[str, Any]) -> Any:
        """verl's pass, or the sampler's log-probs where the run's checks found them the same numbers
        (:mod:`verl_remote.integration.old_log_probs`)."""
        plan = self._old_log_probs_plan = self.old_log_probs.plan(int(self.global_steps))
        metrics["verl_remote/old_log_probs_from_sampler"] = float(plan == "sampler")
        if plan == "sampler":  # as verl's bypass mode puts them, and nothing else changed
            data = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=["rollout_log_probs"]
            )
            data["old_log_probs"] = data.pop("rollout_log_probs")
            tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=data)
            return batch
        batch = super()._compute_old_log_prob(batch, metrics)
        if plan == "check":
            fields = ["old_log_probs", "rollout_log_probs", "response_mask"]
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            difference = max_difference(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"])
            metrics["verl_remote/sampler_log_prob_diff_max"] = difference
            if said := self.old_log_probs.checked(difference, int(self.global_steps)):
                print(said, flush=True)
        return batch

    def _balance_batch(
        self, batch: Any, metrics: dict[str, Any], logging_prefix: str = "global_seqlen", keep_minibatch: bool = False
    ) -> Any:
        """verl's, but with one data-parallel rank (one forwarder, every backend's default) without its partitioning:
        verl's Karmarkar-Karp then returns one partition of every sample in order (its partitions' indices sorted),
        so verl's reorder changes nothing. The batch and the metrics are verl's, without a heap of a Python object
        per sample a step (tests/test_light_client.py)."""
        group = self.actor_rollout_wg
        if "actor" not in group._dispatch_info:
            group._dispatch_info["actor"] = group._query_dispatch_info("actor")
        if max(group._dispatch_info["actor"]) + 1 != 1:
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        batch = upsample_batch_to_divisible_size(
            batch, self._get_required_batch_multiple(1), self.tokenizer.eos_token_id
        )
        seqlens = [int(tag["seq_len"]) for tag in batch.tags]
        metrics.update(
            log_seqlen_unbalance(seqlen_list=seqlens, partitions=[list(range(len(seqlens)))], prefix=logging_prefix)
        )
        return batch

    def _update_actor(self, batch: Any, metrics: dict[str, Any]) -> Any:
        self._wait_for_sync(read_only=True)  # the update changes the weights the sync reads
        # Whether the old log-probs are the model's as it is now: the update's forwarder tells its backend.
        batch.extra_info[OLD_LOG_PROBS_CURRENT] = self.old_log_probs.current(self._old_log_probs_plan)
        if self._old_log_probs_plan != "sampler":
            return super()._update_actor(batch, metrics)
        # verl's actor/entropy, which its old-log-prob pass measures, from the update's forward pass instead (the
        # same number when a step trains one mini-batch; the mean over its mini-batches when more): its entropy
        # does not enter the loss (actor.entropy_coeff times it, as always).
        actor = self.config.actor_rollout_ref.actor
        asked = actor.calculate_entropy
        shown = bool(asked) or float(actor.entropy_coeff) != 0.0  # verl reports actor/entropy_loss then
        with open_dict(actor):
            actor.calculate_entropy = True
        try:
            result = super()._update_actor(batch, metrics)
        finally:
            with open_dict(actor):
                actor.calculate_entropy = asked
        entropy = metrics.get("actor/entropy_loss") if shown else metrics.pop("actor/entropy_loss", None)
        if entropy is not None:  # a backend whose update measures no entropy (Tinker's) reports none
            metrics["actor/entropy"] = entropy
        return result

    def _sync_beside_next_step(self) -> None:
        """Start the backend's weight sync in a thread and go on (RemoteBackend.background_weight_sync). The update
        waits for the sync's call only (:attr:`_sync_read`: it changes the weights the sync reads); the replicas
        then get the new version, clear what they cached of the old weights (verl's ``clear_kv_cache``) and let go
        the requests they held meanwhile (:attr:`hold_for_sync`): the next step's samples come from the new weights,
        while its old log-probs (the trainer's weights, which the sync only reads) run beside the sync."""
        version = int(self.global_steps)
        servers = self._rollout_servers()
        if self.hold_for_sync:
            ray.get([server.hold_requests.remote() for server in servers])
        began = time.monotonic()

        def read() -> None:
            asyncio.run(self.backend.update_weights())

        def publish() -> float:
            try:
                read_.result()
            except BaseException:  # the run stops at the update, which waits for the read; nothing waits on these
                if self.hold_for_sync and not self._destroyed:
                    ray.get([server.release_requests.remote() for server in servers])
                raise
            if not self._destroyed:
                self._publish_weights_version(version)  # which lets the held requests go
            return time.monotonic() - began

        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verl-remote-sync")
        read_ = self._sync_read = self._syncer.submit(read)
        self._sync = self._syncer.submit(publish)  # after the read: the executor runs one at a time

    def _wait_for_sync(self, *, read_only: bool = False) -> None:
        """Wait for the weight sync in flight, if any (``read_only``: for its call to the backend, not the
        replicas' new version); its error stops the run here. The step logs the sync's own time as verl's
        ``timing_s/update_weights`` (it ran beside this step) and how long the step waited for it as
        ``timing_s/update_weights_wait``."""
        if read_only:
            sync, self._sync_read = self._sync_read, None
        else:
            sync, self._sync, self._sync_read = self._sync, None, None
        if sync is None:
            return
        began = time.monotonic()
        took = sync.result()
        timing = getattr(self, "timing_raw", None)  # the step's; none before the first
        if timing is not None:
            if not read_only:  # the read's result is none: the sync's own time is the publish's
                timing["update_weights"] = timing.get("update_weights", 0.0) + took
            timing["update_weights_wait"] = timing.get("update_weights_wait", 0.0) + time.monotonic() - began

    def destroy_backend(self) -> None:
        """Destroy the backend once; later calls do nothing. Safe from any thread."""
        with self._destroy_lock:
            if self._destroyed:
                return
            self._destroyed = True
        log.info("verl-remote: destroying backend '%s'", self.backend_name)
        if self._syncer is not None:  # a sync still in flight fails against the destroyed backend, unread
            self._syncer.shutdown(wait=False)
        manager = getattr(self, "agent_loop_manager", None)  # verl's fit sets it
        if manager is not None and hasattr(manager, "close"):  # its thread ends before the backend goes
            manager.close()
        asyncio.run(self.backend.destroy())


class RemoteTaskRunner(TaskRunnerV1.__ray_actor_class__):
    """verl's V1 TaskRunner that registers verl-remote's replica and always destroys the backend.

    ``verl-remote train`` runs it in a thread of its own process, which has verl imported already (verl's launcher
    starts a Ray actor for it, one more process importing verl before the run's first step). The CLI's main
    thread waits for ``run`` and, on Ctrl-C, calls ``destroy_backend`` while ``run`` may still be mid-step.
    """

    #: How many times ``verl-remote train`` restarted the run before this attempt (set by the CLI).
    restarts = 0

    def run(self, config: DictConfig) -> RunSummary:
        launched = names.LAUNCHER.set("cli")  # for the trainer verl builds in this call (this thread's context)
        restarts = names.RESTARTS.set(self.restarts)
        start = _BACKEND_START.set(None)
        self._start: BackendStart | None = None
        use_run_balancer(config)  # before the backend's start copies the rollout config
        try:
            self._start = BackendStart(config)  # beside verl's start-up, which begins in super().run
            _BACKEND_START.set(self._start)
            super().run(config)
        finally:
            _BACKEND_START.reset(start)
            names.RESTARTS.reset(restarts)
            names.LAUNCHER.reset(launched)
            try:
                self.destroy_backend()  # one no trainer took once it is made, its server ahead started with it
            finally:
                discard_server_ahead()  # when verl built no replica to take it
                if self._start is not None:  # after the backend is destroyed: what it started ends with the thread
                    self._start.release()
        return self.summary()

    def summary(self) -> RunSummary:
        """The run's summary so far: the CLI asks for it when ``run`` ended in an error or is being stopped."""
        trainer = self._remote_trainer()
        return trainer.summary if trainer is not None else RunSummary()

    def _remote_trainer(self) -> RemotePPOTrainer | None:
        """The trainer verl built in ``run``, once it has (verl's TaskRunner sets ``self.trainer``)."""
        trainer = getattr(self, "trainer", None)
        return trainer if isinstance(trainer, RemotePPOTrainer) else None

    def destroy_backend(self) -> bool:
        trainer = self._remote_trainer()
        if trainer is None:  # verl has not built it (yet): the backend made for it, if none took it
            start: BackendStart | None = getattr(self, "_start", None)  # none before run
            return start.discard() if start is not None else False
        trainer.destroy_backend()
        return True
