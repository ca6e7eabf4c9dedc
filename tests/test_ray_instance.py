"""The Ray instance ``verl-remote train`` starts for a run of its own: lean, as the tests' runs had it already (no
dashboard, no spare workers prestarted for the driver's first job: docs/measurements.md)."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil
import pytest


def _ours(word: str) -> list[str]:
    """The command lines of this process's descendants (its Ray instance's processes) that hold ``word``."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if word in command:
            found.append(command)
    return found


@pytest.mark.parametrize("asked", [[], ["+ray_kwargs.ray_init.include_dashboard=true"]], ids=["default", "asked"])
def test_a_runs_own_ray_instance_starts_without_a_dashboard_or_spare_workers_unless_asked(asked: list[str]) -> None:
    import ray

    from verl_remote.cli.run import _ray_init
    from verl_remote.discovery.compose import compose_config

    saved = dict(os.environ)
    for name in ("RAY_prestart_worker_first_driver", "RAY_ADDRESS"):  # the tests' conftest sets the first
        os.environ.pop(name, None)
    config: Any = compose_config(asked, recipe="demo")
    try:
        _ray_init(config)
        time.sleep(2)  # Ray prestarts its spare workers as the driver connects
        # (Without the dashboard Ray still runs its head process, for the job API, but none of its modules.)
        assert bool(_ours("ray-dashboard-")) == bool(asked)
        assert _ours("ray::IDLE") == []
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
