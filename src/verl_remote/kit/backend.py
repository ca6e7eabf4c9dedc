"""The ``RemoteBackend`` contract: lifecycle, weight sync and checkpoints only.

Compute calls (log-probs, the actor update, generation) are each backend's own
business: its forwarder worker and rollout replica call them with whatever
protocol the service speaks. What the trainer needs from every backend is the
part below, and nothing more.

One backend serves a whole run. The driver builds it with
``from_config(config)``; every forwarder worker and rollout replica, each in its
own Ray process, re-attaches to the same running backend with
``from_config(config, handle=backend.reconnect_handle())``.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, ClassVar

__all__ = ["RemoteBackend"]

# Methods whose coroutine-ness is part of the contract. A backend that overrides
# one of these with the other flavour would fail far from its definition (an
# un-awaited coroutine, or "object is not awaitable" inside verl's loop), so the
# mismatch is rejected when the subclass is defined.
_ASYNC_METHODS = ("update_weights", "save_checkpoint", "load_checkpoint", "destroy", "service_waits", "left_on_service")
_SYNC_METHODS = ("reconnect_handle",)
# Asked before anything exists (the preflight), so they are classmethods.
_CLASS_METHODS = (
    "from_config",
    "probe_service",
    "preflight",
    "requires_single_forwarder",
    "cannot_overlap",
    "export",
)


class RemoteBackend(abc.ABC):
    """A training and sampling service that verl's RL loop drives.

    Subclasses implement the abstract methods; ``requires_single_forwarder``
    has a default. The async methods are awaited by verl-remote on an event
    loop of its own, so they may do network or Ray calls directly.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _ASYNC_METHODS:
            method = cls.__dict__.get(name)
            if method is not None and not inspect.iscoroutinefunction(method):
                raise TypeError(
                    f"{cls.__module__}.{cls.__qualname__}.{name} must be 'async def': "
                    "RemoteBackend has one async contract for lifecycle calls"
                )
        for name in _SYNC_METHODS:
            method = cls.__dict__.get(name)
            if method is not None and inspect.iscoroutinefunction(method):
                raise TypeError(f"{cls.__module__}.{cls.__qualname__}.{name} must be a plain 'def', not 'async def'")
        for name in _CLASS_METHODS:
            method = cls.__dict__.get(name)
            if method is not None and not isinstance(method, classmethod):
                raise TypeError(f"{cls.__module__}.{cls.__qualname__}.{name} must be a classmethod")
            if method is not None and inspect.iscoroutinefunction(method.__func__):
                raise TypeError(f"{cls.__module__}.{cls.__qualname__}.{name} must be a plain 'def', not 'async def'")

    @classmethod
    @abc.abstractmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> RemoteBackend:
        """Build the backend, or re-attach to a running one.

        Args:
            main_config: the run config (an OmegaConf ``DictConfig``); the backend's
                own settings are under ``main_config.remote_backend``. On the driver
                (``handle=None``) it is the whole composed config; in a forwarder or a
                rollout server it holds the sections ``remote_backend``, ``data``,
                ``trainer``, ``algorithm`` and ``actor_rollout_ref`` (the rollout
                server's ``actor_rollout_ref`` has only ``model``), resolved.
            handle: ``None`` on the driver, which creates the backend (connects to
                or starts the service, creates its jobs). In a Ray worker, the dict
                returned by :meth:`reconnect_handle` on the driver: attach to that
                same backend, create nothing.
        """

    @classmethod
    def probe_service(cls, main_config: Any) -> None:
        """Whether the service answers at the configured address, in about a second.

        ``verl-remote train`` asks it first, on the config as composed (the demo's files not made yet, paths as the
        user wrote them), before it imports verl (several seconds), so that a wrong or dead address is refused in
        seconds. Ask the service's health route; raise ``ValueError`` naming the setting, its value and the fix
        when nothing answers there. Create nothing. Optional: the default asks nothing, and :meth:`preflight`
        finds it later.
        """
        return None

    @classmethod
    def doctor_notes(cls) -> list[str]:
        """Lines ``verl-remote doctor`` shows under the backend: what this environment reaches that a user cannot
        see otherwise (verl-remote-tinker: which services its installed SDK reaches). Optional: the default says
        nothing. Import nothing slow; reach no service."""
        return []

    @classmethod
    def preflight(cls, main_config: Any) -> None:
        """Check, in seconds and before anything starts, what :meth:`from_config` will need.

        ``verl-remote train`` calls it on the driver before Ray starts. Raise
        ``ValueError`` with a message naming the setting, its value and the fix
        (the service unreachable at ``remote_backend.url``, a missing credential,
        a protocol the backend does not speak); the run then stops with exit 2
        and that message as its last line. Create nothing here. The default
        checks nothing.
        """
        return None

    @abc.abstractmethod
    def reconnect_handle(self) -> dict[str, Any]:
        """A small, picklable dict from which any process can re-attach.

        It crosses Ray process boundaries, so keep it to plain data (URLs, job
        ids, Ray actor names); never a secret: read tokens from the environment.
        """

    @classmethod
    def requires_single_forwarder(cls) -> bool:
        """Whether the service needs every verl call to come from one forwarder.

        Services that run their own data parallelism want one caller per step;
        ``verl-remote train`` then refuses a layout with more than one forwarder
        worker before anything starts (and the trainer, under verl's own launcher,
        before the first step). A classmethod: it is asked before the backend exists.
        """
        return False

    @classmethod
    def cannot_overlap(cls, main_config: Any) -> str | None:
        """Why this service cannot sample while it trains, or ``None`` when it can (the default).

        With ``trainer.v1.trainer_mode=remote_async`` the next step's generation runs while the current step's
        log-probs and update run: the rollout replica's ``sample`` is called between (and during) the
        forwarder's compute calls. A backend can overlap when its sampler keeps sampling from the weights of the
        last :meth:`update_weights` while the trainer changes its own (a separate sampling job or snapshot), and
        the service takes both kinds of calls at once. Return a short reason otherwise (the sampler and the
        trainer share their GPUs, say); the run then prints it in one line and runs synchronously. Asked on the
        driver before the backend is built, with the run's config.
        """
        return None

    #: Whether an overlapped run may go on with its next step while :meth:`update_weights` runs (default
    #: False). Declared, an overlapped run calls it in a thread of its own at the end of each step, on the instance
    #: :meth:`from_config` created, and goes on: the next step's log-prob calls run beside it, while the rollout
    #: replicas hold the requests that would start until it has returned and they are told the new weights version
    #: (which runs their ``clear_kv_cache``), so the next step's samples come from the new weights (a step trains on
    #: samples at most one update old). The step's update, a checkpoint, a validation and the next sync wait until
    #: it returns (its error stops the run there). A run that asks
    #: (``trainer.v1.remote_async.background_weight_sync=true``) lets the held requests start on the weights before,
    #: two updates old when they train. Declare it when the sync leaves the trainer's weights as they are and the
    #: service takes (or queues) log-prob calls while it syncs: Arctic's separate engines do (verl-arctic). The
    #: sync then costs a step only what it takes beyond the old log-probs.
    background_weight_sync: ClassVar[bool] = False

    #: The settings under ``remote_backend`` that name a program to start (a command that launches the service:
    #: verl-arctic's ``("comms.launch",)``). A run folder is data, never code: what reads a run's record
    #: (``verl-remote export``) clears these in the recorded config, so a record planted in a shared folder never
    #: starts its program; the user names the program on the command line to have it started. Declare every such
    #: setting: one left out would run from any folder its record is read from.
    program_settings: ClassVar[tuple[str, ...]] = ()

    #: Whether the backend trains a LoRA adapter of the rank verl's config asks for
    #: (``actor_rollout_ref.model.lora_rank``, or ``.lora.rank``; default False). A run that asks for one on a
    #: backend that does not declare this is refused before it starts: LoRA asked for and every weight trained
    #: is never what was meant. verl-remote-tinker declares it (a Tinker LoRA training client of that rank).
    verl_lora: ClassVar[bool] = False

    @abc.abstractmethod
    async def update_weights(self) -> None:
        """Make the sampler use the weights the trainer just updated. In an overlapped run
        (:meth:`cannot_overlap`), requests already sampling may finish on the previous weights; every request
        that starts after this returns samples from the new ones. It may return before the sampler has them,
        so that the trainer goes on with the next step, provided those later requests wait for them and the
        trainer's next change to its weights waits until they are read (verl-remote-tinker does this); or the
        backend declares :attr:`background_weight_sync` and the trainer runs the whole call beside its next
        step's old log-probs, holding the next samples until it returns."""

    @abc.abstractmethod
    async def save_checkpoint(self, step: int, path: str) -> None:
        """Save model and optimizer state for global ``step`` under ``path``."""

    @abc.abstractmethod
    async def load_checkpoint(self, step: int, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote for ``step`` under ``path``."""

    @abc.abstractmethod
    async def destroy(self) -> None:
        """Release everything the backend created. Must be idempotent."""

    @classmethod
    def export(cls, main_config: Any, step: int, path: str, out: str, *, adapter: bool = False) -> None:
        """Write the weights :meth:`save_checkpoint` saved for ``step`` under ``path`` into ``out``, a Hugging Face
        model folder: ``config.json``, the tokenizer, ``*.safetensors``, which
        ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load.

        ``verl-remote export`` calls it in its own process, with no Ray and no backend made: ``main_config`` is
        the run's config as the run recorded it (resolved); connect to the service where the weights are (with
        ``main_config.remote_backend``'s settings) and create nothing there that outlives the call. ``out`` is
        an empty folder the command moves into place once this returns, so an export cut short never looks
        complete. A LoRA is merged into its base model's weights, or, with ``adapter``, written as a PEFT
        adapter folder (``adapter_config.json``, ``adapter_model.safetensors``). Raise ``ValueError`` with the
        reason and the fix when it cannot (the checkpoint no longer on the service, ``adapter`` asked of a run
        that trained every weight). Optional: a backend that does not define it does not export, and the
        command says so.
        """
        raise NotImplementedError(f"backend {cls.__name__} does not export its checkpoints")

    async def service_waits(self) -> dict[str, float]:
        """Seconds the run waited on the service since the last call, by phase of verl's step.

        The phases are verl's timers: ``gen`` (sampling), ``old_log_prob``, ``ref``, ``update_actor`` and
        ``update_weights``; a phase's wait is the wall-clock time during which at least one of its requests was
        outstanding (overlapping requests count once). The trainer asks after each step's weight sync (and
        around each validation, whose waits it leaves out) and logs ``service/wait_s/<phase>`` and
        ``service/wait_share/<phase>`` (the wait over verl's time for that phase): what a service's latency
        costs a step. Optional; the default reports nothing.
        """
        return {}

    async def left_on_service(self) -> list[str] | None:
        """What the backend made on its service and is still there, asked after :meth:`destroy`: one line a
        person can act on per thing (verl-arctic: ``training job 7 (RUNNING)``; verl-remote-tinker: a model it
        could not unload), ``[]`` when nothing is. Ask the service where it can tell, rather than what this
        process remembers releasing. ``verl-remote check``'s ``destroy`` fails naming each line. Optional: the
        default, ``None``, reports nothing, and the check says so."""
        return None
