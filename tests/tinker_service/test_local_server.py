"""verl_tinker.local_server: SkyRL's Tinker-API server run locally, and stopped with everything it started.

The tests marked ``tinker`` start the real server (skyrl 0.4.0, JAX backend, on
the CPU) on verl-remote's demo model. Its Python 3.12 environment is built on
first use (a few minutes, some GB, then cached outside the checkout).
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

from verl_tinker.local_server import STOP_GRACE, LocalServerError, find_python312, start_local_server


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
        [sys.executable, "-m", "verl_tinker.local_server", "--python", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("verl-tinker: error: --python /nonexistent: not found;")
    assert "VERL_TINKER_PYTHON" in lines[0]


@pytest.mark.tinker
def test_server_trains_a_lora_client_and_stops_everything() -> None:
    import numpy as np
    import tinker
    from tinker import types

    server = start_local_server()
    try:
        host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
        processes = session_processes(server.pid)
        commands = [" ".join(p.cmdline()) for p in processes]
        assert any("skyrl.tinker.api" in c for c in commands), commands
        assert any("skyrl.tinker.engine" in c for c in commands), commands  # the engine is in the same session

        service = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
        started = time.monotonic()
        training = service.create_lora_training_client(base_model=server.model, rank=8, seed=0)
        assert time.monotonic() - started < 60  # ready means the engine has the model loaded
        tokens = [5, 9, 12, 7, 3, 8, 10, 11]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                "weights": types.TensorData(data=[0.0] * 4 + [1.0] * 3, dtype="float32"),
            },
        )
        out = training.forward([datum], "cross_entropy").result()
        logprobs = np.asarray(out.loss_fn_outputs[0]["logprobs"].data)
        assert logprobs.shape == (7,)
        assert np.isfinite(logprobs).all() and (logprobs <= 0).all()
        service.holder.close()  # the SDK's session heartbeat, which would outlive the server
    finally:
        server.stop()
    assert wait_gone(server.pid, timeout=1) == []
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
    assert not listening(host, port)
    assert not server.workdir.exists()  # a temporary work directory is removed
    server.stop()  # idempotent


@pytest.mark.tinker
def test_cli_runs_until_sigint_and_leaves_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    process = subprocess.Popen(
        [sys.executable, "-m", "verl_tinker.local_server", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that everything it starts can be found, and killed if the test fails
    )
    server_sessions: set[int] = set()
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()  # the ready line is its first line on stdout
        assert ready.startswith("verl-tinker: SkyRL Tinker server ready at http://127.0.0.1:"), (
            ready,
            process.stderr.read() if process.poll() is not None and process.stderr else "",
        )
        url = ready.split(" ready at ", 1)[1].split()[0]
        assert f"remote_backend.base_url={url}" in ready
        port = int(url.rsplit(":", 1)[1])
        assert listening("127.0.0.1", port)
        server_sessions.update(os.getsid(p.pid) for p in psutil.Process(process.pid).children(recursive=True))
        server_sessions.discard(process.pid)
        assert len(server_sessions) == 1  # the server runs in a session of its own

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
