"""The environment SkyRL's Tinker server runs in, apart from verl's: Python 3.12 found on this machine, and a
virtual environment built once and reused.

SkyRL 0.4.0 requires Python >=3.12 and pulls JAX and
CUDA builds of torch, none of which belongs in verl's environment. A virtual
environment is built once (about 2-3 minutes, some GB) with a Python 3.12
interpreter found on this machine (``--python``, ``$VERL_REMOTE_TINKER_PYTHON``,
``python3.12`` on ``PATH``, then pyenv's versions), under
``$VERL_REMOTE_TINKER_SERVER_CACHE`` (default ``~/.cache/verl-remote/tinker-server``),
outside any checkout, and reused. It is built in a staging folder under a file
lock and moved into place with a ``COMPLETE`` marker, so an interrupted or
concurrent build never leaves a half-built environment in use. Because it was
moved, its console scripts are stale: only ``bin/python`` and ``bin/uv`` (a
binary) are run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = [
    "ENV_NAME",
    "LOG_TAIL_LINES",
    "PREFIX",
    "PYTHON_VERSION",
    "SKYRL_VERSION",
    "TINKER_VERSION",
    "LocalServerError",
    "default_cache_dir",
    "ensure_server_env",
    "env_ready",
    "find_python312",
    "say",
    "tail",
]

SKYRL_VERSION = "0.4.0"
TINKER_VERSION = "0.25.0"
PYTHON_VERSION = "3.12"
#: Bump when the requirements or the layout change, so an old environment is not reused.
ENV_VERSION = "1"
ENV_NAME = f"skyrl-{SKYRL_VERSION}-py{PYTHON_VERSION}-v{ENV_VERSION}"
#: skyrl 0.4.0's api imports aiohttp without declaring it; uv launches the server (see local_server's docstring).
REQUIREMENTS = (f"skyrl[tinker,jax]=={SKYRL_VERSION}", f"tinker=={TINKER_VERSION}", "aiohttp", "uv")

PYTHON_ENV_VAR = "VERL_REMOTE_TINKER_PYTHON"
CACHE_ENV_VAR = "VERL_REMOTE_TINKER_SERVER_CACHE"
PREFIX = "verl-remote-tinker:"
HOW_TO_GET_PYTHON = (
    f"install Python {PYTHON_VERSION} (e.g. `pyenv install {PYTHON_VERSION}`, `uv python install {PYTHON_VERSION}` "
    f"or your OS's python{PYTHON_VERSION} and python{PYTHON_VERSION}-venv packages) and pass "
    f"--python /path/to/python{PYTHON_VERSION} or set ${PYTHON_ENV_VAR}"
)
LOG_TAIL_LINES = 40


class LocalServerError(RuntimeError):
    """The local Tinker server could not be set up or started."""


def say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


# --- Python 3.12 -------------------------------------------------------------------------------------------------


def _check_python(candidate: str) -> str | None:
    """Why ``candidate`` is not a usable Python 3.12 with venv support, or None if it is."""
    path = shutil.which(candidate) if os.sep not in candidate else candidate
    if path is None or not os.path.isfile(path):
        return "not found"
    if not os.access(path, os.X_OK):
        return "not executable"
    code = "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"
    try:
        result = subprocess.run([path, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"does not run ({exc})"
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        # A traceback ends with the error (no ensurepip); a pyenv shim or a shell says it first.
        why = (lines[-1] if lines[0].startswith("Traceback") else lines[0]) if lines else f"exit {result.returncode}"
        return f"does not run or lacks venv/ensurepip ({why})"
    found = result.stdout.strip()
    if found != PYTHON_VERSION:
        return f"is Python {found}, not {PYTHON_VERSION}"
    return None


def _pyenv_roots() -> list[Path]:
    roots: list[Path] = []
    if os.environ.get("PYENV_ROOT"):
        roots.append(Path(os.environ["PYENV_ROOT"]))
    pyenv = shutil.which("pyenv")
    if pyenv is not None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            result = subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=30, check=False)
            if result.returncode == 0 and result.stdout.strip():
                roots.append(Path(result.stdout.strip()))
    roots.append(Path.home() / ".pyenv")
    unique: list[Path] = []
    for root in roots:
        if root not in unique:
            unique.append(root)
    return unique


def _version_key(path: Path) -> tuple[int, ...]:
    # .../versions/3.12.1/bin/python3.12 -> (3, 12, 1); non-numeric parts (3.12-dev) sort first.
    parts = path.parent.parent.name.split(".")
    return tuple(int(p) if p.isdigit() else -1 for p in parts)


def find_python312(explicit: str | None = None) -> str:
    """A Python 3.12 interpreter to build the server's environment with.

    ``explicit`` (``--python``) or ``$VERL_REMOTE_TINKER_PYTHON`` is used as given, and
    an error if unusable; otherwise the first usable of ``python3.12`` on
    ``PATH`` (a pyenv shim for a version that is not active does not run, and is
    skipped) and pyenv's ``versions/3.12*/bin/python3.12``, newest first.
    """
    if explicit is None and os.environ.get(PYTHON_ENV_VAR):
        explicit, origin = os.environ[PYTHON_ENV_VAR], f"${PYTHON_ENV_VAR}"
    else:
        origin = "--python"
    if explicit is not None:
        problem = _check_python(explicit)
        if problem is not None:
            raise LocalServerError(
                f"{origin} {explicit}: {problem}; SkyRL's Tinker server needs Python {PYTHON_VERSION}: "
                f"{HOW_TO_GET_PYTHON}"
            )
        return explicit if os.sep in explicit else (shutil.which(explicit) or explicit)

    tried: list[str] = []
    candidates: list[str] = []
    on_path = shutil.which(f"python{PYTHON_VERSION}")
    if on_path is not None:
        candidates.append(on_path)
    for root in _pyenv_roots():
        found = sorted(root.glob(f"versions/{PYTHON_VERSION}*/bin/python{PYTHON_VERSION}"), key=_version_key)
        candidates.extend(str(p) for p in reversed(found))
    for candidate in candidates:
        problem = _check_python(candidate)
        if problem is None:
            return candidate
        tried.append(f"{candidate} ({problem})")
    searched = "; ".join(tried) if tried else f"no python{PYTHON_VERSION} on PATH or in pyenv"
    raise LocalServerError(
        f"SkyRL's Tinker server needs Python {PYTHON_VERSION} and none was found ({searched}): {HOW_TO_GET_PYTHON}"
    )


# --- the server's environment ------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where server environments are kept: ``$VERL_REMOTE_TINKER_SERVER_CACHE``, else under the user's cache folder."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "verl-remote" / "tinker-server"


def env_ready(root: Path) -> bool:
    # The venv's python links to the interpreter it was built with; if that is gone the venv is dead.
    return (root / "COMPLETE").is_file() and (root / "venv" / "bin" / "python").exists()


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _build_step(args: list[str], log: Path, what: str) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(args)}\n")
        out.flush()
        result = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    if result.returncode != 0:
        raise LocalServerError(
            f"building the Tinker server environment failed while {what} (exit status {result.returncode}); "
            f"log: {log}; its last lines:\n{tail(log)}"
        )


def _build(staging: Path, python: str, log: Path) -> None:
    venv = staging / "venv"
    vpython = str(venv / "bin" / "python")
    say(f"creating a Python {PYTHON_VERSION} virtual environment with {python}")
    _build_step([python, "-m", "venv", str(venv)], log, "creating the virtual environment")
    say(f"installing {', '.join(REQUIREMENTS)} (pip's output: {log})")
    pip = [vpython, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _build_step([*pip, "install", "--progress-bar", "off", *REQUIREMENTS], log, "installing the requirements")
    say("checking that the server and its engine import")
    _build_step(
        [vpython, "-c", "import aiohttp, jax, skyrl.tinker.api, skyrl.tinker.engine, skyrl.backends.jax"],
        log,
        "importing the server",
    )
    _build_step([str(venv / "bin" / "uv"), "--version"], log, "running uv")
    (staging / "COMPLETE").write_text(f"{ENV_NAME}\n{python}\n")


def ensure_server_env(python: str | None = None) -> Path:
    """The server's virtual environment (its folder), built on first use and reused.

    ``python`` is the Python 3.12 to build it with (see :func:`find_python312`);
    it is only looked for when the environment has to be built.
    """
    cache = default_cache_dir()
    root = cache / ENV_NAME
    if env_ready(root):
        return root / "venv"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f".{ENV_NAME}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it, then reuse its work
        if env_ready(root):
            return root / "venv"
        interpreter = find_python312(python)
        log = cache / f"{ENV_NAME}.build.log"
        log.write_text("")
        started = time.monotonic()
        say(f"building SkyRL's Tinker server environment in {root} (first use, about 2-3 minutes)")
        staging = Path(tempfile.mkdtemp(prefix=f".{ENV_NAME}-staging-", dir=cache))
        try:
            _build(staging, interpreter, log)
            if root.exists():  # a half-built or dead earlier one
                shutil.rmtree(root)
            os.replace(staging, root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        say(f"environment ready in {time.monotonic() - started:.0f}s")
    return root / "venv"
