"""After the driver dies, however it dies, nothing of its run keeps running.

Every process of a run descends from the driver: Ray's GCS and raylet, Ray's agents, every worker, and what
workers start (a service a backend launches). ``verl-remote train`` starts this watchdog in its own session,
holding the read end of a pipe whose write end only the driver holds. While the driver lives, the watchdog
notes the driver's descendants every :data:`POLL_S`. The pipe ends when the driver ends: on a clean exit, an
exception, SIGKILL. The watchdog then waits :data:`GRACE_S` for Ray's own shutdown, sends SIGTERM to every
noted process still running (and what they started since), and SIGKILL to those left :data:`TERM_WAIT_S`
later. Without it Ray's agents outlive a killed driver by 30 to 150 seconds, and a launched service for good.

A process is known by its pid and its start time, so a pid the system reused is never signalled. Processes
of a Ray cluster the run only connects to (``ray_kwargs.ray_init.address``) are not the driver's
descendants: they are the cluster's, and Ray's owner-death cleanup ends the run's actors there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["BOUND_S", "descendants", "start_watchdog"]

POLL_S = 1.0
GRACE_S = 3.0
TERM_WAIT_S = 5.0
#: How long after the driver ends a process of its run can still be running.
BOUND_S = GRACE_S + TERM_WAIT_S + 2.0

Process = tuple[int, int]  # (pid, start time in clock ticks since boot)


def _table() -> dict[Process, int]:
    """Every process: (pid, start time) -> parent pid."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone
            continue
        # pid (comm) state ppid ... starttime is field 22; comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        table[(int(entry.name), int(fields[19]))] = int(fields[1])
    return table


def descendants(roots: set[int], table: dict[Process, int] | None = None) -> set[Process]:
    """The processes below the pids ``roots`` (not the roots themselves)."""
    table = _table() if table is None else table
    children: dict[int, list[Process]] = {}
    for process, parent in table.items():
        children.setdefault(parent, []).append(process)
    found: set[Process] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child[0])
    return found


def _alive(processes: set[Process]) -> set[Process]:
    table = _table()
    alive = {process for process in processes if process in table}
    # and what they started since the last look
    return alive | descendants({pid for pid, _ in alive}, table)


def _signal_all(processes: set[Process], signum: int) -> None:
    for pid, _ in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def sweep(noted: set[Process], grace_s: float = GRACE_S, term_wait_s: float = TERM_WAIT_S) -> set[Process]:
    """End the noted processes still running: SIGTERM, then SIGKILL. Returns those that had to be signalled."""
    time.sleep(grace_s)
    left = _alive(noted)
    if not left:
        return left
    _signal_all(left, signal.SIGTERM)
    deadline = time.monotonic() + term_wait_s
    while time.monotonic() < deadline and _alive(left):
        time.sleep(0.2)
    _signal_all(_alive(left), signal.SIGKILL)
    return left


def start_watchdog() -> int:
    """Start the watchdog of this process's run; returns the pipe's write end, to keep open until the end."""
    read_end, write_end = os.pipe()
    subprocess.Popen(
        [sys.executable, "-m", "verl_remote.runtime.watchdog", str(os.getpid()), str(read_end)],
        pass_fds=(read_end,),
        start_new_session=True,  # a Ctrl-C to the driver's process group must not reach it
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(read_end)
    return write_end


def main(argv: list[str]) -> int:
    driver, read_end = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    noted: set[Process] = set()
    ended = threading.Event()

    def wait_for_the_driver() -> None:
        while os.read(read_end, 4096):  # b"" once the driver, the only writer, is gone
            pass
        ended.set()

    threading.Thread(target=wait_for_the_driver, daemon=True).start()
    while not ended.wait(POLL_S):
        noted |= {process for process in descendants({driver}) if process[0] != os.getpid()}
    sweep(noted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
