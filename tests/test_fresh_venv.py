"""The promise end to end: install the built wheels into a new virtual environment and nothing else.

No environment variable, no search-path flag, no checkout on sys.path: the
third-party backend's wheel is found by name by the CLI, by Hydra (through
verl-remote and through verl's own main_ppo) and inside a Ray worker.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, TEST_PACKAGES, run, steps

pytestmark = pytest.mark.slow


def _clean_env() -> dict[str, str]:
    """This environment minus anything that could point the new one at the checkout."""
    unset = ("PYTHONPATH", "VIRTUAL_ENV", "VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")
    return {k: v for k, v in os.environ.items() if k not in unset}


def test_built_wheels_work_in_a_fresh_virtualenv(tmp_path: Path, ray_left_behind: Any) -> None:
    wheels = tmp_path / "wheels"
    projects = (
        ROOT,
        ROOT / "dists" / "verl-arctic",
        ROOT / "dists" / "verl-tinker",
        TEST_PACKAGES / "echo-backend",
        TEST_PACKAGES / "faulty-backend",
        ROOT / "examples" / "bigram-backend",
    )
    # With this environment's hatchling (nox -s build checks each build in an environment of its own).
    build = ["wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", wheels]
    out = run(sys.executable, "-m", "pip", *build, *projects, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    core = next(wheels.glob("verl_remote-*.whl"))
    arctic = next(wheels.glob("verl_arctic-*.whl"))
    tinker = next(wheels.glob("verl_tinker-*.whl"))
    echo = next(wheels.glob("verl_remote_echo_backend-*.whl"))
    faulty = next(wheels.glob("verl_remote_faulty_backend-*.whl"))
    bigram = next(wheels.glob("verl_remote_bigram-*.whl"))

    venv = tmp_path / "venv"
    assert run(sys.executable, "-m", "venv", venv).returncode == 0
    bin_dir = venv / "bin"
    constraints = ROOT / "constraints" / "cpu.txt"
    out = run(
        bin_dir / "pip",
        "install",
        "-c",
        constraints,
        core,
        arctic,
        tinker,
        echo,
        faulty,
        bigram,
        timeout=1200,
        env=_clean_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]

    work = tmp_path / "elsewhere"  # not the checkout, so nothing resolves from the source tree
    work.mkdir()

    def in_venv(*args: str | Path) -> tuple[int, str, str]:
        # RAY_ADDRESS=local: verl's ray.init() would join a cluster started on this machine with `ray start`.
        env = {**_clean_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "RAY_ADDRESS": "local"}
        out = run(*args, env=env, timeout=600, cwd=work)
        return out.returncode, out.stdout, out.stderr

    code, stdout, stderr = in_venv(bin_dir / "verl-remote", "list")
    assert code == 0, stdout + stderr
    assert [line.split() for line in stdout.splitlines()[1:]] == [
        ["arctic", "verl-arctic", "0.1.0", "pkg://verl_arctic/remote_backend/arctic.yaml", "ok"],
        ["bigram", "verl-remote-bigram", "0.1.0", "pkg://verl_remote_bigram/remote_backend/bigram.yaml", "ok"],
        ["echo", "verl-remote-echo-backend", "0.1.0", "pkg://verl_remote_echo_backend/remote_backend/echo.yaml", "ok"],
        [
            "faulty",
            "verl-remote-faulty-backend",
            "0.1.0",
            "pkg://verl_remote_faulty_backend/remote_backend/faulty.yaml",
            "ok",
        ],
        ["local", "verl-remote", "0.1.0", "pkg://verl_remote.backends.local/remote_backend/local.yaml", "ok"],
        ["tinker", "verl-tinker", "0.1.0", "pkg://verl_tinker/remote_backend/tinker.yaml", "ok"],
        ["twin", "verl-remote-echo-backend", "0.1.0", "pkg://verl_remote_echo_backend/remote_backend/twin.yaml", "ok"],
    ]

    code, stdout, stderr = in_venv(bin_dir / "verl-remote", "config", "remote_backend=arctic")
    assert code == 0, stderr
    assert yaml.safe_load(stdout)["remote_backend"]["comms"]["url"] == "http://127.0.0.1:7000"

    code, stdout, stderr = in_venv(bin_dir / "verl-remote", "config", "remote_backend=tinker")
    assert code == 0, stderr
    assert yaml.safe_load(stdout)["remote_backend"]["api_key_env"] == "TINKER_API_KEY"

    code, stdout, stderr = in_venv(
        bin_dir / "verl-remote", "config", "remote_backend=echo", "remote_backend.state_dir=/x"
    )
    assert code == 0, stderr
    ours = yaml.safe_load(stdout)
    assert ours["remote_backend"] == {"name": "echo", "state_dir": "/x"}

    # verl's launcher, bare: the group and its keys compose into verl's own config as into verl-remote's.
    code, stdout, stderr = in_venv(
        bin_dir / "python", "-m", "verl.trainer.main_ppo", "+remote_backend=echo", "remote_backend.state_dir=/x",
        "--cfg", "job",
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    theirs = yaml.safe_load(stdout)
    assert theirs["remote_backend"] == ours["remote_backend"]
    assert theirs["trainer"]["use_v1"] == ours["trainer"]["use_v1"]

    # verl's own launcher (python -m verl.trainer.main_ppo +remote_backend=NAME $(verl-remote config --overrides
    # ...)) trains with the example backend (examples/bigram-backend) from its wheel. The launcher's destroy and
    # resume through verl-remote's checkpoint records are asserted on a cluster (tests/test_cluster.py).
    code, words, stderr = in_venv(bin_dir / "verl-remote", "config", "--overrides", "remote_backend=bigram")
    assert code == 0, stderr[-3000:]
    launch = [
        bin_dir / "python", "-m", "verl.trainer.main_ppo", "+remote_backend=bigram", *words.split(),
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=2",
        f"trainer.default_local_dir={work / 'ckpt'}",
    ]  # fmt: skip
    code, stdout, stderr = in_venv(*launch)
    assert code == 0, stderr[-3000:]
    assert steps(stdout) == [1, 2]
    assert re.search(r"verl-remote: 2 steps \(1-2\); mean reward \d\.\d{3} over the first 2", stdout), stdout[-3000:]
    assert ray_left_behind() == {}  # Ray's workers end within seconds of the driver

    code, stdout, stderr = in_venv(bin_dir / "verl-remote", "doctor")
    assert code == 0, stdout + stderr
    assert re.fullmatch(r"doctor: \d+ checks passed, 0 failed", stdout.splitlines()[-1]), stdout
    # In a Ray worker: verl loaded verl-remote's plugin, and each backend resolves by name from its wheel.
    assert "[ok  ] Ray worker: verl loads the verl-remote plugin: verl loaded verl_remote.verl_plugin" in stdout
    assert "[ok  ] Ray worker: backend arctic (verl-arctic 0.1.0) loads" in stdout
    assert "[ok  ] Ray worker: backend tinker (verl-tinker 0.1.0) loads" in stdout
    assert "[ok  ] Ray worker: backend echo (verl-remote-echo-backend 0.1.0) loads" in stdout
    assert "[ok  ] Ray worker: backend faulty (verl-remote-faulty-backend 0.1.0) loads" in stdout
    assert "[ok  ] Ray worker: backend bigram (verl-remote-bigram 0.1.0) loads" in stdout
