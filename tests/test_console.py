"""The run's console: which lines a person sees, and that the log file keeps every line.

The lines are copied from the output of real runs (Ray's process prefixes and colours included).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from verl_remote.console import Console, is_error, shown

RAY = "\x1b[36m(RemoteTaskRunner pid=11066)\x1b[0m "
STEP = "step:1 - global_seqlen/min:757.0 - actor/pg_loss:0.01 - critic/score/mean:0.125"

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
    print("verl-remote: training")
    for line in NOISE:
        print(RAY + line, file=sys.stderr)
    sys.stdout.write(RAY + STEP[:20])  # Ray writes whole lines; a print may come in pieces
    sys.stdout.write(STEP[20:] + "\n")
    for uid in ("36c40768-fc9f-4463-81fd-d2d56f922134", "0b1e2a3c-1111-2222-3333-444455556666"):
        print(f"{RAY}ERROR:2026-11-30 12:19:27,107:Error in _run_prompt for uid={uid}", file=sys.stderr)
    console.uninstall()

    assert sys.stdout is out and sys.stderr is err
    assert out.getvalue().splitlines() == ["verl-remote: training", STEP]  # Ray's prefix dropped
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


def test_a_line_said_by_every_process_is_shown_once(monkeypatch: pytest.MonkeyPatch) -> None:
    console, out, _err = _console(monkeypatch)
    for pid in (1, 2, 3):
        print(f"(pid={pid}) WARNING:2026-11-30:verl-remote: backend 'twin' is registered more than once")
    console.uninstall()
    assert out.getvalue() == "verl-remote: backend 'twin' is registered more than once\n"


def test_verbose_shows_everything(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    console, _out, err = _console(monkeypatch, verbose=True)
    console.open_log(tmp_path / "run.log")
    for line in NOISE:
        print(RAY + line, file=sys.stderr)
    console.uninstall()
    assert err.getvalue() == "".join(RAY + line + "\n" for line in NOISE)
    assert len((tmp_path / "run.log").read_text().splitlines()) == len(NOISE)


def test_the_progress_bar_is_drawn_in_place_on_a_terminal_and_left_out_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bar = "Training Progress:  50%|#####     | 1/2 [00:12<00:12, 12.60s/it]"
    console, out, err = _console(monkeypatch, tty=True)
    print(RAY + bar, file=sys.stderr)
    print(RAY + STEP)
    console.uninstall()
    assert err.getvalue() == f"\r\x1b[K{bar}\n"
    assert out.getvalue() == f"\r\x1b[K{STEP}\n{bar}"  # the bar is cleared, the line printed, the bar redrawn

    console, out, err = _console(monkeypatch, tty=False)
    print(RAY + bar, file=sys.stderr)
    console.uninstall()
    assert err.getvalue() == ""


def test_after_the_run_a_kept_reference_writes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    console, _out, err = _console(monkeypatch)
    kept = sys.stderr  # a logging handler made during the run keeps the stream it found
    console.uninstall()
    kept.write("Traceback (most recent call last):\n")
    assert err.getvalue() == "Traceback (most recent call last):\n"
