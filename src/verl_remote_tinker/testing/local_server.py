"""SkyRL's open-source Tinker-API server, run locally for development and tests.

    python -m verl_remote_tinker.local_server [--port N] [--host 127.0.0.1] [--model PATH] [--python PY312]
                                              [--workdir DIR] [--sample-batch N]

starts the Tinker-API server of ``skyrl[tinker,jax]==0.4.0`` (JAX backend),
serving a small local model (by default the LoRA variant of verl-remote's demo
model, ``verl-remote://demo/lora-model``: see :mod:`verl_remote.demo.assets`), waits until
a client can create a LoRA training client on it, prints one ``ready`` line
with the URL to pass as ``remote_backend.base_url``, and stays in the
foreground until Ctrl-C or SIGTERM; then it stops everything it started.

Its own environment: :mod:`verl_remote_tinker.testing.server_env` builds it once and reuses it.

Why ``uv run``. SkyRL's API process starts its engine process itself, and it
finds the command for it in its own parent's command line:
``skyrl/tinker/api.py:_get_parent_uv_run_args`` reads
``psutil.Process(os.getppid()).cmdline()`` and refuses to start unless that is
``uv run <uv args> -m skyrl.tinker.api``; ``_build_uv_run_cmd_engine`` then
runs ``uv run <the same uv args> --extra tinker --extra jax -m
skyrl.tinker.engine ...`` (``uv`` looked up on ``PATH``). So the server is
launched as ``<venv>/bin/uv run --no-project --python <venv>/bin/python -m
skyrl.tinker.api ...`` with ``<venv>/bin`` first on ``PATH``; ``--no-project``
keeps uv from looking for a project or syncing anything (it warns that
``--extra`` has no effect then, which is harmless), and uv runs offline, with
no cache and no user configuration, so it never touches the network or writes
outside the work directory.

Readiness. ``/api/v1/healthz`` answers as soon as the API process is up,
before the engine subprocess has loaded the model: requests are queued in the
database and the engine picks them up only once its backend is built
(``skyrl/tinker/engine.py``: ``TinkerEngine.__init__`` then ``run``). The
server counts as ready when a LoRA model can actually be created: a probe
session creates a rank-1 LoRA model on the served model, waits for that future
to complete (``/api/v1/retrieve_future``), and unloads it again.

Speed on a CPU. SkyRL's JAX backend compiles its sampler for every batch
shape it meets: a batch of sampling requests is as many sequences as its
requests ask for, so without a fixed size nearly every batch of a run is a
new shape and costs a compilation (5 s on a 2-core machine, where sampling
the demo's 64 sequences then takes 0.4 s). The server is therefore started
with SkyRL's own ``sample_max_num_sequences`` (``--sample-batch``, default
64: a step of the demo): every batch is padded to that many sequences, one
shape, compiled once. JAX's persistent compilation cache
(``JAX_COMPILATION_CACHE_DIR``, default ``jax-cache`` beside the environment)
keeps the compiled programs for the next start.

The adapter. Clients reach the server through
:class:`~verl_remote_tinker.testing.proxy.TinkerProxy` on ``--port`` (SkyRL
itself listens on another port of 127.0.0.1): it adds what tinker SDKs from
0.26 on require and SkyRL 0.4.0 does not send, so that every SDK in
verl-remote-tinker's range can train against it (its docstring traces each
field to the SDK's code). It is a test aid in front of this server, not part of
the backend.

Stopping. The server runs in a session of its own (uv, the API process, the
engine's uv and the engine process). Stopping sends SIGTERM to the first uv,
which forwards it to the API process, whose shutdown stops the engine; after
a grace period whatever is left of the session gets SIGKILL, and stopping
returns when no process of that session remains.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl_remote import one_line
from verl_remote_tinker.testing.proxy import TinkerProxy
from verl_remote_tinker.testing.server_env import (
    ENV_NAME,
    LOG_TAIL_LINES,
    PREFIX,
    PYTHON_VERSION,
    SKYRL_VERSION,
    LocalServerError,
    default_cache_dir,
    ensure_server_env,
    env_ready,
    find_python312,
)
from verl_remote_tinker.testing.server_env import say as _say
from verl_remote_tinker.testing.server_env import tail as _tail

__all__ = [
    "SKYRL_VERSION",
    "LocalServer",
    "LocalServerError",
    "default_cache_dir",
    "ensure_server_env",
    "find_python312",
    "free_port",
    "main",
    "start_local_server",
]

#: SkyRL's ``sample_max_num_sequences``: sampling batches are padded to this many sequences (one compiled shape).
SAMPLE_BATCH = 64
#: Seconds between SIGTERM and SIGKILL when stopping.
STOP_GRACE = 10.0


# --- processes ---------------------------------------------------------------------------------------------------


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc (without /proc: its leader's group, if alive)."""
    pids: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sid, 0)
            pids.append(sid)
        return pids
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def _signal_session(sid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, sig)
    for pid in _session_pids(sid):  # any that moved to a process group of their own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class _NotReady(Exception):
    pass


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
    """GET (no body) or POST JSON; the decoded answer. Raises urllib's errors."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode() or "null")


class LocalServer:
    """A running SkyRL Tinker server and everything it started; a context manager that stops it."""

    url: str
    model: str
    workdir: Path
    log_path: Path
    pid: int

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        *,
        url: str,
        model: str,
        workdir: Path,
        owns_workdir: bool,
        proxy: TinkerProxy | None = None,
    ) -> None:
        self._process = process
        self.proxy = proxy
        self.url = url if proxy is None else proxy.url  # clients reach the server through the adapter
        self.model = model
        self.workdir = workdir
        self.log_path = workdir / "server.log"
        self.pid = process.pid
        self._owns_workdir = owns_workdir
        self._stopped = False
        atexit.register(self.stop)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalServer(url={self.url!r}, model={self.model!r}, pid={self.pid})"

    @property
    def returncode(self) -> int | None:
        """None while the server's first process runs, then its exit status."""
        return self._process.poll()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, lines)

    def stop(self) -> None:
        """Stop the server and every process it started (its whole session), and wait for them; idempotent."""
        if self._stopped:
            return
        # Marked stopped only at the end: if this is interrupted (a second Ctrl-C), the atexit hook finishes it.
        sid = self.pid  # started with start_new_session: the leader's pid is the session and group id
        if self._process.poll() is None:
            # uv forwards SIGTERM to the API process, whose shutdown stops the engine (api.py:_close_runtime).
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
        else:  # the server is gone already; anything it left behind gets the signal itself
            _signal_session(sid, signal.SIGTERM)
        if not self._wait_session_gone(sid, STOP_GRACE):
            _signal_session(sid, signal.SIGKILL)
            self._wait_session_gone(sid, STOP_GRACE)
        if self.proxy is not None:
            self.proxy.stop()
        self._stopped = True
        atexit.unregister(self.stop)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _log_lines_title(self) -> str:
        # A temporary work directory is deleted when the failed start is cleaned up: do not point at it.
        return "the last lines of its log" if self._owns_workdir else f"the last lines of {self.log_path}"

    def _wait_session_gone(self, sid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self._process.poll()  # reap the leader, so it does not linger as a zombie of ours
            if not _session_pids(sid):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def _probe(self, deadline: float) -> None:
        """Return once a LoRA model can be created; raise _NotReady while the server is not there yet."""
        api = f"{self.url}/api/v1"
        try:
            health = _http(f"{api}/healthz", timeout=5)
        except (OSError, ValueError) as exc:
            raise _NotReady(f"healthz: {exc}") from exc
        if not isinstance(health, dict) or health.get("status") != "ok":
            raise _NotReady(f"healthz answered {health!r}")
        session = _http(
            f"{api}/create_session",
            {
                "tags": ["verl-remote-tinker-readiness-probe"],
                "user_metadata": {},
                "sdk_version": f"verl-remote-tinker/{ENV_NAME}",
            },
        )
        created = _http(
            f"{api}/create_model",
            {"session_id": session["session_id"], "base_model": self.model, "lora_config": {"rank": 1, "seed": 0}},
        )
        self._wait_future(api, str(created["request_id"]), "creating a LoRA model", deadline)
        unloaded = _http(f"{api}/unload_model", {"model_id": created["model_id"]})
        self._wait_future(api, str(unloaded["request_id"]), "unloading the probe's LoRA model", deadline)

    def _wait_future(self, api: str, request_id: str, what: str, deadline: float) -> None:
        while True:
            self._check_alive()
            if time.monotonic() > deadline:
                raise LocalServerError(f"the server did not finish {what} in time")
            try:
                _http(f"{api}/retrieve_future", {"request_id": request_id}, timeout=30)
                return
            except urllib.error.HTTPError as exc:
                if exc.code == 408:  # the engine has not picked it up yet (it may still be loading the model)
                    continue
                detail = exc.read().decode(errors="replace")
                raise LocalServerError(f"the server failed {what}: HTTP {exc.code} {detail}") from exc
            except (TimeoutError, urllib.error.URLError) as exc:
                if isinstance(exc, urllib.error.URLError) and not isinstance(exc.reason, TimeoutError):
                    raise
                continue  # our own read timeout: the server holds retrieve_future until the result is there

    def _check_alive(self) -> None:
        code = self._process.poll()
        if code is not None:
            raise LocalServerError(
                f"the SkyRL Tinker server exited with status {code} while starting; "
                f"{self._log_lines_title()}:\n{self.log_tail()}"
            )

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "not probed yet"
        while True:
            self._check_alive()
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"the SkyRL Tinker server was not ready after {timeout:.0f}s ({last}); "
                    f"{self._log_lines_title()}:\n{self.log_tail()}"
                )
            try:
                self._probe(deadline)
                return
            except LocalServerError:
                raise
            except (_NotReady, OSError, ValueError, KeyError, TypeError) as exc:  # not up yet, or just died
                last = one_line(exc)
            time.sleep(0.5)


def _server_environment(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    # Compiled programs kept for the next start (see the module docstring), unless the user keeps them elsewhere.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(venv.parent / "jax-cache"))
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"  # the engine is started as `uv run`
    env["VIRTUAL_ENV"] = str(venv)
    env.update(
        UV_OFFLINE="1",  # nothing to resolve or download: --no-project with the venv's interpreter
        UV_NO_CACHE="1",
        UV_NO_CONFIG="1",
        UV_NO_ENV_FILE="1",
        UV_PYTHON_DOWNLOADS="never",
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("COLUMNS", "160")  # SkyRL logs through rich, which wraps lines at 80 columns in a file
    return env


def start_local_server(
    port: int | None = None,
    *,
    model: str | None = None,
    host: str = "127.0.0.1",
    workdir: Path | None = None,
    python: str | None = None,
    timeout: float = 300,
    sample_batch: int = SAMPLE_BATCH,
) -> LocalServer:
    """Start SkyRL's Tinker server and return it once a LoRA training client can be created on ``model``.

    ``port`` None picks a free one; ``model`` None serves verl-remote's demo
    model for LoRA (``lora-model``; a local directory is made absolute; anything else is a Hugging Face
    model id, which SkyRL downloads); ``workdir`` None uses a new temporary folder, deleted on stop (the
    database, checkpoints and ``server.log`` go there); ``python`` is the Python
    3.12 used if the environment has to be built; ``sample_batch`` the number of
    sequences every sampling batch is padded to (0: no padding, SkyRL's default;
    see the module docstring). Raises LocalServerError if it cannot start;
    nothing it started is left running then.
    """
    if sample_batch < 0:
        raise LocalServerError(f"sample_batch={sample_batch}: expected 0 (no padding) or a number of sequences")
    venv = ensure_server_env(python)
    if model is None:
        from verl_remote.demo.assets import ensure_demo_assets

        model = str(ensure_demo_assets().lora_model_path)
    elif Path(model).expanduser().exists():  # the server runs in the work directory: make a local path absolute
        model = str(Path(model).expanduser().resolve())
    elif model.startswith(("/", ".", "~")):
        raise LocalServerError(f"model {model}: no such directory")
    if port is None:
        port = free_port(host)
    try:  # the adapter clients talk to binds the port now; SkyRL listens on another one behind it
        proxy = TinkerProxy(f"http://127.0.0.1:{free_port('127.0.0.1')}", host=host, port=port)
    except OSError as exc:
        raise LocalServerError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    upstream = int(proxy.upstream.port or 0)
    owns_workdir = workdir is None
    work = Path(tempfile.mkdtemp(prefix="verl-remote-tinker-server-")) if workdir is None else workdir
    work = work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    command = [
        str(venv / "bin" / "uv"),
        "run",
        "--no-project",
        "--python",
        str(venv / "bin" / "python"),
        "-m",
        "skyrl.tinker.api",
        "--base-model",
        model,
        "--backend",
        "jax",
        "--host",
        "127.0.0.1",
        "--port",
        str(upstream),
        "--database-url",
        f"sqlite:///{work / 'tinker.db'}",
        "--checkpoints-base",
        str(work / "checkpoints"),
        "--backend-config",
        json.dumps({"sample_max_num_sequences": sample_batch}),
    ]
    with (work / "server.log").open("ab") as log, _closed_on_error(proxy):
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            command,
            cwd=work,
            env=_server_environment(venv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proxy.start()
    server = LocalServer(
        process,
        url=f"http://127.0.0.1:{upstream}",
        model=model,
        workdir=work,
        owns_workdir=owns_workdir,
        proxy=proxy,
    )
    try:
        server._wait_ready(timeout)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def _closed_on_error(proxy: TinkerProxy) -> Iterator[None]:
    try:
        yield
    except BaseException:
        proxy.stop()
        raise


# --- command line ------------------------------------------------------------------------------------------------


class _Stop(Exception):
    pass


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM, SIGHUP and SIGINT end the foreground loop, so that the server is stopped.

    SIGINT too: a shell starts a background job (``python -m verl_remote_tinker.local_server ... &``) with SIGINT
    ignored, and Python then never raises KeyboardInterrupt, so ``kill -INT`` would leave the server running.
    """

    def handler(signum: int, frame: types.FrameType | None) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verl_remote_tinker.local_server",
        description=(
            f"Run SkyRL's Tinker-API server (skyrl {SKYRL_VERSION}, JAX backend) locally on a small model, "
            "until Ctrl-C. The first use builds its Python 3.12 environment (a few minutes, then cached)."
        ),
    )
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument(
        "--model",
        default=None,
        help="model directory to serve (default: verl-remote's demo model for LoRA, verl-remote://demo/lora-model)",
    )
    parser.add_argument(
        "--python", default=None, help=f"the Python {PYTHON_VERSION} to build the environment with (default: found)"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the database, checkpoints and server.log here (default: a temporary folder, deleted on exit)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the server (default: 300)")
    parser.add_argument(
        "--sample-batch",
        type=int,
        default=SAMPLE_BATCH,
        help="pad every sampling batch to this many sequences, so that the sampler is compiled once "
        "(0: no padding; default: %(default)s, a step of verl-remote's demo)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sample_batch < 0:
        print(f"{PREFIX} error: --sample-batch {args.sample_batch}: expected 0 (no padding) or more", file=sys.stderr)
        return 2
    with _stop_on_signals():
        try:
            python = args.python
            if python is not None or not env_ready(default_cache_dir() / ENV_NAME):
                try:  # before anything else, so that a missing Python 3.12 is a one-line usage error
                    python = find_python312(args.python)
                except LocalServerError as exc:
                    print(f"{PREFIX} error: {exc}", file=sys.stderr)
                    return 2
            server = start_local_server(
                args.port,
                model=args.model,
                host=args.host,
                workdir=args.workdir,
                python=python,
                timeout=args.timeout,
                sample_batch=args.sample_batch,
            )
        except LocalServerError as exc:
            print(f"{PREFIX} error: {exc}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, _Stop):
            _say("interrupted before the server was ready")
            return 130
        with server:
            try:  # a signal may come as soon as the ready line is out
                print(
                    f"{PREFIX} SkyRL Tinker server ready at {server.url} (model {server.model}); "
                    f"train with: verl-remote train remote_backend=tinker remote_backend.base_url={server.url} "
                    f"actor_rollout_ref.model.path={server.model}",
                    flush=True,
                )
                while server.returncode is None:
                    time.sleep(0.5)
            except (KeyboardInterrupt, _Stop):
                _say("stopping the server")
                return 0
            print(
                f"{PREFIX} error: the server exited with status {server.returncode}; "
                f"the last lines of {server.log_path}:\n{server.log_tail()}",
                file=sys.stderr,
            )
            return 1


if __name__ == "__main__":
    sys.exit(main())
