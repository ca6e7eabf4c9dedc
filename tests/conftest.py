"""Shared fixtures and helpers. The tests run against the real verl, Ray and Hydra.

They need the test backends under tests/packages installed into the same
environment (``nox -s tests`` does it); they fail, not skip, without them.

What is expensive is set up once and shared (CONTRIBUTING.md, "The suite's budget"):

- :func:`train_runs`: a session cache of ``verl-remote train`` runs, keyed by their overrides. A test that needs
  a run of a configuration another test has asks for the same run and asserts on it; a test that resumes
  copies the run's checkpoint folder (:meth:`Run.clone`) instead of training again.
- the Arctic test server as its own process, one per protocol generation and module (:func:`arctic_process`);
- SkyRL's Tinker server, one for its module (:func:`tinker_server`);
- refusals of the CLI, run in this process (:func:`cli_main`) instead of a new interpreter that imports verl.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_PACKAGES = ROOT / "tests" / "packages"
REQUIRED = (
    "verl-remote-echo-backend",
    "verl-remote-broken-backend",
    "verl-remote-faulty-backend",
    "verl-remote-test-agent-loop",
)

#: Settings of every test run: no validation before the first step, none during the run, and no Ray dashboard (its
#: head and module processes cost a run about 5 CPU-seconds of its 74; docs/measurements.md). A run that joins a
#: cluster ignores the last. The fresh environment's run of verl's launcher keeps verl's defaults.
#: The demo with a KL penalty to the initial model (configs/grpo-kl.yaml): verl asks for reference log-probs.
KL_RECIPE = ("--recipe", str(ROOT / "configs" / "grpo-kl.yaml"))

QUICK = (
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "+ray_kwargs.ray_init.include_dashboard=false",
)


def two_turn() -> tuple[str, str]:
    """The overrides that make verl run the tests' multi-turn agent loop (tests/packages/agent-loop) for every
    prompt: the model answers in at most 2 tokens, the environment says ``user: <digit> <|im_end|> assistant:``
    (4 tokens, response mask 0), the model answers again in what is left of the 8-token response; 4 turns."""
    from importlib.util import find_spec

    spec = find_spec("verl_remote_test_agent_loop")  # found, not imported: importing it imports verl
    assert spec is not None and spec.origin is not None
    config = Path(spec.origin).parent / "agent_loops.yaml"
    return (
        "actor_rollout_ref.rollout.agent.default_agent_loop=two_turn",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={config}",
    )


def assert_two_turn_run(log: str, steps: int) -> None:
    """What verl's metrics show of :func:`two_turn` runs: 4 turns per trajectory every step, and the sampler's
    log-probs of the model's tokens are the trainer's (the response mask keeps the environment's out)."""
    for name in ("num_turns/min", "num_turns/max"):
        assert metric(log, name) == [4.0] * steps, (name, metric(log, name))
    diffs = metric(log, "training/rollout_probs_diff_max")
    assert len(diffs) == steps and max(diffs) < 1e-4, diffs
    assert max(metric(log, "response_length/max")) <= 8


# Ray starts spare Python workers with a driver's first job; a run's actors rarely use them, and on 2 cores each
# costs CPU the other runs of the suite need (about 7 CPU-seconds a run: docs/measurements.md). Every Ray
# instance the tests start, in this process or in a run's, inherits this.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


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


#: The modules that take longest, longest first (docs/measurements.md, "The test suite"). They start first, so that
#: the two workers of ``nox -s tests`` (pytest-xdist, a module per worker at a time, in collection order) end
#: together rather than one waiting on a long module started last. A new long module belongs in this list.
LONGEST_FIRST = (
    "tests/test_fresh_venv.py",
    "tests/arctic/test_real_server.py",
    "tests/test_train.py",
    "tests/arctic/test_arctic_train.py",
    "tests/tinker_service/test_tinker_server.py",
    "tests/test_cluster.py",
    "tests/test_check.py",
    "tests/test_own_run.py",
    # Then the longest of the quick tier (-m "not (slow or train or arctic_real or tinker)"), for the same reason.
    "tests/test_cli.py",
    "tests/test_verl_plugin.py",
    "tests/test_preflight.py",
    "tests/test_docs.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: file order otherwise


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The suite's wall time per module, slowest first, after pytest's own list of the slowest tests."""
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown") and hasattr(report, "duration"):
                module = report.nodeid.split("::")[0]
                seconds[module] = seconds.get(module, 0.0) + report.duration
    if not seconds:
        return
    terminalreporter.section("time per module")
    for module, spent in sorted(seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{spent:8.1f}s  {module}")
    terminalreporter.write_line(f"{sum(seconds.values()):8.1f}s  in all")


# -- commands ----------------------------------------------------------------------------------------


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


def script(name: str = "verl-remote") -> str:
    """A console script of this environment (``verl-remote``, ``ray``)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found is not None, f"the {name} console script is not installed in this environment"
    return found


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``verl-remote`` console script, with ``env`` added to this environment."""
    return run(script(), *args, env={**os.environ, **(env or {})}, timeout=timeout, cwd=cwd)


@pytest.fixture
def cli_main(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., tuple[int, str, str]]:
    """A function: ``verl-remote ARGV`` in this process, working in the test's folder; returns (exit code,
    stdout, stderr). For commands that end before Ray starts (refusals, config, list); a run that trains is a
    process of its own (:func:`train`)."""
    import ray

    from verl_remote.cli import main as verl_remote_cli

    monkeypatch.chdir(tmp_path)

    def call(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        had_ray = ray.is_initialized()  # a module's own Ray instance (ray_cluster)
        code = verl_remote_cli.main(list(argv))
        out = capsys.readouterr()
        assert ray.is_initialized() == had_ray, "the command started Ray in the test process"
        return code, out.out, out.err

    return call


def python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run Python code in a fresh interpreter of this environment, with ``env`` added to the environment."""
    return run(sys.executable, "-c", code, env={**os.environ, **(env or {})}, timeout=timeout)


def train(
    folder: Path, *overrides: str, timeout: float = 900, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``verl-remote train OVERRIDES`` run in ``folder``, with its checkpoints in ``folder/ckpt`` and :data:`QUICK`
    (options such as ``--recipe`` and ``--verbose`` go first in ``overrides``)."""
    args = ["train", *overrides, f"trainer.default_local_dir={folder / 'ckpt'}", *QUICK]
    return cli(*args, cwd=folder, timeout=timeout, env=env)


def start(
    folder: Path, *overrides: str, output: bool | Path = True, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """:func:`train` in the background; its console merged into one stream to read line by line
    (:func:`read_until`), written to a file with ``output=PATH``, or discarded with ``output=False``."""
    command = [script(), "train", *overrides, f"trainer.default_local_dir={folder / 'ckpt'}", *QUICK]
    environment = {**os.environ, **(env or {})}
    if isinstance(output, Path):
        with output.open("w") as log:  # the child has its own copy of the descriptor
            return subprocess.Popen(
                command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, text=True, env=environment
            )
    sink = subprocess.PIPE if output else subprocess.DEVNULL
    return subprocess.Popen(command, cwd=folder, stdout=sink, stderr=subprocess.STDOUT, text=True, env=environment)


_STEP_ROW = re.compile(r"^step (\d+)(?:/\d+)?(?:  |$)", re.MULTILINE)  # verl-remote's console: step 3/40  reward ...


def steps(stdout: str) -> list[int]:
    """The steps a run printed, in order: the console's step rows (``step 3/40  reward ...``), or verl's own
    ``step:N - ...`` metrics lines where a run has no verl-remote console (verl's launcher, ``--verbose``)."""
    rows = [int(step) for step in _STEP_ROW.findall(stdout)]
    if rows:
        return rows
    return [int(part.split(":")[1]) for part in stdout.split() if part.startswith("step:") and part[5:].isdigit()]


def step_row(step: int) -> str:
    """The start of the console's row for ``step`` of a run whose number of steps is known (read_until's marker)."""
    return f"step {step}/"


def run_log(ckpt: Path) -> str:
    """The newest ``verl-remote train`` log of the checkpoint folder ``ckpt``: every line of the run, verl's whole
    metrics line per step among them."""
    logs = sorted((ckpt / "logs").glob("train-*.log"))
    assert logs, f"no run log in {ckpt / 'logs'}"
    return logs[-1].read_text()


def metric(text: str, name: str) -> list[float]:
    """Every value of verl's metric ``name`` in verl's metrics lines of ``text`` (a :func:`run_log`), in step
    order."""
    return [float(part.split(":", 1)[1]) for part in text.split() if part.startswith(f"{name}:")]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def read_until(proc: subprocess.Popen[str], marker: str) -> list[str]:
    """The lines of a background run's merged output up to the first holding ``marker``; fails if it ends first."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return seen
    raise AssertionError(f"the run ended before {marker!r}:\n" + "".join(seen[-40:]))


def finish(proc: subprocess.Popen[str], timeout: float = 600) -> str:
    """The rest of a background run's output once it ends (killed after ``timeout`` seconds).

    Read through the same buffered reader :func:`read_until` used: ``communicate`` with a timeout reads the
    pipe's descriptor directly and drops what that reader has buffered already.
    """
    assert proc.stdout is not None
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        rest = proc.stdout.read()
        proc.wait()
    finally:
        timer.cancel()
    return rest


# -- shared training runs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """A finished ``verl-remote train`` run: its folder (checkpoints in ``folder/ckpt``) and its output."""

    folder: Path
    out: subprocess.CompletedProcess[str]

    @property
    def ckpt(self) -> Path:
        return self.folder / "ckpt"

    def ok(self) -> Run:
        """This run, after checking that it succeeded."""
        assert self.out.returncode == 0, self.out.stdout[-3000:] + self.out.stderr[-3000:]
        return self

    def clone(self, folder: Path) -> Path:
        """A copy of this run's checkpoint folder as ``folder/ckpt`` (the folder a :func:`train` in ``folder``
        resumes from), so that resuming never changes the shared run. Returns ``folder``."""
        shutil.copytree(self.ckpt, folder / "ckpt", ignore=shutil.ignore_patterns(".verl-remote.lock", "logs"))
        return folder


class TrainRuns:
    """``verl-remote train`` runs of this test session, each run once per distinct list of overrides.

    ``{folder}`` in an override is the run's own folder (for a file the run writes, such as a calls log).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[tuple[str, ...], Run] = {}

    def __call__(self, *overrides: str, timeout: float = 900) -> Run:
        if overrides not in self._runs:
            folder = self.root / f"run-{len(self._runs)}"
            folder.mkdir(parents=True)
            words = [word.replace("{folder}", str(folder)) for word in overrides]
            self._runs[overrides] = Run(folder, train(folder, *words, timeout=timeout))
        return self._runs[overrides]

    def add(self, overrides: tuple[str, ...], made: Run) -> None:
        """A run of ``overrides`` a test made itself (beside another, say), for the tests that ask for it."""
        assert overrides not in self._runs, f"a run of {overrides} was made already"
        self._runs[overrides] = made


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory: pytest.TempPathFactory) -> TrainRuns:
    """The session's cache of training runs (see :class:`TrainRuns`)."""
    return TrainRuns(tmp_path_factory.mktemp("runs"))


# -- processes ----------------------------------------------------------------------------------------


def processes_in(folder: Path) -> dict[int, str]:
    """Processes whose working directory is ``folder`` or below, pid -> command line.

    A run's driver, Ray's GCS, raylet and agents, and every Ray worker work in the folder the run was started
    in, so this finds what is left of a run started in a test's own folder, and nothing of other runs. The test
    process itself is not counted (``cli_main`` works in the test's folder).
    """
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours
            continue
        if cwd == folder or folder in cwd.parents:
            found[int(entry.name)] = command
    return found


def left_behind(folder: Path, grace_s: float = 20.0) -> dict[int, str]:
    """The processes of runs started in ``folder`` still alive after a grace period (workers exit shortly
    after their raylet)."""
    deadline = time.monotonic() + grace_s
    while True:
        found = processes_in(folder)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.fixture
def ray_left_behind(tmp_path: Path) -> Callable[..., dict[int, str]]:
    """A function: the processes of runs started in this test's folder still alive after a grace period."""
    return lambda grace_s=20.0: left_behind(tmp_path, grace_s)


def faulty_calls(log: Path) -> list[str]:
    """The faulty test backend's lifecycle calls in ``log`` (its ``calls_log``), in order, without the process ids;
    none when it recorded nothing."""
    return [line.split(" pid=")[0] for line in log.read_text().splitlines()] if log.exists() else []


@contextlib.contextmanager
def _local_ray() -> Iterator[Any]:
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _no_ray_left_in_the_test_process() -> Iterator[None]:
    """A test that starts Ray in this process (ray.init, or a Ray call that starts it) without a fixture that
    stops it fails here, instead of the next module's ray.init on this worker."""
    ray = sys.modules.get("ray")
    had = ray is not None and ray.is_initialized()
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and not had:
        ray.shutdown()
        pytest.fail("the test left Ray running in the test process: use the ray_instance or ray_cluster fixture")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A real local Ray instance in this process for one test module (8 logical CPUs, as a run has), stopped at
    its end."""
    with _local_ray() as ray:
        yield ray


@pytest.fixture
def ray_instance() -> Iterator[Any]:
    """:func:`ray_cluster` for one test."""
    with _local_ray() as ray:
        yield ray


def live_actors(grace_s: float = 10.0) -> list[str]:
    """Class names of the actors still alive in this process's Ray instance after a grace period: what a
    check or service left behind. (Ray's state API needs the dashboard, which the test instance does not run.)"""
    from ray._private.state import actors

    deadline = time.monotonic() + grace_s
    while True:
        alive = [a["ActorClassName"] for a in actors().values() if a["State"] != "DEAD"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


# -- the Arctic test server (tests/arctic) ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A URL on 127.0.0.1 where nothing listens: its port stays bound, not listening, for the test (a connection
    is refused), so that nothing else takes it meanwhile. (A port found free and let go was handed straight to
    :func:`silent_url`'s socket once, and a call meant to be refused waited for its read timeout.)"""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A URL on 127.0.0.1 that takes connections and never answers: every call to it times out, however fast the
    machine (a short read timeout against a real server races the server's answer)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.contextmanager
def serving_test_server(generation: str, port: int | None = None, **flags: Any) -> Iterator[str]:
    """The Arctic test server (``create_app(generation, **flags)``) in this process; its URL, stopped on exit. A new
    one on the port of one stopped before is that server restarted."""
    import uvicorn

    from verl_arctic.testing.server import create_app

    port = port or free_port()
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
    """(url, generation) of a running test server in this process, stopped after the test."""
    with serving_test_server(str(request.param)) as url:
        yield url, str(request.param)


@contextlib.contextmanager
def arctic_process(generation: str, log: Path, *flags: str, port: int | None = None) -> Iterator[str]:
    """The Arctic test server as its own process (``python -m verl_arctic.testing.server``), as a user runs it;
    its URL, stopped on exit. Its output goes to ``log``."""
    import httpx

    port = port or free_port()
    command = [sys.executable, "-m", "verl_arctic.testing.server", "--port", str(port), "--api", generation, *flags]
    with log.open("a") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def arctic_jobs(url: str) -> dict[str, object]:
    """The jobs an Arctic server holds (its ``/status``)."""
    import httpx

    return dict(httpx.get(f"{url}/status", timeout=10).json()["jobs"])


# -- SkyRL's Tinker server (tests/tinker_service) ----------------------------------------------


@pytest.fixture(scope="module")
def tinker_server() -> Iterator[Any]:
    """SkyRL's real Tinker-API server (``verl_remote_tinker.testing.local_server.LocalServer``), one for the test
    module (so that it does not idle on a worker once the module is done); a test may stop it (``stop`` is
    idempotent).

    Its Python 3.12 environment is built on first use (minutes; then cached under
    ``~/.cache/verl-remote/tinker-server``); it serves verl-remote's demo model, which the runs also load (the
    server's own default is the demo's model for LoRA, which the Tinker recipe trains).
    """
    from verl_remote.demo.assets import ensure_demo_assets
    from verl_remote_tinker.testing.local_server import start_local_server

    with start_local_server(model=str(ensure_demo_assets().model_path)) as server:
        yield server


@dataclass
class EndlessAnswer:
    """An HTTP server on 127.0.0.1 whose every answer is ``status`` with a body that does not end (text, 64 KiB at a
    time, up to :attr:`LIMIT`): what a client reads of it, it reads until it stops reading."""

    url: str
    sent: list[int]  # bytes of body sent so far, per request

    LIMIT = 256 << 20


@contextlib.contextmanager
def endless_answer(status: int) -> Iterator[EndlessAnswer]:
    import http.server

    sent: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()  # no length: the body ends when the connection does
            sent.append(0)
            chunk = b"x" * 65535 + b"\n"
            try:
                while sent[-1] < EndlessAnswer.LIMIT:
                    self.wfile.write(chunk)
                    sent[-1] += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield EndlessAnswer(f"http://127.0.0.1:{server.server_address[1]}", sent)
    finally:
        server.shutdown()
        server.server_close()
