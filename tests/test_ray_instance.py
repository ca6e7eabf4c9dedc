"""The Ray instance ``verl-remote train`` starts for a run of its own: lean, as the tests' runs had it already (no
dashboard, no spare workers prestarted for the driver's first job: docs/measurements.md)."""

from __future__ import annotations

import os
from typing import Any

import psutil
import pytest


def _ours(word: str) -> list[str]:
    """The command lines of this process's descendants (its Ray instance's processes) that hold ``word``."""
    return [" ".join(argv) for argv in _descendants() if word in " ".join(argv)]


def _workers() -> list[str]:
    """The command lines of this process's Ray workers: "ray::IDLE" once a worker has named itself, before that
    Python running Ray's worker scripts (setup_worker.py, which starts default_worker.py), its first arguments (the
    raylet's own command line names them too, further on)."""
    scripts = ("/setup_worker.py", "/default_worker.py")
    return [
        " ".join(argv)
        for argv in _descendants()
        if argv[0].startswith("ray::IDLE") or any(arg.endswith(scripts) for arg in argv[1:3])
    ]


def _descendants() -> list[list[str]]:
    """The command lines (their arguments) of this process's descendants."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if argv:
            found.append(argv)
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
        # What is here when ray.init returns is all there will be, so no wait: Ray's raylet answers the first
        # driver's registration only once the workers it prestarts for that driver have registered, and ray.init
        # waits for the dashboard head's address, which the head publishes only after every module process it
        # starts is ready. (Without the dashboard Ray still runs its head process, for the job API, but none of its
        # modules.)
        assert bool(_ours("ray-dashboard-")) == bool(asked)
        assert _workers() == []
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
