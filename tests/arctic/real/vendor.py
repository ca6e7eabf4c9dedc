"""Arctic's own code, pinned, in its own environment, and its real HTTP server started on CPU.

Arctic Platform pins ``transformers<5`` (0.1.2) while verl 0.9 needs ``>=5.5.3``,
so Arctic's code never enters verl's environment. This module (which runs in
the test environment) builds, once, a separate virtual environment holding
Arctic's dependencies (torch's CPU build, transformers 4, DeepSpeed, Ray,
Triton, FastAPI) and unpacks the pinned Arctic releases beside it, each in its
own folder, put on ``PYTHONPATH`` only for the server that uses it:

- generation ``v0.1``: ``arctic-platform==0.1.2`` (its ``rl/http_server.py``),
  with the pure-Python parts of ``arctic-inference==0.2.0``;
- generation ``main``: ``arctic-platform==0.1.4`` (``common/http_server.py``),
  with ``arctic-inference==0.3.0``.

The environment lives under ``$VERL_REMOTE_TEST_CACHE`` (default
``~/.cache/verl-remote/test-envs``), outside any checkout, and is reused
between runs; building it takes a few minutes and prints its progress.
``harness/serve.py`` is what runs inside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
SERVE = HERE / "harness" / "serve.py"

#: Bump when the pins below change, so an old environment is not reused.
HARNESS_VERSION = "3"

#: The Arctic releases whose code is run, per protocol generation.
ARCTIC_PLATFORM = {"v0.1": "0.1.2", "main": "0.1.4"}
ARCTIC_INFERENCE = {"v0.1": "0.2.0", "main": "0.3.0"}

#: Each release's file on the package index and its sha256, as the index lists them.
FILES = {
    ("arctic-platform", "0.1.2"): (
        "arctic_platform-0.1.2-py3-none-any.whl",
        "61e3cfe6c42e1957771d48edcbebdf6cdc7f92478245100c5a089e198f33f6f9",
    ),
    ("arctic-platform", "0.1.4"): (
        "arctic_platform-0.1.4-py3-none-any.whl",
        "c8fbf2cac3731cd111e1a37130e5a66ea9f455feea9eba3998fdd9549027537c",
    ),
    ("arctic-inference", "0.2.0"): (
        "arctic_inference-0.2.0.tar.gz",
        "242755ae3662527dd842b4c3bd0c921e5a969e270daff0c9436b412505af4c4d",
    ),
    ("arctic-inference", "0.3.0"): (
        "arctic_inference-0.3.0.tar.gz",
        "7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36",
    ),
}
INDEX = os.environ.get("VERL_REMOTE_INDEX_URL", "https://pypi.org/simple")

#: Arctic's runtime dependencies, pinned. torch 2.13.0 is the CPU build; DeepSpeed
#: runs on its CPU accelerator; Triton is imported (not used) by Arctic's ZoRRO code. The venv is
#: built in a staging folder and moved, so its console scripts are stale: always run ``python -m``.
REQUIREMENTS = [
    "torch==2.13.0",
    "transformers==4.57.6",
    "ray==2.60.0",
    "triton==3.9.0",
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "pydantic==2.14.4",
    "pydantic-settings>=2.0",
    "safetensors==0.8.0",
    "tensordict==0.15.3",
    "numpy==2.4.6",
    "psutil",
    "typing-extensions",
    # 0.1.4 refuses to import without its sft/rl extras present (model/__init__.py:19).
    "aiohttp==3.14.5",
    "liger-kernel==0.8.5",
    "nvidia-ml-py==13.615.71",
]
DEEPSPEED = "deepspeed==0.19.8"  # an sdist: built against the torch above, without build isolation


def cache_root() -> Path:
    base = os.environ.get("VERL_REMOTE_TEST_CACHE") or str(Path.home() / ".cache" / "verl-remote" / "test-envs")
    return Path(base)


@dataclass(frozen=True)
class Harness:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    def platform_src(self, generation: str) -> Path:
        return self.root / f"arctic-platform-{ARCTIC_PLATFORM[generation]}"

    def inference_src(self, generation: str) -> Path:
        return self.root / f"arctic-inference-{ARCTIC_INFERENCE[generation]}"


def _step(message: str) -> None:
    print(f"[arctic harness] {message}", file=sys.stderr, flush=True)


def _run(*args: str | Path, cwd: Path | None = None) -> None:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, args))} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )


def _download(name: str, version: str, dest: Path) -> Path:
    """One pinned release file from the package index, checked against its sha256.

    Fetched directly (the index's JSON listing, then the file), not with ``pip
    download``: for an sdist pip would build the package to read its metadata,
    and arctic-inference's build compiles extensions. Nothing is built or installed.
    """
    filename, sha256 = FILES[(name, version)]
    target = dest / filename
    if not target.is_file():
        listing = httpx.get(
            f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}, timeout=60
        ).raise_for_status()
        (entry,) = [f for f in listing.json()["files"] if f["filename"] == filename]
        dest.mkdir(parents=True, exist_ok=True)
        data = httpx.get(entry["url"], timeout=300, follow_redirects=True).raise_for_status().content
        target.write_bytes(data)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != sha256:
        target.unlink()
        raise RuntimeError(f"{filename}: sha256 {digest} is not the pinned {sha256}")
    return target


def _build(staging: Path) -> None:
    python = Path(sys.executable)
    downloads = staging.parent / "downloads"
    _step(f"creating the Arctic environment in {staging.parent} (a few minutes, once)")
    _run(python, "-m", "venv", staging / "venv")
    pip = [staging / "venv" / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _step("installing torch (CPU), transformers 4, Ray, Triton, FastAPI")
    _run(*pip, *REQUIREMENTS)
    _step(f"installing {DEEPSPEED} (CPU accelerator) and compiling the ops Arctic's workers load")
    _run(*pip, "--no-build-isolation", DEEPSPEED)
    # DeepSpeed compiles its CPU ops on first use (a minute each on 2 cores); do it now, into the environment.
    _run(
        "env",
        "DS_ACCELERATOR=cpu",
        f"TORCH_EXTENSIONS_DIR={staging / 'torch_extensions'}",
        staging / "venv" / "bin" / "python",
        "-c",
        "from deepspeed.accelerator import get_accelerator as a\n"
        "for name in ('FusedAdamBuilder', 'ShareMemCommBuilder'): a().create_op_builder(name).load()",
    )
    for generation, version in ARCTIC_PLATFORM.items():
        _step(f"unpacking arctic-platform {version} (generation {generation})")
        # 0.1.3 and later declare Python >=3.12; their code runs on 3.11, the Python of torch's CPU build here.
        wheel = _download("arctic-platform", version, downloads)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(staging / f"arctic-platform-{version}")
    for version in sorted(set(ARCTIC_INFERENCE.values())):
        _step(f"unpacking arctic-inference {version} (pure-Python parts only; vLLM is not installed)")
        sdist = _download("arctic-inference", version, downloads)
        with tempfile.TemporaryDirectory() as tmp:
            shutil.unpack_archive(str(sdist), tmp)
            (top,) = Path(tmp).iterdir()
            shutil.copytree(top / "arctic_inference", staging / f"arctic-inference-{version}" / "arctic_inference")
    (staging / "COMPLETE").write_text(HARNESS_VERSION)


def ensure_harness() -> Harness:
    """The Arctic environment, built on first use (under a lock, atomically) and reused."""
    root = cache_root() / f"arctic-harness-v{HARNESS_VERSION}"
    if (root / "COMPLETE").is_file():
        return Harness(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "COMPLETE").is_file():
            staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
            try:
                started = time.monotonic()
                _build(staging)
                shutil.rmtree(root, ignore_errors=True)
                os.replace(staging, root)
                _step(f"ready in {time.monotonic() - started:.0f}s: {root}")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return Harness(root)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is no owner
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


@contextlib.contextmanager
def real_arctic_server(
    generation: str,
    port: int,
    *,
    training_gpus: int = 1,
    sampling_gpus: int = 1,
    log_prob_gpus: int = 1,
    log: Path | None = None,
    startup_timeout: float = 180,
) -> Iterator[str]:
    """Arctic's real HTTP server for ``generation`` on 127.0.0.1:``port``; stopped, with its Ray, on exit."""
    harness = ensure_harness()
    env = {
        **os.environ,
        "PYTHONPATH": str(harness.platform_src(generation)),
        "RAY_ADDRESS": "",
        "RAY_USAGE_STATS_ENABLED": "0",
        "TORCH_EXTENSIONS_DIR": str(harness.root / "torch_extensions"),
    }
    # Arctic's DeepSpeed ranks meet at fixed ports: training at MASTER_PORT or 29500, the reference at 29501
    # (v0.1 always; main at MASTER_PORT too, so setting it makes the two jobs collide). One server at a time.
    env.pop("MASTER_PORT", None)
    for fixed in (port, 29500, 29501):
        if not _port_free(fixed):
            raise RuntimeError(f"port {fixed}, which Arctic's server needs, is taken: is another server running?")
    command = [
        str(harness.python),
        str(SERVE),
        f"--generation={generation}",
        f"--port={port}",
        f"--arctic-inference={harness.inference_src(generation)}",
        f"--training-gpus={training_gpus}",
        f"--sampling-gpus={sampling_gpus}",
        f"--log-prob-gpus={log_prob_gpus}",
    ]
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                tail = log.read_text()[-4000:] if log is not None else ""
                raise RuntimeError(f"Arctic's server ({generation}) exited with {proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200 and proc.poll() is None:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"Arctic's server ({generation}) did not answer /health within {startup_timeout}s")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        _kill_session(proc.pid)
        if log is not None:
            out.close()  # type: ignore[union-attr]


def session_members(sid: int) -> list[int]:
    """Processes of session ``sid``: the server and everything it started (Ray's workers have their own
    process groups but stay in the session)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session id
            members.append(int(entry.name))
    return members


def _kill_session(sid: int) -> None:
    deadline = time.monotonic() + 30
    while members := session_members(sid):
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of Arctic's server outlived it: {members}")
        time.sleep(0.2)


#: Printing and timing helpers of Arctic's ``utils/debug.py``, which imports DeepSpeed at its top: the only
#: names the batch modules take from it, none of them part of what is compared.
_DEBUG_NAMES = ("pr", "pr0", "print_rank0", "see_memory_usage")


class _Timers:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def start(self, name: str) -> str:
        return name

    def stop_and_print_elapsed(self, name: str) -> None:
        pass


@contextlib.contextmanager
def arctic_module(generation: str, name: str) -> Iterator[types.ModuleType]:
    """One of Arctic's own modules, imported in this process from the pinned release of ``generation``.

    Only for modules whose code is pure Python and torch (the batch split and merge). Arctic's packages are
    made without running their ``__init__`` (which import the GPU stack), and its debug helpers, which import
    DeepSpeed, are replaced by no-ops; everything else is Arctic's. The modules are removed again on exit, so
    each generation's code is loaded on its own.
    """
    source = ensure_harness().platform_src(generation)
    debug = types.ModuleType("arctic_platform_debug_stand_in")
    for helper in _DEBUG_NAMES:
        setattr(debug, helper, lambda *args, **kwargs: None)
    debug.SynchronizedWallClockTimerSimple = _Timers  # type: ignore[attr-defined]
    debug.SynchronizedWallClockTimerSimpleDummy = _Timers  # type: ignore[attr-defined]
    for package in ("", ".rl", ".rl.utils", ".rl.zorro_train", ".common", ".common.utils"):
        sys.modules[f"arctic_platform{package}"] = _package(source, f"arctic_platform{package}")
    sys.modules["arctic_platform.rl.utils.debug"] = debug
    sys.modules["arctic_platform.common.utils.debug"] = debug
    try:
        yield importlib.import_module(name)
    finally:
        for module in [m for m in sys.modules if m == "arctic_platform" or m.startswith("arctic_platform.")]:
            del sys.modules[module]


def _package(source: Path, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(source.joinpath(*name.split(".")))]
    return module
