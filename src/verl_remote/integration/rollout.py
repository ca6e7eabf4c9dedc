"""The rollout replica: verl builds one per rollout replica; it starts one CPU-only server actor.

The server (:class:`~verl_remote.integration.server.RemoteRolloutServer`, in a module of its own that imports no
verl) answers verl's generation requests from the backend; a backend's replica names its server class
(:attr:`RemoteRolloutReplica.server_class`). ``verl-remote train`` starts the first replica's server before verl
builds the replica (:func:`start_server_ahead`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import ray
from omegaconf import OmegaConf
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from verl_remote.discovery.registry import load_rollout_class
from verl_remote.integration.handoff import read as read_handoff
from verl_remote.integration.server import SAMPLE_ATTEMPTS, RemoteRolloutServer
from verl_remote.kit.sampling import SampleResult, SamplingParams

__all__ = [
    "SAMPLE_ATTEMPTS",
    "BackendRolloutReplica",
    "RemoteRolloutReplica",
    "RemoteRolloutServer",
    "SampleResult",
    "SamplingParams",
    "discard_server_ahead",
    "start_server_ahead",
]

log = logging.getLogger(__name__)


class RemoteRolloutReplica(RolloutReplica):
    """One server actor per replica, no GPU; set :attr:`server_class` in a subclass."""

    server_class: ClassVar[type[RemoteRolloutServer]] = RemoteRolloutServer

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def init_colocated(self, resource_pool: Any) -> None:
        self.rollout_mode = RolloutMode.COLOCATED
        await self.launch_servers()

    async def launch_servers(self) -> None:
        server = None
        if not (self.is_reward_model or self.is_teacher_model):
            server = _take_server_ahead(self)
        if server is None:
            server = _start_server(self)
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"verl-remote://replica/{self.replica_rank}{self.name_suffix}"


def _start_server(replica: RemoteRolloutReplica) -> Any:
    """The replica's server actor, started (its constructor runs in the background)."""
    return (
        ray.remote(replica.server_class)
        .options(num_cpus=0, max_concurrency=replica.max_concurrency)
        .remote(_plain(replica.config), replica.model_config, replica.replica_rank)
    )


def _plain(rollout_config: Any) -> Any:
    """verl's rollout config (its ``RolloutConfig``) as an untyped DictConfig with the same keys and values: the
    server reads it as it would verl's (``config.prompt_length``, ``config.get("custom")``), and its process
    unpickles it without importing verl, seconds of CPU at a run's start. A config that does not convert (a
    value OmegaConf cannot hold) goes as verl's class, as before."""
    if not dataclasses.is_dataclass(rollout_config) or isinstance(rollout_config, type):
        return rollout_config
    try:
        return OmegaConf.create(dataclasses.asdict(rollout_config))
    except Exception:  # only slower: the server's process imports verl to unpickle verl's class
        return rollout_config


@dataclass
class _ServerAhead:
    server: Any
    #: What the server was started with: the replica's server class, config, model config and concurrency.
    settings: tuple[Any, ...]


def _settings(replica: RemoteRolloutReplica) -> tuple[Any, ...]:
    return (replica.server_class, replica.config, replica.model_config, replica.max_concurrency)


#: The first replica's server, started before verl builds the replica (:func:`start_server_ahead`); in the driver.
_ahead: _ServerAhead | None = None
_ahead_lock = threading.Lock()


def start_server_ahead(config: Any) -> None:
    """Start the server of the run's first rollout replica now, from the run's config with the hand-off attached.

    ``verl-remote train`` calls it once the backend is made, beside verl's own start-up: the server's process
    imports its libraries (seconds) while verl starts its workers, one after the other before. The replica is
    built here as verl's ``LLMServerManager`` builds it from the same config; the one verl builds later takes the
    server when its settings are the same (server class, rollout and model config, concurrency), and starts one
    of its own otherwise.
    """
    global _ahead
    rollout_config = config.actor_rollout_ref.rollout
    replica = load_rollout_class(read_handoff(rollout_config).backend)(
        replica_rank=0,
        config=rollout_config,
        model_config=config.actor_rollout_ref.model,
        gpus_per_node=rollout_config.n_gpus_per_node,
    )
    ahead = _ServerAhead(_start_server(replica), _settings(replica))
    with _ahead_lock:
        previous, _ahead = _ahead, ahead
    if previous is not None:
        ray.kill(previous.server)


def discard_server_ahead() -> None:
    """Stop the server started ahead when no replica took it (the run ended before verl built its replicas)."""
    global _ahead
    with _ahead_lock:
        ahead, _ahead = _ahead, None
    if ahead is not None:
        with contextlib.suppress(Exception):  # Ray may be shut down already: the server went with it
            ray.kill(ahead.server)


def _take_server_ahead(replica: RemoteRolloutReplica) -> Any:
    """The server started ahead for this replica, when it is the one the replica would start; else None."""
    global _ahead
    if replica.replica_rank != 0:
        return None
    with _ahead_lock:
        ahead, _ahead = _ahead, None
    if ahead is None:
        return None
    if ahead.settings == _settings(replica):
        return ahead.server
    log.warning("verl-remote: the rollout server started ahead has other settings than verl's replica: restarted")
    ray.kill(ahead.server)
    return None


class BackendRolloutReplica(RemoteRolloutReplica):
    """What verl's registry hands out for ``rollout.name=verl_remote``: the run's backend's own replica.

    verl's registry loaders take no arguments, so the backend is only known once verl builds a replica with
    the rollout config, whose ``custom`` section names it.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not BackendRolloutReplica:
            return super().__new__(cls)
        config = kwargs["config"] if "config" in kwargs else args[1]
        name = read_handoff(config).backend
        # Not an instance of this class, so Python does not call __init__ on it again.
        return load_rollout_class(name)(*args, **kwargs)
