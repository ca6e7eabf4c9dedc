"""Launching the Arctic service a recipe names in ``remote_backend.comms.launch``: the port checked free, the
command started (under this interpreter when it says ``python``) in a process group of its own and with the
environment it needs (this process's, less the credentials of the user's shell: ``comms.launch_env`` names those
it needs), its stderr relayed to the run's log, the wait until it answers ``/health``, and its end with the whole
group (:func:`stop_server`: a shell script's children too).

Only a command the user gave starts: a run's recorded settings (``verl-remote export`` reads them from the run
folder) never do (``ArcticBackend.program_settings``)."""

from __future__ import annotations

import collections
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from verl_remote import service_environment

__all__ = ["LaunchTimeoutError", "launch_argv", "launch_server", "require_free_port", "stop_server"]


class LaunchTimeoutError(TimeoutError):
    """A launched server that was not healthy within its start-up time: never a transient fault
    (``verl_remote.is_transient`` reads ``transient``), as a restart would wait as long again."""

    transient = False


#: How long a launched service has to end after SIGTERM before its group gets SIGKILL.
STOP_GRACE_S = 30.0


def require_free_port(url: str) -> None:
    """The port of ``url`` must be free for a launched service: otherwise it could not listen there, and the
    run would talk to whatever does."""
    import socket

    port = httpx.URL(url).port or 80
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            raise ValueError(
                f"remote_backend.comms.url={url}: port {port} is already taken, so the service that "
                "remote_backend.comms.launch starts could not listen there and the run would talk to whatever "
                "does; stop that process or give the launch command and the url another port"
            ) from None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM the launched server when the process that launched it dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class _Tail:
    lines: collections.deque[str]
    done: threading.Event


def _relay_stderr(proc: subprocess.Popen[bytes], keep: int = 15) -> _Tail:
    """Pass the launched server's stderr on to this process's (the run's log) and keep its last lines."""
    tail = _Tail(collections.deque(maxlen=keep), threading.Event())

    def relay() -> None:
        assert proc.stderr is not None
        try:
            for raw in iter(proc.stderr.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                tail.lines.append(line)
                print(line, file=sys.stderr, flush=True)
        finally:
            tail.done.set()

    threading.Thread(target=relay, name="arctic-server-stderr", daemon=True).start()
    return tail


def launch_argv(command: str) -> list[str]:
    """``command`` as the program and arguments to start, the program found: ``python`` is the interpreter
    verl-remote runs under, with verl-arctic installed, not whichever is first on PATH (a virtual environment
    used by its path, not activated, is not on it). ``ValueError`` naming the setting for a command that is
    empty, not split by shell rules, or whose program is not there or cannot be run."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"remote_backend.comms.launch={command!r}: cannot split it as a shell would ({exc})") from None
    if not argv:
        raise ValueError("remote_backend.comms.launch is empty: give the command that starts the service, or null")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
        return argv
    found = shutil.which(argv[0])
    if found is None:
        where = "no such file" if os.sep in argv[0] else "not found on PATH"
        if os.sep in argv[0] and os.path.exists(argv[0]):
            where = "not executable (chmod +x it, or start the command with its interpreter)"
        raise ValueError(
            f"remote_backend.comms.launch={command!r}: the program {argv[0]!r} is {where}; give the command that "
            "starts the Arctic service (python -m ... runs under verl-remote's interpreter), or null for a service "
            "already running"
        )
    argv[0] = found
    return argv


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """End a service :func:`launch_server` started, with every process of its group (what a shell script or a
    server's workers started): SIGTERM, and SIGKILL to what is left after ``grace_s``. Idempotent."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)  # the group is the service's own (start_new_session): its pgid is its pid
        if signum == signal.SIGKILL:
            break
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(proc.pid):
            return
        deadline = time.monotonic() + grace_s  # the leader ended; give what it started the same grace
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launch_server(command: str, url: str, timeout: float, keep_env: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start the Arctic service with ``command`` and wait until ``url``/health answers.

    The port must be free first: otherwise the launched service cannot listen and whatever already does
    would answer in its place. The service runs in a session and process group of its own (a Ctrl-C to the run
    does not reach it: the run stops it, with :func:`stop_server`), with this process's environment less the
    variables whose names look like credentials, but for ``keep_env``.
    """
    require_free_port(url)
    argv = launch_argv(command)
    proc = subprocess.Popen(
        argv,
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent,
        start_new_session=True,
        env=service_environment(keep_env),
    )
    tail = _relay_stderr(proc)
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            proc.wait()
            tail.done.wait(timeout=5)
            last = "\n".join(tail.lines) or "(nothing on stderr)"
            raise RuntimeError(
                f"the Arctic server command {command!r} exited with code {code} before becoming healthy; "
                f"its last lines on stderr:\n{last}"
            )
        try:
            with httpx.stream("GET", f"{url.rstrip('/')}/health", timeout=2) as answer:  # its body unread
                if answer.status_code == 200:
                    return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise LaunchTimeoutError(
                f"the Arctic server started with {command!r} was not healthy at {url} after {timeout:.0f}s; "
                "raise remote_backend.comms.startup_timeout_s if it needs longer"
            )
        time.sleep(0.5)
