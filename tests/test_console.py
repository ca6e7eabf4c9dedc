"""The run's console: which lines a person sees, and that the log file keeps every line.

The lines are copied from the output of real runs (Ray's process prefixes and colours included).
"""

from __future__ import annotations

import io
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from verl_remote.cli.console import Console, duration, is_error, shown, step_fields, step_line, step_metrics

RAY = "\x1b[36m(RemoteTaskRunner pid=11066)\x1b[0m "
# verl's metrics line of a demo step (95 fields in all; a few of each kind kept, numpy's reprs among them).
STEP = (
    "step:1 - global_seqlen/min:765.0 - actor/pg_loss:-0.09741254895925522 - actor/grad_norm:0.9156891703605652 - "
    "critic/score/mean:0.103515625 - response_length/mean:6.953125 - num_turns/mean:np.float64(2.0) - "
    "training/off_policy/trajectory_staleness/max:np.int64(0) - timing_s/step:34.30806676999998 - "
    "perf/total_num_tokens:765 - perf/throughput:22.2979628997615"
)
#: What the console shows for it as a run's first of 4 steps: no time left yet (the pace needs two steps).
ROW = "step 1/4  reward 0.104  len 7.0  loss -0.0974  grad 0.916  34.3 s/step  22 tok/s"

NOISE = [
    "/site-packages/verl/workers/engine/__init__.py:32: UserWarning: torchtitan engine is not available: "
    "ModuleNotFoundError(\"No module named 'torchtitan'\")",
    "WARNING:2026-11-30 12:15:54,510:target_num_threads 8 should not exceed total physical CPU cores 2.",
    "2026-11-30 12:15:11,837\tINFO worker.py:2029 -- Started a local Ray instance.",
    "W1130 12:15:54.438000 11222 torch/fx/_symbolic_trace.py:56] is_fx_tracing will return true",
    "                         'enable': False,",
    "Using dataset class: RLHFDataset",
    '  File "/site-packages/verl/experimental/agent_loop/agent_loop.py", line 301, in generate',
    "WARNING:2026-11-30 12:15:54,510:No model-specific Continuous Token builder is registered for Qwen2",
]
SHOWN = [
    "verl-remote: training with backend 'local' for 2 steps",
    "WARNING:2026-11-30 10:01:02,003:verl-remote: the latest checkpoint is damaged",
    "verl-arctic: destroyed sampling job 3 on http://127.0.0.1:8000, left by a run that did not end cleanly",
    STEP,
    "ERROR:2026-11-30 12:19:27,107:Error in _run_prompt for uid=36c40768-fc9f-4463-81fd-d2d56f922134",
    "verl_remote_faulty_backend.backend.InjectedFailure: faulty backend: injected failure in generate",
    "ray.exceptions.RayTaskError(InjectedFailure): ray::LocalRolloutServer.generate() (pid=15999)",
    "RuntimeError: Sync replay buffer selected terminal groups with no materializable trajectories.",
    "E1130 12:15:54.438000 11222 torch/distributed/c10d.cpp:56] connection reset",
    "[2026-11-30 12:00:00,000 E 123 456] core_worker.cc:720: Failed to register worker",
    "A worker died or was killed while executing a task",
]


@pytest.mark.parametrize("line", NOISE)
def test_noise_is_kept_off_the_console(line: str) -> None:
    assert not shown(line)


@pytest.mark.parametrize("line", SHOWN)
def test_our_lines_verls_step_lines_and_every_error_are_shown(line: str) -> None:
    assert shown(line)


def test_warnings_of_verl_and_ray_are_not_errors() -> None:
    assert not is_error("WARNING:2026-11-30:Platform 'nvidia' (PlatformCUDA) is registered but not available.")
    assert not is_error("UserWarning: megatron engine is not available: ModuleNotFoundError('megatron')")


class _Terminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _console(
    monkeypatch: pytest.MonkeyPatch, *, tty: bool = False, verbose: bool = False
) -> tuple[Console, _Terminal, _Terminal]:
    out, err = _Terminal(tty), _Terminal(tty)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    console = Console(verbose=verbose)
    console.install()
    return console, out, err


def test_the_console_shows_the_run_and_the_log_keeps_every_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    console, out, err = _console(monkeypatch)
    print("early noise from importing verl", file=sys.stderr)  # before the log file is known: kept in memory
    console.open_log(tmp_path / "logs" / "run.log")
    console.total_steps = 4
    print("verl-remote: training")
    for line in NOISE:
        print(RAY + line, file=sys.stderr)
    sys.stdout.write(RAY + STEP[:20])  # Ray writes whole lines; a print may come in pieces
    sys.stdout.write(STEP[20:] + "\n")
    for uid in ("36c40768-fc9f-4463-81fd-d2d56f922134", "0b1e2a3c-1111-2222-3333-444455556666"):
        print(f"{RAY}ERROR:2026-11-30 12:19:27,107:Error in _run_prompt for uid={uid}", file=sys.stderr)
    console.uninstall()

    assert sys.stdout is out and sys.stderr is err
    assert out.getvalue().splitlines() == ["verl-remote: training", ROW]
    assert err.getvalue().splitlines() == [
        "(RemoteTaskRunner pid=11066) ERROR:2026-11-30 12:19:27,107:Error in _run_prompt for uid="
        "36c40768-fc9f-4463-81fd-d2d56f922134"
    ]
    assert console.repeated_errors == 1  # the same error for another prompt is counted, not shown
    log = (tmp_path / "logs" / "run.log").read_text().splitlines()
    assert len(log) == 1 + 1 + len(NOISE) + 1 + 2
    assert log[0].endswith(" early noise from importing verl")
    assert all("\x1b" not in line for line in log)
    assert any(line.endswith("(RemoteTaskRunner pid=11066) Using dataset class: RLHFDataset") for line in log)
    # verl's whole metrics line, numpy's reprs as plain numbers.
    assert [line.split(" ", 1)[1] for line in log if "step:1 " in line] == [
        "(RemoteTaskRunner pid=11066) " + STEP.replace("np.float64(2.0)", "2.0").replace("np.int64(0)", "0")
    ]


def test_a_line_said_by_every_process_is_shown_once(monkeypatch: pytest.MonkeyPatch) -> None:
    console, out, _err = _console(monkeypatch)
    for pid in (1, 2, 3):
        print(f"(pid={pid}) WARNING:2026-11-30:verl-remote: backend 'twin' is registered more than once")
    console.uninstall()
    assert out.getvalue() == "verl-remote: backend 'twin' is registered more than once\n"


def test_verl_cutting_prompts_is_said_once_with_the_keys_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's agent loop left-truncates a prompt longer than the rollout's prompt length with a warning; the run's
    data is then not what the user meant, so the console says so once (the words are verl 0.9.1's own, from
    verl/experimental/agent_loop/agent_loop.py, checked below)."""
    import verl.experimental.agent_loop.agent_loop as agent_loop

    assert (
        "Prompt of %d tokens exceeds rollout.prompt_length=%d; left-truncating."
        in Path(agent_loop.__file__).read_text()
    )
    console, out, _err = _console(monkeypatch)
    for tokens in (133, 140):
        print(
            f"{RAY}WARNING:2026-12-05 04:17:40,1:Prompt of {tokens} tokens exceeds rollout.prompt_length=64; "
            "left-truncating."
        )
    console.uninstall()
    assert out.getvalue().splitlines() == [
        "verl-remote: verl cuts prompts longer than rollout.prompt_length=64 (data.max_prompt_length) to their last 64 "
        "tokens, one of 133 among them: raise data.max_prompt_length, or drop such prompts with "
        "data.filter_overlong_prompts=true (the log names each)"
    ]


def test_verbose_shows_everything(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    console, _out, err = _console(monkeypatch, verbose=True)
    console.open_log(tmp_path / "run.log")
    for line in NOISE:
        print(RAY + line, file=sys.stderr)
    console.uninstall()
    assert err.getvalue() == "".join(RAY + line + "\n" for line in NOISE)
    assert len((tmp_path / "run.log").read_text().splitlines()) == len(NOISE)


def test_on_a_terminal_the_bar_then_the_step_row_are_drawn_in_place_and_elsewhere_each_step_is_a_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    bar = "Training Progress:   0%|          | 0/4 [00:00<?, ?it/s]"
    console, out, err = _console(monkeypatch, tty=True)
    print(RAY + "\r" + bar, file=sys.stderr)  # the total comes from verl's bar when the config does not say
    print(RAY + STEP)
    print(RAY + STEP)  # the same line again (a cluster's second log monitor): shown once
    print(RAY + "\rTraining Progress:  25%|##5       | 1/4 [00:34<01:43, 34.30s/it]", file=sys.stderr)
    print("verl-remote: saved")  # a line of ours: printed above the row, which is drawn again below it
    console.uninstall()
    assert err.getvalue() == f"\r\x1b[K{bar}\n"  # the bar until the first step; the row's line ended on the way out
    assert out.getvalue() == f"\r\x1b[K{ROW}\r\x1b[Kverl-remote: saved\n{ROW}"

    monkeypatch.setenv("COLUMNS", "60")  # a narrow terminal: the fields that do not fit are left out, not cut
    console, out, _err = _console(monkeypatch, tty=True)
    console.total_steps = 4
    print(RAY + STEP)
    console.uninstall()
    assert out.getvalue() == "\r\x1b[Kstep 1/4  reward 0.104  len 7.0  loss -0.0974  grad 0.916"

    console, out, err = _console(monkeypatch, tty=False)
    arrivals = iter([100.0, 130.0])  # step 2's line 30 s after step 1's
    console.clock = lambda: next(arrivals)  # type: ignore[method-assign]
    print(RAY + bar, file=sys.stderr)
    print(RAY + "step:0 - val-core/demo/reward/mean@1:0.125 - val-aux/demo/reward/std@1:0.2")  # before training
    print(RAY + STEP)
    print(RAY + STEP.replace("step:1 ", "step:2 "))
    console.uninstall()
    assert err.getvalue() == ""
    assert out.getvalue().splitlines() == [
        "step 0/4  val 0.125",
        ROW,
        ROW.replace("step 1/4", "step 2/4  1:00 left"),  # 2 steps left at the run's own pace, 30 s a step
    ]


def test_once_the_run_is_stopping_only_our_lines_are_shown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    console, out, err = _console(monkeypatch)
    console.open_log(tmp_path / "run.log")
    console.stopping()
    print("\nverl-remote: interrupted; destroying the backend ...", file=sys.stderr)
    print(
        f"{RAY}ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.", file=sys.stderr
    )
    print(RAY + STEP)
    console.uninstall()
    assert out.getvalue() == ""
    assert err.getvalue() == "verl-remote: interrupted; destroying the backend ...\n"
    assert "ActorDiedError" in (tmp_path / "run.log").read_text()  # the log still has everything


def test_a_line_one_thread_has_begun_does_not_take_in_anothers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The TaskRunner's thread draws verl's progress bar (a line it ends only when the bar closes) while Ray's log
    thread forwards the workers' lines to the same stream: each thread's line stays its own."""
    console, _out, err = _console(monkeypatch)
    console.open_log(tmp_path / "run.log")
    bar = threading.Thread(target=lambda: sys.stderr.write("\rTraining Progress:  25%|##5       | 2/8"))
    bar.start()
    bar.join()
    said = "verl-remote: global_profiler.steps asks for a profile"
    print(f"{RAY}WARNING:2026-12-05 17:36:07,288:{said}", file=sys.stderr)
    console.uninstall()
    assert err.getvalue() == f"{said}\n"
    log = (tmp_path / "run.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in log] == [
        f"(RemoteTaskRunner pid=11066) WARNING:2026-12-05 17:36:07,288:{said}",
        "Training Progress:  25%|##5       | 2/8",
    ]


def test_a_step_line_reads_as_numbers() -> None:
    step, metrics = step_metrics(RAY + STEP) or (None, {})
    assert step == 1 and metrics["num_turns/mean"] == 2.0 and metrics["perf/total_num_tokens"] == 765.0
    assert step_metrics("Using dataset class: RLHFDataset") is None
    assert [duration(s) for s in (0.4, 42, 185, 7800)] == ["0:00", "0:42", "3:05", "2:10:00"]
    assert step_line(step_fields(7, {"critic/score/mean": 0.5})) == "step 7  reward 0.500"


def test_after_the_run_a_kept_reference_writes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    console, _out, err = _console(monkeypatch)
    kept = sys.stderr  # a logging handler made during the run keeps the stream it found
    console.uninstall()
    kept.write("Traceback (most recent call last):\n")
    assert err.getvalue() == "Traceback (most recent call last):\n"


RAYLET_DIED = (
    "\x1b[33m(raylet)\x1b[0m Raylet is terminated. Termination is unexpected. Possible reasons include: (1) SIGKILL "
    "by the user or system OOM killer, (2) Invalid memory access from Raylet causing SIGSEGV or SIGBUS, (3) Other "
    "termination signals. Last 20 lines of the Raylet logs:"
)


@pytest.mark.faults
def test_a_run_ray_dies_under_ends_with_its_summary_and_one_line_naming_what_died(
    cli_main: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The raylet killed after step 2 (SIGKILL, the OOM killer): the driver's call fails with a closed connection,
    and what it says is no help. The run's steps came through the console; Ray's own line says what died."""
    import ray.exceptions

    from verl_remote.cli import run as train

    def run(config: Any, report: train.RunSummary, **kwargs: Any) -> None:
        for step in (1, 2):
            print(RAY + STEP.replace("step:1 ", f"step:{step} "))
        print(
            "(raylet) A worker died or was killed while executing a task by an unexpected system error.",
            file=sys.stderr,
        )
        print(RAYLET_DIED, file=sys.stderr)
        raise ray.exceptions.ActorUnavailableError(
            "The actor is temporarily unavailable: RpcError: Socket closed", None
        )

    monkeypatch.setattr(train, "run", run)
    code, out, err = cli_main("train", "trainer.total_training_steps=4", f"trainer.default_local_dir={tmp_path / 'c'}")
    assert code == 1, err[-3000:]
    assert out.splitlines()[-2:] == [ROW, ROW.replace("step 1/4", "step 2/4  0:00 left")]  # no time between them
    assert "verl-remote: 2 steps (1-2); mean reward 0.104 over the first 2, 0.104 over the last 2" in err
    assert err.strip().splitlines()[-1] == (
        "verl-remote train: the run failed: Ray's raylet died under the run ('Raylet is terminated'); its calls then "
        "failed (ActorUnavailableError)"
    )


class _Clock:
    """The console module's ``time`` in a test: ``sleep`` moves the clock on at once, and the workers' lines due by
    then arrive as they would have meanwhile. Its times are exact fractions, so what a wait returns is decided by the
    lines' times alone, not raced against a busy machine or rounded."""

    strftime = staticmethod(time.strftime)

    def __init__(self) -> None:
        self.now = Fraction(100)
        self.due: list[tuple[Fraction, str]] = []  # (when, line), in order

    def monotonic(self) -> Fraction:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += Fraction(str(seconds))
        while self.due and self.due[0][0] <= self.now:
            print(self.due.pop(0)[1])

    def lines(self, count: int, every_s: float) -> None:
        """``count`` worker lines, one every ``every_s`` from now on."""
        every = Fraction(str(every_s))
        self.due = [(self.now + (i + 1) * every, f"verl-remote: a worker's last line {i}") for i in range(count)]


def test_at_the_end_it_waits_for_the_workers_last_lines_until_they_stop_coming(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What cli/run.py waits before Ray shuts down: at least the quiet, longer while lines still come, never more
    than the bound."""
    from verl_remote.cli import console as console_module

    clock = _Clock()
    monkeypatch.setattr(console_module, "time", clock)
    console, out, _err = _console(monkeypatch)
    assert console.wait_for_quiet(quiet_s=0.25, at_most_s=5.0) == 0.25  # nothing comes: the quiet itself

    clock.lines(8, every_s=0.1)  # the last 0.8 s on
    assert console.wait_for_quiet(quiet_s=0.25, at_most_s=5.0) == pytest.approx(0.8 + 0.25)  # then the quiet
    assert clock.due == [] and out.getvalue().splitlines()[-1] == "verl-remote: a worker's last line 7"

    clock.lines(30, every_s=0.1)  # until 3 s on: the bound ends the wait, 10 lines in
    assert console.wait_for_quiet(quiet_s=0.25, at_most_s=1.0) == 1.0
    assert len(clock.due) == 20 and out.getvalue().splitlines()[-1] == "verl-remote: a worker's last line 9"
    console.uninstall()
