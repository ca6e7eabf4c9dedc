"""A service verl-arctic launches (``remote_backend.comms.launch``): only a command the user gave starts, never one
recorded in a run folder; it gets the environment it needs, not the credentials of the user's shell; it ends with
every process of its group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conftest import cli, free_port, last_line
from verl_arctic.launch import LaunchTimeoutError, launch_server, stop_server
from verl_arctic.record import POINTER_FILE
from verl_remote.demo.assets import ensure_demo_assets
from verl_remote.runtime.checkpoints import seal
from verl_remote.runtime.record import RUN_RECORD

pytestmark = pytest.mark.faults

#: A service in a file: answers /health, starts a child of its own (a worker, say) and writes down that child's pid
#: and the environment it was given.
SERVICE = textwrap.dedent(
    """
    import http.server, json, os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(sys.argv[2], "w") as out:
        json.dump({"child": child.pid, "env": dict(os.environ)}, out)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"status": "OK"}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_launched_service_gets_no_credential_it_was_not_given_and_ends_with_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "service.py").write_text(SERVICE)
    monkeypatch.setenv("VERL_REMOTE_TEST_API_KEY", "not-for-the-service")
    monkeypatch.setenv("VERL_REMOTE_TEST_PASSWORD", "not-for-the-service")
    monkeypatch.setenv("HF_TOKEN", "the-service-needs-this-one")
    monkeypatch.setenv("VERL_REMOTE_TEST_PLAIN", "kept")
    port = free_port()
    said = tmp_path / "said.json"
    server = launch_server(
        f"python {tmp_path / 'service.py'} {port} {said}", f"http://127.0.0.1:{port}", 60, ["HF_TOKEN"]
    )
    try:
        seen = json.loads(said.read_text())
        env = seen["env"]
        assert "VERL_REMOTE_TEST_API_KEY" not in env and "VERL_REMOTE_TEST_PASSWORD" not in env
        assert env["HF_TOKEN"] == "the-service-needs-this-one"  # named in comms.launch_env
        assert env["VERL_REMOTE_TEST_PLAIN"] == "kept" and env["PATH"] == os.environ["PATH"]
        assert os.getpgid(server.pid) == server.pid != os.getpgid(0)  # a group of its own: Ctrl-C does not reach it
        assert _running(seen["child"])
    finally:
        stop_server(server, grace_s=10)
    assert server.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while _running(seen["child"]) and time.monotonic() < deadline:  # the child ends with its group, not later
        time.sleep(0.1)
    assert not _running(seen["child"]), "the service's own child outlived it"
    stop_server(server)  # again: nothing left, nothing raised


@contextlib.contextmanager
def _launch_url() -> Iterator[str]:
    """A URL on 127.0.0.1 for a service the test launches, where nothing listens until it does: its port stays bound
    for the test, so that nothing else is handed it meanwhile, as conftest's ``dead_url`` has it, but with
    ``SO_REUSEADDR``, so that the launch's own check (a port free to listen on: ``require_free_port``) passes."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def _run_folder(tmp_path: Path, launch: str, url: str) -> Path:
    """The folder of an Arctic run whose record names ``launch`` as the command that started its service, with one
    complete checkpoint: what a stranger could leave in a shared folder."""
    run = tmp_path / "shared-run"
    (run / "global_step_1" / "actor").mkdir(parents=True)
    (run / "global_step_1" / "actor" / POINTER_FILE).write_text(json.dumps({"step": 1, "generation": "main"}))
    (run / "latest_checkpointed_iteration.txt").write_text("1")
    seal(str(run / "global_step_1"))
    model = str(ensure_demo_assets().model_path)
    record = {
        "remote_backend": {"name": "arctic", "comms": {"url": url, "launch": launch, "startup_timeout_s": 30}},
        "actor_rollout_ref": {"model": {"path": model}},
        "trainer": {"default_local_dir": str(run)},
    }
    (run / RUN_RECORD).write_text(yaml.safe_dump(record))
    return run


def test_export_never_starts_the_program_a_run_folder_records_unless_the_command_line_names_it(
    tmp_path: Path, dead_url: str
) -> None:
    planted = tmp_path / "the-recorded-program-ran"
    program = tmp_path / "program.py"
    program.write_text(f"import pathlib\npathlib.Path({str(planted)!r}).touch()\n")
    launch = f"python {program}"
    run = _run_folder(tmp_path, launch, dead_url)
    refused = cli("export", str(run), "--out", str(tmp_path / "hf"), timeout=60)
    assert not planted.exists(), "export ran the program recorded in the run folder"
    assert refused.returncode == 2, refused.stderr[-2000:]
    # One look at the recorded address, refused there, not a launch waited for (its failure says "healthy").
    assert f"remote_backend.comms.url={dead_url}: nothing answers there" in last_line(refused.stderr), refused.stderr
    assert "healthy" not in refused.stderr, refused.stderr[-2000:]
    assert (
        f"verl-remote: the run's record names a program to start (remote_backend.comms.launch: {launch}); an export "
        "runs no program recorded in a run folder: to have it started, name it: "
    ) in refused.stdout
    assert not (tmp_path / "hf").exists()
    # Named on the command line, it is the user's: it runs (and, not a service, exits before answering), at an
    # address it may listen on (a launch refuses a port something holds, as dead_url's is).
    with _launch_url() as url:
        named = cli(
            "export",
            str(run),
            "--out",
            str(tmp_path / "hf"),
            f"remote_backend.comms.launch={launch}",
            f"remote_backend.comms.url={url}",
            timeout=60,
        )
    assert planted.exists(), named.stdout + named.stderr[-2000:]
    assert named.returncode == 1 and "exited with code 0 before becoming healthy" in named.stderr, named.stderr[-2000:]
    assert "the run's record names a program" not in named.stdout


def test_a_launch_never_healthy_times_out_as_no_transient_fault_and_is_stopped(tmp_path: Path) -> None:
    """A start-up timeout is not a fault of the moment: a restart would wait as long again (issue: three restarts of
    a 600 s wait). The launched program is stopped with its group."""
    from verl_remote import is_transient

    said = tmp_path / "pid"
    (tmp_path / "never_healthy.py").write_text(
        "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(300)\n"
    )
    command = f"python {tmp_path / 'never_healthy.py'} {said}"
    with _launch_url() as url, pytest.raises(LaunchTimeoutError) as late:
        launch_server(command, url, timeout=2)
    # Its timeout, not the program's exit minutes later ("exited with code 0 before becoming healthy").
    assert str(late.value) == (
        f"the Arctic server started with {command!r} was not healthy at {url} after 2s; raise "
        "remote_backend.comms.startup_timeout_s if it needs longer"
    )
    assert not is_transient(late.value)
    assert not _running(int(said.read_text())), "the launched program outlived its timeout"
