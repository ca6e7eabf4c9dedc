"""Which faults restart a run, how often, and from where (verl_remote.kit.faults, verl_remote.runtime.restarts); a
sampling request sent again after a transient fault (verl_remote.integration.rollout), and verl-arctic's calls that
only read (verl_arctic.client). The runs that restart
against each service, through a proxy that fails their requests: tests/arctic/test_arctic_train.py,
tests/tinker_service/test_tinker_server.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from omegaconf import OmegaConf

from conftest import processes_in
from verl_remote import is_transient, transient_status
from verl_remote.runtime.checkpoints import RECORD, TRACKER, seal
from verl_remote.runtime.restarts import Restarts, resumed_config
from verl_remote.runtime.summary import RunSummary

pytestmark = pytest.mark.faults


class _RayTaskError(RuntimeError):
    """What Ray raises for a remote call that failed: the call's own error in ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::Worker.update_actor() failed: {cause}")
        self.cause = cause


class _Answered(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionRefusedError(111, "Connection refused"), True),
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (TimeoutError("timed out"), True),
        (httpx.ConnectError("All connection attempts failed"), True),
        (httpx.ReadTimeout("read timed out"), True),
        (httpx.RemoteProtocolError("Server disconnected without sending a response."), True),
        (_Answered(502), True),
        (_Answered(503), True),
        (_Answered(504), True),
        (_Answered(429), True),
        (_Answered(408), True),
        (_Answered(400), False),  # a refusal would be refused again
        (_Answered(404), False),
        (_Answered(500), False),  # the service's own error: a bug or a bad batch, not a passing state
        (ValueError("a config error"), False),
        (AssertionError("a contract broken"), False),
        (_RayTaskError(ConnectionResetError(104, "reset")), True),  # a forwarder's call, through Ray
        (_RayTaskError(ValueError("shapes differ")), False),
        (_chained(RuntimeError("the step failed"), ConnectionRefusedError(111, "refused")), True),
        # What the error says of itself decides, before what it came from: a backend that knows better.
        (_chained(type("Lost", (RuntimeError,), {"transient": False})("no"), ConnectionError()), False),
    ],
)
def test_a_fault_is_transient_when_it_got_no_answer_or_an_answer_of_the_moment(
    error: BaseException, transient: bool
) -> None:
    assert is_transient(error) is transient
    assert transient_status(503) and not transient_status(None) and not transient_status(401)


def test_verl_arctic_names_a_lost_job_and_a_gateways_answer_transient_and_a_refusal_not() -> None:
    from verl_arctic.client import ArcticClient, ArcticError
    from verl_arctic.routes import route

    client = ArcticClient("http://127.0.0.1:9", generation="main")
    spec = route("main", "forward_backward")

    def failed(status: int, detail: str) -> ArcticError:
        answer = httpx.Response(status, json={"detail": detail})
        return client._fail("forward_backward", spec, "http://127.0.0.1:9/forward_backward?job_id=3", answer)

    lost = failed(404, "Job 3 not found")  # the server restarted: the run's jobs are gone
    assert is_transient(lost) and str(lost).endswith("; the server no longer has the job: it restarted")
    assert is_transient(failed(502, "Bad Gateway")) and is_transient(failed(503, "Service Unavailable"))
    assert not is_transient(failed(400, "Job 3 is not a training job"))
    assert not is_transient(failed(404, "Not Found"))  # a route the server does not have: a wrong URL
    assert not is_transient(ArcticError("answered with no log-probs"))
    client.close()


def test_verl_remote_tinker_names_a_lost_model_transient() -> None:
    from verl_remote_tinker.session import TinkerError, lost_model

    said = "ValueError: Error retrieving result: Error code: 400 - {'detail': 'Model 7b2c not loaded'}"
    assert lost_model(said) and not lost_model("Error code: 400 - {'detail': 'Invalid loss_fn'}")
    assert is_transient(TinkerError("Tinker call sample (http://x): ...", transient=True))
    assert not is_transient(TinkerError("Tinker call sample (http://x): HTTP 400: bad request"))


def test_restarts_are_bounded_and_stop_on_a_deterministic_or_repeated_fault() -> None:
    restarts = Restarts(max=2, backoff_s=10, max_backoff_s=15)
    refused = ConnectionRefusedError(111, "Connection refused to 127.0.0.1:40123")
    assert restarts.refusal(ValueError("bad batch"), step=3) == "not transient"
    assert restarts.count == 0
    assert restarts.refusal(refused, step=3) is None and restarts.count == 1 and restarts.wait_s() == 10
    # The same fault at the same step right after a restart (its port and ids aside) would come again.
    again = ConnectionRefusedError(111, "Connection refused to 127.0.0.1:40999")
    assert restarts.refusal(again, step=3) == "the same fault at step 3 right after a restart"
    # Elsewhere it is another restart, waiting longer, up to the cap; then no more.
    assert restarts.refusal(again, step=5) is None and restarts.count == 2 and restarts.wait_s() == 15
    assert restarts.refusal(_Answered(502), step=6) == "a transient fault, after 2 restarts (remote_restart.max=2)"
    off = Restarts(max=0, backoff_s=1, max_backoff_s=1)
    assert off.refusal(refused, step=1) == "a transient fault; restarts are off (remote_restart.max=0)"
    said = {"remote_restart": {"max": 3, "backoff_s": 10, "max_backoff_s": 120}}
    settings = Restarts.from_config(OmegaConf.create(said))
    assert (settings.max, settings.backoff_s, settings.max_backoff_s) == (3, 10.0, 120.0)
    assert Restarts.from_config(OmegaConf.create({})).max == 0  # verl's own config, without verl-remote's


def test_a_restarted_runs_summary_keeps_each_step_once_from_the_attempt_that_trained_it_last() -> None:
    summary = RunSummary()
    summary.extend(RunSummary([0.1, 0.2, 0.3, 0.4], first_step=1))  # steps 1-4, then a fault at step 5
    summary.extend(RunSummary([0.33, 0.44, 0.5], first_step=3))  # resumed from step 2's checkpoint
    assert (summary.first_step, summary.rewards) == (1, [0.1, 0.2, 0.33, 0.44, 0.5])
    summary.extend(RunSummary())  # an attempt that failed before its first step
    summary.restarts = 2
    assert summary.line() == (
        "verl-remote: 5 steps (1-5); mean reward 0.210 over the first 3, 0.423 over the last 3; restarted 2 times"
    )
    resumed = RunSummary()
    resumed.extend(RunSummary([0.6], first_step=7))  # a command that resumed a checkpoint of an earlier one
    assert (resumed.first_step, resumed.rewards) == (7, [0.6])


def _checkpoint(folder: Path, step: int, when: float) -> None:
    path = folder / f"global_step_{step}"
    (path / "actor").mkdir(parents=True)
    (path / "actor" / "model.pt").write_bytes(b"weights")
    seal(str(path))
    os.utime(path / RECORD, (when, when))
    (folder / TRACKER).write_text(str(step))


def test_a_restart_resumes_from_the_newest_checkpoint_this_command_saved_else_from_where_it_began(
    tmp_path: Path,
) -> None:
    config = OmegaConf.create(
        {"trainer": {"default_local_dir": str(tmp_path), "resume_mode": "auto", "resume_from_path": None}}
    )
    began = time.time()
    assert resumed_config(config, began) == (config, 0)  # nothing saved yet: from the start
    _checkpoint(tmp_path, 4, began - 3600)  # an earlier command's
    again, step = resumed_config(config, began)
    assert (again, step) == (config, 4)  # as the command began: auto resumes step 4
    _checkpoint(tmp_path, 6, began + 1)
    _checkpoint(tmp_path, 8, began + 2)
    again, step = resumed_config(config, began)
    assert step == 8 and again.trainer.resume_mode == "resume_path"
    assert again.trainer.resume_from_path == str(tmp_path / "global_step_8")
    assert config.trainer.resume_mode == "auto"  # the command's own config is left as it was
    (tmp_path / "global_step_8" / "actor" / "model.pt").write_bytes(b"cut")  # damaged after its save
    assert resumed_config(config, began)[1] == 6
    fresh = OmegaConf.merge(config, {"trainer": {"resume_mode": "disable"}})
    assert resumed_config(fresh, time.time() + 60) == (fresh, 0)


class _Flaky:
    """A rollout server's sample that fails ``failures`` times with ``error``, then samples."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self, prompt_ids: list[int], params: Any) -> Any:
        from verl_remote import SampleResult

        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return SampleResult([5, 2])


@pytest.mark.parametrize(
    ("failures", "error", "calls", "fails"),
    [
        (2, ConnectionResetError(104, "reset"), 3, False),  # one 502 costs a retry, not the step
        (3, ConnectionResetError(104, "reset"), 3, True),  # a fault that outlasts the retries fails the request
        (1, ValueError("refused"), 1, True),  # a refusal is not sent again
        (2, TimeoutError("no answer within 120 s"), 1, True),  # it took the request's whole timeout: no retry
    ],
)
def test_a_sampling_request_is_sent_again_after_a_transient_fault_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch, failures: int, error: BaseException, calls: int, fails: bool
) -> None:
    from verl_remote import SamplingParams
    from verl_remote.integration import server as rollout

    monkeypatch.setattr(rollout, "SAMPLE_RETRY_WAIT_S", 0.01)
    if isinstance(error, TimeoutError):  # as if the try took longer than the window
        monkeypatch.setattr(rollout, "SAMPLE_RETRY_WINDOW_S", -1.0)
    server = rollout.RemoteRolloutServer.__new__(rollout.RemoteRolloutServer)
    server.retried = 0
    sample = _Flaky(failures, error)
    server.sample = sample  # type: ignore[method-assign]
    params = SamplingParams.from_verl({}, max_tokens=4, stop_token_ids=[2])
    if fails:
        with pytest.raises(type(error)):
            asyncio.run(server._sample_retrying([1, 2], params))
    else:
        assert asyncio.run(server._sample_retrying([1, 2], params)).token_ids == [5, 2]
    assert sample.calls == calls
    assert asyncio.run(server.take_retried()) == calls - 1 and server.retried == 0


def test_the_command_restarts_a_run_after_a_transient_fault_and_stops_when_it_comes_again(
    cli_main: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``verl-remote train``'s loop around the run (its runs end to end: tests/arctic/test_arctic_train.py): each
    attempt gets the config as the command composed it, resumed from the checkpoint the last attempt saved; the
    lines name each restart; the same fault at the same step right after a restart stops it."""
    from verl_remote.cli import run as train

    folder = tmp_path / "c"
    attempts: list[dict[str, Any]] = []

    def run(config: Any, report: RunSummary, *, restarts: int = 0) -> None:
        attempts.append(
            {"resume": (str(config.trainer.resume_mode), config.trainer.resume_from_path), "restarts": restarts}
        )
        config.trainer.v1.trainer_mode = "sync"  # what verl's trainer does to the config it is given
        first = 1 if len(attempts) == 1 else 3
        report.take(RunSummary([0.1 * first, 0.2 * first], first_step=first))
        if not (folder / "global_step_2").exists():
            _checkpoint(folder, 2, time.time())  # step 2 saved, then step 3 loses its connection
        raise ConnectionResetError(104, f"Connection reset by peer (attempt {len(attempts)})")

    monkeypatch.setattr(train, "run", run)
    overrides = ("train", "trainer.total_training_steps=4", f"trainer.default_local_dir={folder}")
    code, _out, err = cli_main(*overrides, "remote_restart.backoff_s=0.01")
    assert code == 1, err[-3000:]
    assert attempts == [
        {"resume": ("auto", None), "restarts": 0},
        {"resume": ("resume_path", str(folder / "global_step_2")), "restarts": 1},
        {"resume": ("resume_path", str(folder / "global_step_2")), "restarts": 2},
    ]
    lines = err.strip().splitlines()
    restarted = [line for line in lines if line.startswith("verl-remote: restart ")]
    assert restarted == [
        "verl-remote: restart 1 of 3 in 0.01 s, from global_step_2: a transient fault at step 3: "
        "ConnectionResetError: [Errno 104] Connection reset by peer (attempt 1)",
        "verl-remote: restart 2 of 3 in 0.02 s, from global_step_2: a transient fault at step 5: "
        "ConnectionResetError: [Errno 104] Connection reset by peer (attempt 2)",
    ]
    assert lines[-5:-1] == [
        "verl-remote: 4 steps (1-4); mean reward 0.200 over the first 3, 0.367 over the last 3; restarted 2 times",
        f"verl-remote: the last complete checkpoint is {folder}/global_step_2; the same command resumes from it",
        "verl-remote: not restarted: the same fault at step 5 right after a restart",
        lines[-2],  # where the full output is
    ]
    assert lines[-1] == (
        "verl-remote train: the run failed: ConnectionResetError: [Errno 104] Connection reset by peer (attempt 3)"
    )

    # Restarts off: the first transient fault stops the run, saying why it was not restarted.
    attempts.clear()
    code, _out, err = cli_main(*overrides, "remote_restart.max=0", "trainer.resume_mode=disable")
    assert code == 1 and len(attempts) == 1
    assert "verl-remote: not restarted: a transient fault; restarts are off (remote_restart.max=0)" in err


@pytest.mark.parametrize(
    ("signum", "exit_code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated by SIGTERM")],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_or_sigterm_while_the_run_waits_to_restart_ends_it_at_once(
    cli_main: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, signum: int, exit_code: int, said: str
) -> None:
    """The signal comes as the 600 s wait before a restart begins: the wait ends there, the command exits 130 or 143
    and makes no other attempt. The attempt before released everything in its own ``finally`` (the runs that
    restart against each service: tests/arctic/test_arctic_train.py), so nothing of the run is left to stop."""
    from verl_remote.cli import run as train

    attempts: list[int] = []
    waits: list[float] = []

    def run(config: Any, report: RunSummary, *, restarts: int = 0) -> None:
        attempts.append(restarts)
        raise ConnectionResetError(104, "Connection reset by peer")

    class Clock:
        """The run module's ``time``, its ``sleep`` the wait's: the signal arrives in it, as Ctrl-C or kill would."""

        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            waits.append(seconds)
            # SIG_DFL would end this test process (SIGTERM's default): the wait must have a handler of its own.
            assert signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN), signal.getsignal(signum)
            signal.raise_signal(signum)  # its handler runs here, in this (the main) thread
            waits.append(-1.0)  # the wait went on after the signal

    monkeypatch.setattr(train, "run", run)
    monkeypatch.setattr(train, "time", Clock())
    monkeypatch.setattr(train, "_TERMINATED", False)  # SIGTERM's handler sets it: this test's only
    overrides = ("remote_restart.backoff_s=600", "remote_restart.max_backoff_s=600")
    code, _out, err = cli_main("train", *overrides, f"trainer.default_local_dir={tmp_path / 'c'}")
    assert (code, attempts, waits) == (exit_code, [0], [600.0]), err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1] == f"verl-remote train: {said}"
    assert (
        "verl-remote: restart 1 of 3 in 600 s, from the start: a transient fault at step 1: "
        "ConnectionResetError: [Errno 104] Connection reset by peer"
    ) in lines
    assert processes_in(tmp_path) == {}


class _Answers:
    """An HTTP server on 127.0.0.1 that answers each request with the next of its ``script`` (a status, or ``None``:
    the connection closed without an answer), then 200 with ``{"status": "OK"}``; it counts the requests."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.script: list[int | None] = []
        self.requests = 0
        answers = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                answers.requests += 1
                status = answers.script.pop(0) if answers.script else 200
                if status is None:
                    self.close_connection = True  # no answer at all: a network error for the client
                    return
                body = b'{"status": "OK"}' if status == 200 else b'{"detail": "of the moment"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, script: list[int | None]) -> None:
        """Answer the next requests with ``script``, counting them afresh."""
        self.script, self.requests = list(script), 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("generation", ["v0.1", "main"])
def test_verl_arctic_sends_a_call_that_only_reads_again_after_a_network_error_or_a_5xx_after_1_2_and_4_s(
    monkeypatch: pytest.MonkeyPatch, generation: str
) -> None:
    """health, status, job and weight-norm: three more tries, 1, 2 and 4 s apart (remote_backend.comms.retries, 3
    by default); a 4xx is not sent again; every call that changes state is sent once, whatever comes back."""
    from verl_arctic import client as client_module
    from verl_arctic.client import ArcticError
    from verl_arctic.routes import _ROUTES
    from verl_arctic.settings import ArcticSettings
    from verl_remote.discovery.compose import compose_config

    waits: list[float] = []

    class Clock:
        """The client module's ``time``: its waits between tries recorded, not slept."""

        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        sleep = staticmethod(waits.append)

    monkeypatch.setattr(client_module, "time", Clock())

    answers = _Answers()
    config = compose_config(["remote_backend=arctic", f"remote_backend.comms.url={answers.url}"])
    assert config.remote_backend.comms.retries == 3

    def tried(operation: str, script: list[int | None], retries: int = 3) -> tuple[int, list[float], str]:
        """How often ``operation`` was sent against answers ``script``, the waits between, and its outcome."""
        answers.answer(script)
        waits.clear()
        config.remote_backend.comms.retries = retries
        client = ArcticSettings.of(config).client(generation)
        try:
            client.call(operation, job_id=1, body={})
            outcome = "answered"
        except ArcticError as exc:
            outcome = f"failed (transient: {is_transient(exc)})"
        finally:
            client.close()
        return answers.requests, list(waits), outcome

    reading = {"health", "status", "job", "weight_norm"}
    assert {name for name, spec in _ROUTES[generation].items() if spec.idempotent} == reading
    try:
        for operation in sorted(_ROUTES[generation]):
            if operation in reading:  # after a 503 and a cut connection, or four 503s
                assert tried(operation, [503, None, 502]) == (4, [1.0, 2.0, 4.0], "answered"), operation
                assert tried(operation, [503] * 4) == (4, [1.0, 2.0, 4.0], "failed (transient: True)"), operation
                assert tried(operation, [404]) == (1, [], "failed (transient: False)"), operation
            else:  # the server may have done it: once
                assert tried(operation, [503]) == (1, [], "failed (transient: True)"), operation
                assert tried(operation, [None]) == (1, [], "failed (transient: True)"), operation
        assert tried("health", [503] * 4, retries=1) == (2, [1.0], "failed (transient: True)")
        assert tried("health", [503], retries=0) == (1, [], "failed (transient: True)")
    finally:
        answers.close()
