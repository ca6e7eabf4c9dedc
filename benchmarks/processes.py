"""Every process of a command, watched from outside: what each is (the Ray actor it became), its CPU time, and a
snapshot of all of them at the moments the command prints a line that matters (a step's row).

Shared by benchmarks/startup.py and benchmarks/client_cost.py. A process is counted by its own CPU only (user +
system): its children are watched themselves, and a process's ``children_*`` times would count them again once
they end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil

#: Ray's own processes, by what their command line holds.
RAY_OWN = ("gcs_server", "raylet", "dashboard", "monitor.py", "log_monitor", "DashboardAgent", "RuntimeEnvAgent")
SAMPLE_S = 0.2
#: The ``verl-remote`` command of this interpreter's environment.
VERL_REMOTE = os.path.join(os.path.dirname(sys.executable), "verl-remote")


@dataclass
class Seen:
    """One process: when it was first seen, what it is called now, its CPU time when last seen."""

    first: float
    name: str
    cpu: float = 0.0


@dataclass
class Watched:
    """What a watched command printed (seconds after its start, the line) and the processes it ran."""

    lines: list[tuple[float, str]] = field(default_factory=list)
    processes: dict[int, Seen] = field(default_factory=dict)
    #: CPU-seconds by pid at each marked line: (the line's index in ``lines``, {pid: CPU-seconds}).
    marks: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    #: The pids under ``extra_pids`` (a service's processes, not the command's).
    external: set[int] = field(default_factory=set)
    raylet_at: float | None = None
    root: int = 0
    end: float = 0.0
    code: int = 0


def process_name(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    if cmd.startswith("ray::"):
        return cmd.split()[0]
    for own in RAY_OWN:
        if own in cmd:
            return f"ray ({own})"
    if "setup_worker.py" in cmd or "default_worker.py" in cmd:
        return "ray::(starting)"
    if "verl_remote.runtime.watchdog" in cmd:
        return "verl-remote's watchdog"
    return os.path.basename(cmd.split()[0]) if cmd else "(exited)"


def _look(family: Iterable[psutil.Process], watched: Watched, now: float) -> None:
    for proc in family:
        try:
            name = process_name(proc)
            times = proc.cpu_times()
        except psutil.Error:
            continue
        seen = watched.processes.setdefault(proc.pid, Seen(now, name))
        if name not in ("ray::IDLE", "ray::(starting)"):
            seen.name = name
        seen.cpu = times.user + times.system
        if watched.raylet_at is None and name == "ray (raylet)":
            watched.raylet_at = now


def tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and every process below it (none when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _family(root: int, extra: Iterable[int], watched: Watched) -> list[psutil.Process]:
    family = tree(root)
    for pid in extra:
        outside = tree(pid)
        watched.external.update(proc.pid for proc in outside)
        family += outside
    return family


def watch(
    command: list[str],
    *,
    cwd: str,
    mark: re.Pattern[str] | None = None,
    extra_pids: Iterable[int] = (),
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
) -> Watched:
    """Run ``command``, watching its processes (and ``extra_pids``, a service's, say) every :data:`SAMPLE_S`; at
    each line matching ``mark`` every process's CPU time is read at once."""
    watched = Watched()
    extra = list(extra_pids)
    began = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
    )
    watched.root = proc.pid
    done = threading.Event()
    lock = threading.Lock()

    def sample() -> None:
        while not done.is_set():
            with lock:
                _look(_family(proc.pid, extra, watched), watched, time.monotonic() - began)
            done.wait(SAMPLE_S)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        watched.lines.append((time.monotonic() - began, line))
        if on_line is not None:
            on_line(line)
        if mark is not None and mark.search(line):
            with lock:
                _look(_family(proc.pid, extra, watched), watched, time.monotonic() - began)
                watched.marks.append((len(watched.lines) - 1, {pid: s.cpu for pid, s in watched.processes.items()}))
    watched.code = proc.wait()
    watched.end = time.monotonic() - began
    done.set()
    watcher.join()
    return watched
