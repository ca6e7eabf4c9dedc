"""Shared fixtures. The tests run against the real verl, Ray and Hydra.

They need the test backends under tests/packages installed into the same
environment (``nox -s tests`` does it); they fail, not skip, without them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_PACKAGES = ROOT / "tests" / "packages"
REQUIRED = ("verl-remote-echo-backend", "verl-remote-broken-backend", "verl-remote-faulty-backend")


def pytest_configure(config: pytest.Config) -> None:
    missing = []
    for dist in REQUIRED:
        try:
            version(dist)
        except PackageNotFoundError:
            missing.append(dist)
    if missing:
        raise pytest.UsageError(
            f"the test backends {missing} are not installed; run the tests with 'nox -s tests', "
            f"or pip install {' '.join(str(p) for p in sorted(TEST_PACKAGES.iterdir()))}"
        )


def run(
    *args: str | os.PathLike[str],
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command and capture its output; ``env`` replaces the whole environment when given."""
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd, check=False
    )


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``verl-remote`` console script, with ``env`` added to this environment."""
    script = shutil.which("verl-remote", path=str(Path(sys.executable).parent))
    assert script is not None, "the verl-remote console script is not installed in this environment"
    return run(script, *args, env={**os.environ, **(env or {})}, timeout=timeout, cwd=cwd)


def python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run Python code in a fresh interpreter of this environment, with ``env`` added to the environment."""
    return run(sys.executable, "-c", code, env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A real local Ray cluster for one test module, stopped at its end."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


# -- the Arctic test server (tests/arctic) ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def serving_test_server(generation: str, **flags: Any) -> Iterator[str]:
    """The Arctic test server (``create_app(generation, **flags)``) in this process; its URL, stopped on exit."""
    import uvicorn

    from verl_arctic.testing.server import create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(generation, **flags), host="127.0.0.1", port=port, log_level="critical")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the Arctic test server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(params=["v0.1", "main"])
def arctic_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(url, generation) of a running test server, stopped after the test."""
    with serving_test_server(str(request.param)) as url:
        yield url, str(request.param)


@pytest.fixture(scope="session")
def tinker_server() -> Iterator[Any]:
    """SkyRL's real Tinker-API server (``verl_tinker.local_server.LocalServer``), one for the test session.

    Its Python 3.12 environment is built on first use (minutes; then cached under
    ``~/.cache/verl-remote/tinker-server``); it serves verl-remote's demo model, which the runs also load.
    """
    from verl_tinker.local_server import start_local_server

    with start_local_server() as server:
        yield server


def steps(stdout: str) -> list[int]:
    """The training steps a run printed (verl's ``step:N`` lines), in order."""
    return [int(part.split(":")[1]) for part in stdout.split() if part.startswith("step:") and part[5:].isdigit()]


def read_until(proc: subprocess.Popen[str], marker: str) -> list[str]:
    """The lines of a background run's merged output up to the first holding ``marker``; fails if it ends first."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return seen
    raise AssertionError(f"the run ended before {marker!r}:\n" + "".join(seen[-40:]))


def processes_in(folder: Path) -> dict[int, str]:
    """Processes whose working directory is ``folder`` or below, pid -> command line.

    A run's driver, Ray's GCS, raylet and agents, and every Ray worker work in the folder the run was started
    in, so this finds what is left of a run started in a test's own folder, and nothing of other runs.
    """
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours
            continue
        if cwd == folder or folder in cwd.parents:
            found[int(entry.name)] = command
    return found


def faulty_calls(log: Path) -> list[str]:
    """The faulty test backend's lifecycle calls in ``log`` (its ``calls_log``), in order, without the process ids;
    none when it recorded nothing."""
    return [line.split(" pid=")[0] for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def ray_left_behind(tmp_path: Path) -> Any:
    """A function: the processes of runs started in this test's folder still alive after a grace period."""

    def left(grace_s: float = 20.0) -> dict[int, str]:
        deadline = time.monotonic() + grace_s  # workers exit shortly after their raylet
        while True:
            found = processes_in(tmp_path)
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    return left
