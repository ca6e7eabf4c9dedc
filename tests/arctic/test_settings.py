"""What verl-arctic refuses of ``remote_backend.comms`` before Ray, in one line naming the setting: the URL (its
scheme, a password in it, never shown), the token (an empty variable, a missing or empty file), the launch
command, the protocol generation and the GPUs against the server's; and the warning a token over plain http gets.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port, serving_test_server
from verl_arctic.backend import ArcticBackend
from verl_arctic.settings import ArcticSettings
from verl_remote.cli.preflight import run_preflight
from verl_remote.demo import resolve_demo_assets
from verl_remote.discovery.compose import compose_config

pytestmark = pytest.mark.faults


def _config(tmp_path: Path, *overrides: str) -> Any:
    config = compose_config(
        ["remote_backend=arctic", f"trainer.default_local_dir={tmp_path / 'run'}", *overrides], recipe="demo"
    )
    resolve_demo_assets(config)
    return config


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://127.0.0.1:7000", "remote_backend.comms.url=ftp://127.0.0.1:7000: the scheme ftp:// is not one"),
        ("127.0.0.1:7000", "remote_backend.comms.url=127.0.0.1:7000: not a URL; expected http://HOST:PORT"),
        ("http://:7000", "remote_backend.comms.url=http://:7000: no host in the URL"),
        ("http://bob:s3cret@127.0.0.1:7000", "remote_backend.comms.url=http://***@127.0.0.1:7000: a user or password"),
        ("https://s3cret@arctic.example", "remote_backend.comms.url=https://***@arctic.example: a user or password"),
    ],
)
def test_a_url_of_another_scheme_or_with_a_password_is_refused_and_the_password_never_shown(
    url: str, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as refused:
        ArcticBackend.preflight(_config(tmp_path, f"remote_backend.comms.url={url}"))
    assert str(refused.value).startswith(message)
    assert "s3cret" not in str(refused.value) and "bob" not in str(refused.value)
    if "***" in message:
        assert "remote_backend.comms.token_env" in str(refused.value)  # where the token goes instead


def test_the_token_comes_from_its_variable_or_its_file_and_an_empty_or_missing_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARCTIC_TEST_TOKEN", "")
    with pytest.raises(ValueError, match=r"token_env=ARCTIC_TEST_TOKEN: that environment variable is empty; export"):
        ArcticSettings.of(_config(tmp_path, "remote_backend.comms.token_env=ARCTIC_TEST_TOKEN"))
    monkeypatch.setenv("ARCTIC_TEST_TOKEN", "from-the-environment")
    settings = ArcticSettings.of(_config(tmp_path, "remote_backend.comms.token_env=ARCTIC_TEST_TOKEN"))
    assert settings.headers == {"Authorization": "Bearer from-the-environment"}
    token_file = tmp_path / "token"
    file_setting = f"remote_backend.comms.token_file={token_file}"
    with pytest.raises(ValueError, match=r"comms.token_file=.*token: cannot read it \(No such file or directory\)"):
        ArcticSettings.of(_config(tmp_path, file_setting))
    token_file.write_text("  \n")
    with pytest.raises(ValueError, match=r"comms.token_file=.*token: the file is empty; write the token into it"):
        ArcticSettings.of(_config(tmp_path, file_setting))
    token_file.write_text("from-a-file\n")
    assert ArcticSettings.of(_config(tmp_path, file_setting)).token == "from-a-file"
    with pytest.raises(ValueError, match=r"token_env=ARCTIC_TEST_TOKEN and .*token_file=.*: set one of them, not"):
        ArcticSettings.of(_config(tmp_path, file_setting, "remote_backend.comms.token_env=ARCTIC_TEST_TOKEN"))


def test_a_token_over_plain_http_to_another_host_is_a_note_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A launched service: the preflight probes nothing, so a host that is not there will do.
    port = free_port()
    launch = f"remote_backend.comms.launch='{sys.executable} -m verl_arctic.testing.server --port {port}'"
    monkeypatch.setenv("ARCTIC_TEST_TOKEN", "do-not-print-me")
    clear = _config(
        tmp_path,
        f"remote_backend.comms.url=http://10.255.255.1:{port}",
        "remote_backend.comms.token_env=ARCTIC_TEST_TOKEN",
        launch,
    )
    notes = run_preflight(clear, ArcticBackend.preflight, single_forwarder=True)
    assert any("the token goes over plain http to a host that is not this machine" in note for note in notes)
    assert not any("do-not-print-me" in note for note in notes)
    for quiet in (f"http://127.0.0.1:{port}", f"https://10.255.255.1:{port}"):
        config = _config(
            tmp_path, f"remote_backend.comms.url={quiet}", "remote_backend.comms.token_env=ARCTIC_TEST_TOKEN", launch
        )
        assert not any(
            "plain http" in note for note in run_preflight(config, ArcticBackend.preflight, single_forwarder=True)
        )


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("no-such-arctic-server --port 1", "the program 'no-such-arctic-server' is not found on PATH"),
        ("/nowhere/arctic-server --port 1", "the program '/nowhere/arctic-server' is no such file"),
        ("{here} --port 1", "is not executable (chmod +x it, or start the command with its interpreter)"),
        ("'unclosed", "cannot split it as a shell would"),
    ],
)
def test_a_launch_command_whose_program_cannot_run_is_refused_before_the_run(
    command: str, message: str, tmp_path: Path
) -> None:
    script = tmp_path / "arctic-server"
    script.write_text("#!/bin/sh\n")  # not executable
    launch = command.format(here=script)
    with pytest.raises(ValueError) as refused:
        ArcticBackend.preflight(
            _config(
                tmp_path,
                f"remote_backend.comms.launch={launch!r}",
                f"remote_backend.comms.url=http://127.0.0.1:{free_port()}",
            )
        )
    assert str(refused.value).startswith("remote_backend.comms.launch=")
    assert message in str(refused.value)


def test_the_other_generations_protocol_and_another_gpu_count_than_the_servers_are_refused(tmp_path: Path) -> None:
    with serving_test_server("main", training_gpus=2) as url:
        at = f"remote_backend.comms.url={url}"
        with pytest.raises(ValueError) as refused:
            ArcticBackend.preflight(
                _config(tmp_path, at, "remote_backend.comms.api=v0.1", "remote_backend.training_gpus=2")
            )
        assert str(refused.value) == (
            f"remote_backend.comms.api=v0.1, but the Arctic server at {url} speaks protocol main; set "
            "remote_backend.comms.api=main (or auto)"
        )
        with pytest.raises(ValueError) as refused:
            ArcticBackend.preflight(_config(tmp_path, at, "remote_backend.training_gpus=1"))
        assert str(refused.value) == (
            f"remote_backend.training_gpus=1, but the Arctic server at {url} was launched with --training-gpus 2: "
            "set remote_backend.training_gpus=2"
        )
        ArcticBackend.preflight(_config(tmp_path, at, "remote_backend.training_gpus=2"))


@pytest.mark.faults
def test_a_rollout_temperature_other_than_1_is_refused_before_ray(dead_url: str) -> None:
    """Arctic's sampler reports log-probs of the untempered distribution (as vLLM does): at 0.7 they differ from
    the trainer's by up to 0.4 on the demo's model (verl-remote check's weight_sync found it), so verl's old
    log-probs and its rollout corrections would read wrong numbers."""
    config = compose_config(
        ["remote_backend=arctic", f"remote_backend.comms.url={dead_url}", "actor_rollout_ref.rollout.temperature=0.7"]
    )
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.rollout.temperature=0.7: Arctic's sampler \(vLLM\) "):
        ArcticBackend.preflight(config)
