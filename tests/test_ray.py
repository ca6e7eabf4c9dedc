"""Backends resolve by name inside Ray worker processes, after a plain `import verl`."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# The tests folder is not importable in Ray workers: ship these functions by value.
import ray.cloudpickle
from omegaconf import OmegaConf

from conftest import faulty_calls, live_actors
from verl_remote.discovery.registry import load_backend_class

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _in_worker() -> dict[str, Any]:
    import os
    import sys

    import verl  # noqa: F401  (what every verl worker process does first)

    plugin = sys.modules.get("verl_remote.integration.verl_plugin")
    from verl_remote.discovery.registry import load_backend_class, load_rollout_class, load_worker_class

    return {
        "pid": os.getpid(),
        "plugin_loaded_by_verl": plugin is not None and plugin.is_registered(),
        "classes": [
            cls.__qualname__
            for cls in (load_backend_class("echo"), load_worker_class("echo"), load_rollout_class("echo"))
        ],
    }


def _reattach_and_sync(config: Any, handle: dict[str, Any]) -> int:
    from verl_remote.discovery.registry import load_worker_class

    worker = load_worker_class("echo")(config, handle)
    asyncio.run(worker.backend.update_weights())
    return int(worker.backend.state()["weights_version"])


def _load_broken() -> None:
    from verl_remote.discovery.registry import load_backend_class

    load_backend_class("broken")


def test_a_ray_worker_resolves_backends_by_name(ray_cluster: Any) -> None:
    import os

    seen = ray_cluster.get(ray_cluster.remote(_in_worker).remote(), timeout=120)
    assert seen["pid"] != os.getpid()
    assert seen["plugin_loaded_by_verl"] is True
    assert seen["classes"] == ["EchoBackend", "EchoWorker", "EchoReplica"]


def test_workers_reattach_to_the_driver_backend_through_its_handle(ray_cluster: Any, tmp_path: Path) -> None:
    config = OmegaConf.create({"remote_backend": {"name": "echo", "state_dir": str(tmp_path)}})
    backend = load_backend_class("echo").from_config(config)
    versions = ray_cluster.get(
        [ray_cluster.remote(_reattach_and_sync).remote(config, backend.reconnect_handle()) for _ in range(2)],
        timeout=120,
    )
    assert sorted(versions) == [1, 2]
    assert backend.state()["weights_version"] == 2  # type: ignore[attr-defined]


def test_a_broken_backend_fails_in_the_worker_with_the_same_message(ray_cluster: Any) -> None:
    with pytest.raises(
        Exception, match="entry point 'broken = verl_remote_broken_backend.needs_missing_dep:SPEC'"
    ) as info:
        ray_cluster.get(ray_cluster.remote(_load_broken).remote(), timeout=120)
    assert "from verl-remote-broken-backend 0.2.0 failed to import" in str(info.value)


class _Counter:
    """A service: state that every process re-attaching to it shares."""

    def __init__(self, start: int) -> None:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self.value = start

    def add(self, n: int) -> int:
        self.value += n
        return self.value


def _add_through_handle(handle: dict[str, Any]) -> tuple[int, int]:
    import os

    from verl_remote.kit.service import RayService

    return os.getpid(), ray.get(RayService.from_handle(handle).actor().add.remote(1))


@pytest.mark.faults
def test_a_ray_service_is_started_once_found_by_name_elsewhere_and_stopped(
    ray_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from verl_remote.kit.service import RayService, ServiceStartError, resources

    service = RayService.start(_Counter, 10, prefix="counter", num_cpus=0)
    assert service.name.startswith("counter_") and service.namespace == ray_cluster.get_runtime_context().namespace
    handle = service.handle()
    assert OmegaConf.create(handle) == handle  # plain data: crosses processes and configs
    pid, value = ray_cluster.get(ray_cluster.remote(_add_through_handle).remote(handle), timeout=120)
    assert pid != os.getpid() and value == 11
    assert ray_cluster.get(service.actor().add.remote(1)) == 12

    service.stop()
    service.stop()  # idempotent, as destroy must be
    with pytest.raises(ValueError, match=r"the backend's service 'counter_\w+' .* is gone"):
        service.actor()

    # A constructor that raises fails the start, on the caller's side, in the constructor's words.
    with pytest.raises(ServiceStartError, match="_Counter failed to start: ValueError: start must be >= 0, got -1$"):
        RayService.start(_Counter, -1, num_cpus=0)

    # A GPU no node has is refused at once, and a service Ray cannot place in its time is stopped: neither is a
    # transient fault (a restart would wait for the same GPU, or as long again).
    from verl_remote import is_transient
    from verl_remote.kit import service as service_module

    with pytest.raises(ServiceStartError, match=r"_Counter asks for 1 GPU and the Ray cluster has 0: ") as refused:
        RayService.start(_Counter, 0, num_cpus=0, num_gpus=1)
    assert not is_transient(refused.value)
    monkeypatch.setattr(service_module, "START_TIMEOUT_S", 1.0)
    unplaced = {"resources": {"verl_remote_no_such_resource": 1}}
    with pytest.raises(ServiceStartError, match=r"_Counter did not start within 1 s \(Ray could not place it") as late:
        RayService.start(_Counter, 0, prefix="unplaced", num_cpus=0, options=unplaced)
    assert not is_transient(late.value)
    deadline = time.monotonic() + 30  # killed: its name goes once Ray has it
    while any(a["name"].startswith("unplaced") for a in ray_cluster.util.list_named_actors(all_namespaces=True)):
        assert time.monotonic() < deadline, "the unplaced service was left waiting"
        time.sleep(0.2)

    assert resources(OmegaConf.create({"num_cpus": 2})) == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert resources({}) == {"num_cpus": 1.0, "num_gpus": 0.0}


@pytest.mark.faults  # refused before the backend is made: no model loads (the quick tier)
def test_under_verls_launcher_the_trainer_refuses_two_forwarders_for_a_single_forwarder_backend(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """`verl-remote train` refuses this layout before Ray starts (tests/test_train.py); verl's own launcher has no
    such check, so the trainer refuses it, before it makes the backend: nothing is made, nothing to destroy."""
    from verl_remote.demo import resolve_demo_assets
    from verl_remote.discovery.compose import compose_config
    from verl_remote.integration.trainer import RemotePPOTrainer, SingleForwarderError

    calls = tmp_path / "calls.txt"
    config = compose_config(
        ["remote_backend=faulty", f"remote_backend.calls_log={calls}", "trainer.n_gpus_per_node=2"], recipe="demo"
    )
    resolve_demo_assets(config)
    with pytest.raises(
        SingleForwarderError,
        match=r"^backend 'faulty' needs exactly one forwarder worker, but trainer.n_gpus_per_node \* trainer.nnodes "
        r"= 2: set trainer.n_gpus_per_node=1 trainer.nnodes=1$",
    ):
        RemotePPOTrainer(config)
    assert faulty_calls(calls) == []
    assert live_actors() == []


@pytest.mark.train  # the trainer makes the backend: the local engine loads the demo's model in a Ray worker
def test_once_the_driver_destroys_the_backend_the_loop_makes_no_further_call_to_it(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """Ctrl-C or SIGTERM on the driver destroys the backend from the TaskRunner's second thread while its loop may be
    mid-step: the loop's next sync, save, validation or step stops there instead of calling a destroyed backend."""
    from verl_remote.demo import resolve_demo_assets
    from verl_remote.discovery.compose import compose_config
    from verl_remote.integration.trainer import RemotePPOTrainer, RunStopped

    calls = tmp_path / "calls.txt"
    config = compose_config(["remote_backend=faulty", f"remote_backend.calls_log={calls}"], recipe="demo")
    resolve_demo_assets(config)
    trainer = RemotePPOTrainer(config)
    trainer.destroy_backend()
    for call in (
        trainer.on_step_end,
        trainer._save_checkpoint,
        trainer._validate,
        lambda: trainer._step_once({}, {}, 1),
    ):
        with pytest.raises(RunStopped, match=r"^the run is stopping: backend 'faulty' is destroyed$"):
            call()
    trainer.destroy_backend()  # the loop's own `finally`: once is enough
    assert faulty_calls(calls) == ["destroy"]
    assert live_actors() == []
