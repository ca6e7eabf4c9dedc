"""Backends resolve by name inside Ray worker processes, after a plain `import verl`."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

# The tests folder is not importable in Ray workers: ship these functions by value.
import ray.cloudpickle
from omegaconf import OmegaConf

from verl_remote import load_backend_class

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _in_worker() -> dict[str, Any]:
    import os
    import sys

    import verl  # noqa: F401  (what every verl worker process does first)

    plugin = sys.modules.get("verl_remote.verl_plugin")
    from verl_remote import load_backend_class, load_rollout_class, load_worker_class

    return {
        "pid": os.getpid(),
        "plugin_loaded_by_verl": plugin is not None and plugin.is_registered(),
        "classes": [
            cls.__qualname__
            for cls in (load_backend_class("echo"), load_worker_class("echo"), load_rollout_class("echo"))
        ],
    }


def _reattach_and_sync(config: Any, handle: dict[str, Any]) -> int:
    from verl_remote import load_worker_class

    worker = load_worker_class("echo")(config, handle)
    asyncio.run(worker.backend.update_weights())
    return int(worker.backend.state()["weights_version"])


def _load_broken() -> None:
    from verl_remote import load_backend_class

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
