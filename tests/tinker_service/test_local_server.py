"""`python -m verl_remote_tinker.local_server` (verl_remote_tinker.testing.local_server): SkyRL's Tinker-API server
run locally, and stopped with everything it started.

The tests marked ``tinker`` start the real server (skyrl 0.4.0, JAX backend, on
the CPU) on its default model, verl-remote's demo model for LoRA. Its Python 3.12
environment is built on first use (a few minutes, some GB, then cached outside the
checkout).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from verl_remote_tinker.testing.local_server import STOP_GRACE, LocalServerError, find_python312, start_local_server


def session_processes(sid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of session ``sid``."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((host, port)) == 0


def wait_gone(sid: int, timeout: float = 10) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_find_python312_rejects_a_bad_explicit_path() -> None:
    message = r"^--python /nonexistent/python3.12: not found; .*Python 3.12.*--python"
    with pytest.raises(LocalServerError, match=message):
        find_python312("/nonexistent/python3.12")


def test_cli_without_python312_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "verl_remote_tinker.local_server", "--python", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("verl-remote-tinker: error: --python /nonexistent: not found;")
    assert "VERL_REMOTE_TINKER_PYTHON" in lines[0]


def test_a_negative_sample_batch_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "verl_remote_tinker.local_server", "--sample-batch", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "verl-remote-tinker: error: --sample-batch -1: expected 0 (no padding) or more"
    ]
    with pytest.raises(LocalServerError, match=r"^sample_batch=-1: expected 0 \(no padding\) or a number"):
        start_local_server(sample_batch=-1)


@pytest.mark.tinker
def test_cli_runs_until_sigint_and_leaves_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    process = subprocess.Popen(
        [sys.executable, "-m", "verl_remote_tinker.local_server", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that everything it starts can be found, and killed if the test fails
    )
    server_sessions: set[int] = set()
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()  # the ready line is its first line on stdout
        assert ready.startswith("verl-remote-tinker: SkyRL Tinker server ready at http://127.0.0.1:"), (
            ready,
            process.stderr.read() if process.poll() is not None and process.stderr else "",
        )
        url = ready.split(" ready at ", 1)[1].split()[0]
        assert f"remote_backend.base_url={url}" in ready
        model = ready.split("(model ", 1)[1].split(")", 1)[0]
        # By default the demo's model for LoRA, which the printed command trains.
        assert Path(model).name == "lora-model" and f"actor_rollout_ref.model.path={model}" in ready, ready
        # Ready means the engine has the model loaded: a LoRA training client is made at once.
        import tinker

        service = tinker.ServiceClient(base_url=url, api_key="tml-local")
        started = time.monotonic()
        service.create_lora_training_client(base_model=model, rank=8, seed=0)
        assert time.monotonic() - started < 60
        service.holder.close()  # the SDK's session heartbeat, which would outlive the server
        port = int(url.rsplit(":", 1)[1])
        assert listening("127.0.0.1", port)
        server_sessions.update(os.getsid(p.pid) for p in psutil.Process(process.pid).children(recursive=True))
        server_sessions.discard(process.pid)
        assert len(server_sessions) == 1  # the server runs in a session of its own
        # SkyRL's engine pads every sampling batch to the demo's step (one shape, compiled once) and keeps what
        # JAX compiles beside the environment, for the next start.
        (engine,) = [
            p
            for p in session_processes(*server_sessions)
            if "skyrl.tinker.engine" in p.cmdline() and Path(p.cmdline()[0]).name.startswith("python")
        ]
        assert '"sample_max_num_sequences": 64' in " ".join(engine.cmdline())
        assert engine.environ()["JAX_COMPILATION_CACHE_DIR"].endswith("/jax-cache")

        process.send_signal(signal.SIGINT)
        # Stopping waits STOP_GRACE for SkyRL's own shutdown, then kills what is left and waits again.
        assert process.wait(timeout=2 * STOP_GRACE + 30) == 0
        (server_sid,) = server_sessions
        assert wait_gone(server_sid, timeout=1) == []
        assert wait_gone(process.pid, timeout=1) == []
        assert not listening("127.0.0.1", port)
        assert (workdir / "server.log").is_file()  # a given work directory is kept
    finally:
        for sid in (process.pid, *server_sessions):  # only if the test failed: nothing is left otherwise
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sid, signal.SIGKILL)
        process.wait()
