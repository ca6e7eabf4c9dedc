"""No secret reaches a console or a file: a token with whitespace inside is refused without a part of it shown, an
HTTP client's refusal of a header is never quoted, ``verl-remote config --resolve`` and the run's record show a
secret's value as ``***`` (an ``${oc.env:...}`` one too), a token file others may read is warned about, and verl's
own launcher, which prints its config whole, is told where a secret of ``ray_kwargs`` went."""

from __future__ import annotations

import socket
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from omegaconf import OmegaConf

from verl_remote import one_line, read_token
from verl_remote.discovery.compose import compose_config
from verl_remote.kit.secrets import looks_secret, redact, secret_keys, service_environment
from verl_remote.runtime.record import read_run_record, write_run_record

pytestmark = pytest.mark.faults

TOKEN = "tok-abc123-do-not-print"


def _parts_of(text: str) -> list[str]:
    """The pieces of :data:`TOKEN` a message must not hold."""
    return [piece for piece in ("tok-abc", "abc123", "do-not-print", "123-do") if piece in text]


@pytest.mark.parametrize(
    "written",
    [
        "tok-abc123-\ndo-not-print\n",  # a line break inside (a token pasted over two lines)
        "tok-abc123-do-not-print extra\n",  # a space inside
        "tok-abc123-d\u00f6-not-print\n",  # a character no HTTP header carries
    ],
)
def test_a_token_with_whitespace_or_a_character_a_header_cannot_carry_is_refused_showing_none_of_it(
    written: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(written, encoding="utf-8")
    token_file.chmod(0o600)
    with pytest.raises(ValueError) as refused:
        read_token("remote_backend.comms.token_env", None, "remote_backend.comms.token_file", str(token_file))
    said = str(refused.value)
    assert said.startswith(f"remote_backend.comms.token_file={token_file}: the token has "), said
    assert "(not shown)" in said and _parts_of(said) == [], said
    monkeypatch.setenv("VERL_REMOTE_TEST_TOKEN", written)
    with pytest.raises(ValueError) as refused:
        read_token("remote_backend.api_key_env", "VERL_REMOTE_TEST_TOKEN", "remote_backend.api_key_file", None)
    assert str(refused.value).startswith("remote_backend.api_key_env=VERL_REMOTE_TEST_TOKEN: the token has ")
    assert _parts_of(str(refused.value)) == []


def test_a_token_file_others_may_read_is_warned_about_and_a_private_one_is_not(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o644)
    with pytest.warns(UserWarning, match=r"other users of this machine may read the token in it; chmod 600 ") as seen:
        assert read_token("a", None, "remote_backend.comms.token_file", str(token_file)) == TOKEN
    assert all(_parts_of(str(w.message)) == [] for w in seen)
    token_file.chmod(0o600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_token("a", None, "remote_backend.comms.token_file", str(token_file)) == TOKEN


@pytest.fixture
def listening_url() -> Iterator[str]:
    """A URL on 127.0.0.1 that takes connections and answers nothing (a request's headers are written to it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        stop = threading.Event()

        def take() -> None:
            sock.settimeout(0.2)
            while not stop.is_set():
                try:
                    sock.accept()[0].close()
                except OSError:
                    continue

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        stop.set()
        thread.join()


def test_an_http_clients_refusal_of_a_header_is_never_quoted(listening_url: str) -> None:
    """httpx refuses a header value with a line break in a message that quotes it whole: the token, where the
    header is ``Authorization: Bearer <token>``. Neither the core's one line nor verl-arctic's probe shows it."""
    from verl_arctic.client import ArcticError, probe_health

    header = {"Authorization": f"Bearer {TOKEN[:8]}\n{TOKEN[8:]}"}
    with pytest.raises(httpx.LocalProtocolError) as raised:
        httpx.get(f"{listening_url}/health", headers=header, timeout=5)
    assert "do-not-print" in str(raised.value)  # what httpx itself says
    said = one_line(raised.value)
    assert said.startswith("LocalProtocolError: the request was not sent: the HTTP client refused one of its header")
    assert _parts_of(said) == []
    try:
        raise RuntimeError("a call failed") from raised.value
    except RuntimeError as wrapped:
        assert _parts_of(one_line(wrapped)) == []
    with pytest.raises(ArcticError) as refused:
        probe_health(listening_url, timeout=5, headers=header)
    assert "httpx refused a header value (not shown" in str(refused.value)
    assert _parts_of(str(refused.value)) == []


def test_config_resolve_shows_a_secret_as_stars_after_resolving_it(
    cli_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VERL_REMOTE_TEST_PASSWORD", TOKEN)
    overrides = (
        "+remote_backend.password=${oc.env:VERL_REMOTE_TEST_PASSWORD}",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.HF_TOKEN={TOKEN}",
        "+remote_backend.token_env=VERL_REMOTE_TEST_PASSWORD",
    )
    code, resolved, err = cli_main("config", "--resolve", *overrides)
    assert code == 0, err[-2000:]
    assert _parts_of(resolved) == []
    shown = OmegaConf.create(resolved)
    assert shown.remote_backend.password == "***" and shown.ray_kwargs.ray_init.runtime_env.env_vars.HF_TOKEN == "***"
    assert shown.remote_backend.token_env == "VERL_REMOTE_TEST_PASSWORD"  # where the token is, not the token
    assert shown.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 16384  # a count, not a secret
    code, unresolved, _ = cli_main("config", *overrides)
    assert code == 0 and _parts_of(unresolved) == []
    assert "  password: ${oc.env:VERL_REMOTE_TEST_PASSWORD}\n" in unresolved  # where the secret comes from


def test_the_runs_record_holds_no_secret_and_what_export_needs_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VERL_REMOTE_TEST_PASSWORD", TOKEN)
    config = compose_config(
        [
            "remote_backend=arctic",
            f"trainer.default_local_dir={tmp_path}",
            "+remote_backend.comms.password=${oc.env:VERL_REMOTE_TEST_PASSWORD}",
            "remote_backend.comms.token_env=VERL_REMOTE_TEST_PASSWORD",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.WANDB_API_KEY={TOKEN}",
            "remote_backend.comms.url=http://127.0.0.1:7000",
        ]
    )
    path = write_run_record(config)
    assert _parts_of(Path(path).read_text()) == []
    recorded = read_run_record(str(tmp_path))
    assert recorded is not None
    assert recorded.remote_backend.comms.password == "***"
    assert recorded.ray_kwargs.ray_init.runtime_env.env_vars.WANDB_API_KEY == "***"
    assert recorded.remote_backend.comms.token_env == "VERL_REMOTE_TEST_PASSWORD"
    assert recorded.remote_backend.comms.url == "http://127.0.0.1:7000"
    assert recorded.actor_rollout_ref.model.path == config.actor_rollout_ref.model.path


def test_verl_remote_train_gives_verl_a_config_whose_ray_secrets_are_stars(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl prints the config its TaskRunner gets: ``verl-remote train`` hands it ``ray_kwargs`` with the secrets as
    ``***`` once Ray has them (the run in tests/test_train.py shows the workers have it and the log does not)."""
    from verl_remote.cli.run import without_ray_secrets

    config = compose_config([f"+ray_kwargs.ray_init.runtime_env.env_vars.HF_TOKEN={TOKEN}"])
    given = without_ray_secrets(config)
    assert given.ray_kwargs.ray_init.runtime_env.env_vars.HF_TOKEN == "***"
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.HF_TOKEN == TOKEN  # a restart's ray.init still has it
    assert OmegaConf.to_container(given.actor_rollout_ref) == OmegaConf.to_container(config.actor_rollout_ref)


def test_verls_own_launcher_is_told_that_it_printed_a_secret_of_ray_kwargs(capsys: pytest.CaptureFixture[str]) -> None:
    """verl's launcher prints ``ray init kwargs`` and the whole config before verl-remote's trainer exists: the
    trainer says so, naming the key and never its value, before anything else."""
    from verl_remote.integration.trainer import RemotePPOTrainer

    config = compose_config(
        ["algorithm.adv_estimator=gae", f"+ray_kwargs.ray_init.runtime_env.env_vars.HF_TOKEN={TOKEN}"]
    )
    with pytest.raises(ValueError, match="algorithm.adv_estimator=gae needs"):
        RemotePPOTrainer(config)
    said = capsys.readouterr().out
    assert (
        "verl-remote: ray_kwargs.ray_init.runtime_env.env_vars.HF_TOKEN looks like a secret, and verl's own launcher "
        "printed it into the run's log"
    ) in said
    assert _parts_of(said) == []


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("WANDB_API_KEY", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("PGPASSWORD", True),
        ("GITHUB_PAT", True),
        ("api_key", True),
        ("db_password", True),
        ("token_env", False),  # names where the token is
        ("api_key_file", False),
        ("prompt_key", False),  # verl's data column
        ("ppo_max_token_len_per_gpu", False),
        ("TOKENIZERS_PARALLELISM", False),
        ("PATH", False),
    ],
)
def test_what_looks_like_a_secret(name: str, secret: bool) -> None:
    assert looks_secret(name) is secret


def test_redaction_and_a_services_environment_follow_the_same_rule() -> None:
    tree = {"a": {"HF_TOKEN": "x", "n": [1, {"password": 3}], "url": "http://u:p@h:1", "token_env": "V"}}
    assert redact(tree) == {
        "a": {"HF_TOKEN": "***", "n": [1, {"password": "***"}], "url": "http://***@h:1", "token_env": "V"}
    }
    assert secret_keys(tree) == ["a.HF_TOKEN", "a.n.1.password"]
    environ = {"PATH": "/bin", "HF_TOKEN": "x", "MY_API_KEY": "y", "HOME": "/h"}
    assert service_environment(environ=environ) == {"PATH": "/bin", "HOME": "/h"}
    assert service_environment(["HF_TOKEN"], environ=environ) == {"PATH": "/bin", "HOME": "/h", "HF_TOKEN": "x"}


@pytest.mark.parametrize(
    ("backend", "setting"),
    [("arctic", "remote_backend.comms.token_file"), ("tinker", "remote_backend.api_key_file")],
)
def test_a_token_file_with_a_line_break_inside_stops_the_run_before_ray_and_shows_none_of_it(
    backend: str, setting: str, cli_main: Any, tmp_path: Path, dead_url: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-abc123-\ndo-not-print\n")
    token_file.chmod(0o600)
    url = "remote_backend.comms.url" if backend == "arctic" else "remote_backend.base_url"
    code, out, err = cli_main("train", f"remote_backend={backend}", f"{setting}={token_file}", f"{url}={dead_url}")
    assert code == 2, err[-2000:]
    said = err.strip().splitlines()[-1]
    assert said.endswith(
        f"{setting}={token_file}: the token has a line break or a space inside it (not shown); a token is one "
        "word: write it alone, on one line"
    ), err[-2000:]
    assert _parts_of(out + err) == []
