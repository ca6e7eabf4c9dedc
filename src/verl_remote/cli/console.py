"""What ``verl-remote train`` prints: the run's own lines on the console, everything in a log file.

A run prints thousands of lines, most of them the same warnings from every process (accelerator probes,
engines that are not installed, thread counts) and verl's config dump. Every process's output reaches the
driver: Ray forwards each worker's stdout and stderr to the driver's ``sys.stdout`` and ``sys.stderr``, line by
line, with the worker's name in front. :class:`Console` replaces those two streams for the run and sorts each
line:

- to the console: lines of verl-remote and its backends (``verl-remote...:``, ``verl-<name>:``), one short
  row per training step read from verl's metrics line (:func:`step_fields`: the step of the total, the time
  left, the reward, the response length, the loss, the gradient norm, the step time, the throughput), and
  every line that reports an error (a logging level of ERROR or CRITICAL, a native ``E``/``F`` log line, an
  exception's ``SomeError: message`` line, a killed worker); an error line that repeats one already shown
  (numbers and ids aside) is counted instead, so that a failure in every request is shown once. On a terminal
  the step line is redrawn in place (before the first step, verl's progress bar is); in a pipe or a file it is
  one line per step. Once the run is stopping (:meth:`Console.stopping`: Ctrl-C, SIGTERM), only verl-remote's
  own lines are shown: the workers the stop ends report their own deaths, which is no news;
- everything, as it came (without colours; numpy's ``np.float64(0.5)`` as ``0.5``), to the run's log file,
  verl's whole metrics line included.

Native writes to the file descriptors (Ray's C++ core) are not Python writes and reach the console as they
are. ``verbose`` shows every line on the console as well.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from verl_remote.runtime.files import private_file
from verl_remote.runtime.summary import REWARD_METRIC

__all__ = [
    "VERBOSE_ENV",
    "Console",
    "current_console",
    "is_error",
    "plain_numbers",
    "run_console",
    "shown",
    "step_fields",
    "step_line",
    "step_metrics",
]

#: Set to 1 to print every line of a run on the console (as ``--verbose``).
VERBOSE_ENV = "VERL_REMOTE_VERBOSE"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Ray's prefix of a forwarded line: "(Name pid=123)", "(pid=123)", "(Name pid=123, ip=10.0.0.1)", "(raylet)".
_RAY_PREFIX = re.compile(r"^\((?:[\w.]+ )?(?:pid=\d+(?:, ip=[\d.]+)?|raylet|gcs_server|autoscaler[^)]*)\) ")
_OURS = re.compile(r"(?:^|[\s:])verl-[a-z][\w-]*(?: [a-z]+)?: ")
_STEP = re.compile(r"(?:^|\s)step:\d+ - ")
_PROGRESS = re.compile(r"^Training Progress:")
# A raylet's report of its own end ("(raylet) Raylet is terminated. Termination is unexpected. ..."), not the
# raylet's reports of a worker's ("(raylet) A worker died or was killed ..."), which the run's error names.
_RAY_DIED = re.compile(r"^\((raylet)(?:, ip=[\d.]+)?\) (Raylet is terminated\b.*)")
_PROGRESS_TOTAL = re.compile(r"\|\s*\d+/(\d+) \[")
_NUMPY = re.compile(r"\bnp\.(?:float|int|uint|bool_)\w*\(([^()]*)\)")
_ERROR = re.compile(
    r"\b(?:ERROR|CRITICAL|FATAL)\b"  # Python logging, verl's and Ray's formats
    r"|^[EF]\d{4} \d\d:\d\d:\d\d"  # glog (torch, Ray's C++ core): E1130 12:15:54.438 ...
    r"|^\[[^\]]* [EF] \d+ \d+\]"  # Ray's C++ log format: [2026-11-30 12:00:00,000 E 123 456] ...
    r"|^(?:[\w.]+\.)?\w*(?:Error|Exception|Failure|Exit)(?:\([\w.]*\))?(?::|$)"  # an exception's last line
    r"|(?i:\bkilled\b|\bout of memory\b)|\bOOM\b"
)
# verl's agent loop cutting a prompt longer than the rollout's prompt length (a warning, kept from the console like
# every other): said once on the console, as the run's data is not what the user meant.
_PROMPT_CUT = re.compile(r"Prompt of (\d+) tokens exceeds rollout\.prompt_length=(\d+); left-truncating")
# What varies between repeats of one error: numbers, hex ids, uuids.
_VARYING = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|0x[0-9a-f]+|[0-9a-f]*\d[0-9a-f]*")


def plain_numbers(text: str) -> str:
    """numpy's reprs in verl's metrics line (``np.float64(0.5)``, ``np.int64(2)``) as plain numbers."""
    return _NUMPY.sub(r"\1", text)


def step_metrics(text: str) -> tuple[int, dict[str, float]] | None:
    """(the step, its numeric metrics) of verl's console metrics line ``step:N - key:value - ...``, or None."""
    found = _STEP.search(text)
    if found is None:
        return None
    head, _, rest = text[found.start() :].strip().partition(" - ")
    metrics: dict[str, float] = {}
    for part in rest.split(" - "):
        key, sep, value = part.partition(":")
        if sep:
            try:
                metrics[key] = float(plain_numbers(value))
            except ValueError:
                continue
    return int(head.split(":")[1]), metrics


def duration(seconds: float) -> str:
    """``0:42``, ``3:05``, ``2:10:00``: minutes and seconds, hours when there are any."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


#: (label, verl's metric, format) of the step line, in order; a metric a step did not report is left out.
STEP_FIELDS = (
    ("reward", REWARD_METRIC, "{:.3f}"),
    ("len", "response_length/mean", "{:.1f}"),
    ("loss", "actor/pg_loss", "{:.3g}"),
    ("grad", "actor/grad_norm", "{:.3g}"),
)


def step_fields(
    step: int, metrics: dict[str, float], total: int | None = None, left_s: float | None = None
) -> list[str]:
    """A step's row, field by field, the most wanted first: ``step 3/40``, ``21:09 left``, ``reward 0.250``,
    ``len 6.9`` (the mean response length), ``loss -0.0974`` (the policy loss), ``grad 0.916`` (its gradient
    norm), ``34.3 s/step``, ``22 tok/s`` (verl's throughput). A validation's mean reward
    (``val-core/<data>/reward/mean@N``) is added as ``val 0.312``; verl's validation before the first step is a
    row of its own (``step 0/40  val 0.125``)."""
    fields = [f"step {step}/{total}" if total else f"step {step}"]
    if left_s is not None and total is not None and step < total:
        fields.append(f"{duration(left_s)} left")
    fields += [f"{label} {form.format(metrics[key])}" for label, key, form in STEP_FIELDS if key in metrics]
    validation = sorted(key for key in metrics if key.startswith("val-core/") and "/mean@" in key)
    if validation:
        fields.append(f"val {metrics[validation[0]]:.3f}")
    if "timing_s/step" in metrics:
        fields.append(f"{metrics['timing_s/step']:.1f} s/step")
    if "perf/throughput" in metrics:
        fields.append(f"{metrics['perf/throughput']:.0f} tok/s")
    return fields


def step_line(fields: list[str], width: int | None = None) -> str:
    """The fields in one row; within ``width`` columns, the last fields that do not fit are left out."""
    row = "  ".join(fields)
    while width is not None and len(row) > width and len(fields) > 1:
        fields = fields[:-1]
        row = "  ".join(fields)
    return row


def _strip(line: str) -> tuple[str, str]:
    """(the line without colours, the same without Ray's process prefix)."""
    plain = _ANSI.sub("", line)
    return plain, _RAY_PREFIX.sub("", plain, count=1)


def is_error(text: str) -> bool:
    """Whether a line (without Ray's prefix) reports an error."""
    return bool(_ERROR.search(text))


def shown(text: str) -> bool:
    """Whether a line (without Ray's prefix) belongs on the console."""
    return bool(_OURS.search(text) or _STEP.search(text) or _PROGRESS.search(text) or is_error(text))


class _Stream(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` for the run: whole lines go to the :class:`Console`."""

    def __init__(self, console: Console, original: IO[str]) -> None:
        self._console = console
        self._original = original
        # The line each thread has begun: Ray's log thread forwards the workers' lines while the TaskRunner's
        # thread prints its own (verl's progress bar redraws a line it ends only when it closes).
        self._partials: dict[int, str] = {}

    # What callers ask of a standard stream.
    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._original, "encoding", "utf-8")

    def fileno(self) -> int:
        return self._original.fileno()

    def isatty(self) -> bool:
        # Asked at interpreter exit too (Ray's colorama keeps the stream it saw), maybe after the original closed.
        return not self._original.closed and self._original.isatty()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not self._console.active:
            return self._original.write(text)
        with self._console.lock:
            thread = threading.get_ident()
            lines = (self._partials.pop(thread, "") + text).split("\n")
            if lines[-1]:
                self._partials[thread] = lines[-1]
            for line in lines[:-1]:
                self._console.line(line, self)
        return len(text)

    def flush(self) -> None:
        self._original.flush()

    def drain(self) -> None:
        partials, self._partials = self._partials, {}
        for partial in partials.values():
            self._console.line(partial, self)


class Console:
    """Sorts a run's output between the console and its log file (see the module's docstring).

    Until :meth:`open_log` names the file, log lines are kept in memory; a command that ends before then
    (a refused config) leaves no file.
    """

    #: When a step's line came (the time left follows the run's own pace).
    clock = staticmethod(time.monotonic)

    def __init__(self, *, verbose: bool = False) -> None:
        self.verbose = verbose
        self.active = False
        self.lock = threading.RLock()
        self.log_path: Path | None = None
        self._log: IO[str] | None = None
        self._pending: list[str] = []
        self._seen_errors: set[str] = set()
        self._seen_ours: set[str] = set()
        self._prompt_cut = False
        self.repeated_errors = 0
        self._progress = ""  # the line drawn in place on a terminal, if any
        self._streams: tuple[_Stream, _Stream] | None = None
        #: The run's number of steps, if known (the CLI sets it from the config; verl's progress bar tells it).
        self.total_steps: int | None = None
        self._step_times: list[tuple[int, float]] = []  # (step, when its line came), this run's training steps
        self._steps_shown: set[tuple[int, bool]] = set()
        self._stopping = False
        #: (step, mean reward) of every training step shown, for a summary when the run does not return one.
        self.rewards: list[tuple[int, float]] = []
        #: (which, what it said) when one of Ray's own processes died under the run: ("raylet", "Raylet is
        #: terminated"), "(raylet) Raylet is terminated. Termination is unexpected. ..." on the console.
        self.ray_died: tuple[str, str] | None = None
        #: When the last line came (time.monotonic()).
        self.last_line_at = time.monotonic()

    def wait_for_quiet(self, *, quiet_s: float, at_most_s: float) -> float:
        """Wait for the workers' last lines, which Ray forwards a moment after they are written: until no line
        came for ``quiet_s`` and at least ``quiet_s`` passed, or ``at_most_s`` did; the seconds waited."""
        began = time.monotonic()
        while True:
            now = time.monotonic()
            if now - began >= at_most_s or (now - began >= quiet_s and now - self.last_line_at >= quiet_s):
                return now - began
            time.sleep(0.05)

    def restarting(self) -> None:
        """The run starts again (a restart after a transient fault): its steps are shown again from where it
        resumes, and what stopped the attempt before no longer holds."""
        with self.lock:
            self._steps_shown.clear()
            self._step_times.clear()
            self._stopping = False
            self.ray_died = None

    def stopping(self) -> None:
        """The run is being stopped: from now on only verl-remote's own lines reach the console."""
        self._stopping = True

    # -- the run's streams ---------------------------------------------------------------------

    def install(self) -> None:
        """Replace ``sys.stdout`` and ``sys.stderr``; lines are sorted until :meth:`uninstall`."""
        out = _Stream(self, sys.stdout)
        err = _Stream(self, sys.stderr)
        self._streams = (out, err)
        sys.stdout, sys.stderr = out, err
        self.active = True

    def uninstall(self) -> None:
        """Back to the original streams. A handler that kept a reference to ours writes through to them."""
        if self._streams is None:
            return
        with self.lock:
            for stream in self._streams:
                stream.drain()
            self._end_progress()
            self.active = False
            out, err = self._streams
            sys.stdout, sys.stderr = out._original, err._original
            if self._log is not None:
                self._log.close()
                self._log = None
        for stream in self._streams:
            stream._original.flush()

    def open_log(self, path: Path) -> None:
        """Start writing the log file (appending), with what was printed so far."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            self._log = private_file(path)  # 0600: it holds what the run printed, the service's answers included
            self.log_path = path
            for line in self._pending:
                self._log.write(line + "\n")
            self._pending.clear()
            self._log.flush()

    # -- sorting -------------------------------------------------------------------------------

    def line(self, line: str, stream: _Stream) -> None:
        self.last_line_at = time.monotonic()
        plain, text = _strip(line.rstrip("\r"))
        # tqdm redraws with carriage returns; the last drawing is the line's state.
        text = text.rsplit("\r", 1)[-1]
        plain = plain.rsplit("\r", 1)[-1]
        self._to_log(plain)
        died = _RAY_DIED.match(plain)
        if died and self.ray_died is None:
            self.ray_died = (died.group(1), died.group(2).split(". ")[0].rstrip("."))
        if self.verbose:
            self._to_console(line.rstrip("\r"), stream)
            return
        if _PROGRESS.search(text):
            total = _PROGRESS_TOTAL.search(text)
            if total:
                self.total_steps = int(total.group(1))
            if stream.isatty() and not self._step_times and not self._stopping:
                self._draw_progress(text, stream)
            return
        ours = _OURS.search(text)
        if ours:
            # Every process that imports the same code says the same thing: once is enough.
            text = text[ours.start() :].lstrip(" :")
            if text not in self._seen_ours:
                self._seen_ours.add(text)
                self._to_console(text, stream)
        elif self._stopping:
            return
        elif _STEP.search(text):
            self._show_step(text, stream)
        elif (cut := _PROMPT_CUT.search(text)) and not self._prompt_cut:
            self._prompt_cut = True
            tokens, limit = cut.groups()
            self._to_console(
                f"verl-remote: verl cuts prompts longer than rollout.prompt_length={limit} (data.max_prompt_length) to "
                f"their last {limit} tokens, one of {tokens} among them: raise data.max_prompt_length, or drop such "
                "prompts with data.filter_overlong_prompts=true (the log names each)",
                stream,
            )
        elif is_error(text):
            key = _VARYING.sub("#", text.lower())
            if key in self._seen_errors:
                self.repeated_errors += 1
                return
            self._seen_errors.add(key)
            self._to_console(plain, stream)

    def _show_step(self, text: str, stream: _Stream) -> None:
        parsed = step_metrics(text)
        if parsed is None:
            return
        step, metrics = parsed
        training = "timing_s/step" in metrics  # verl's validation before training has none
        if (step, training) in self._steps_shown:
            return  # on a cluster whose nodes share a machine, each node's log monitor forwards the line
        self._steps_shown.add((step, training))
        left_s = None
        if training:
            if REWARD_METRIC in metrics:
                self.rewards.append((step, metrics[REWARD_METRIC]))
            self._step_times.append((step, self.clock()))
            (first, began), (last, ended) = self._step_times[0], self._step_times[-1]
            # Seconds per step as the run goes (validations and checkpoints included), from the second step on:
            # a run's first step also warms up (the demo's: 12-21 s, then 1.5 s), so it alone would mislead.
            if self.total_steps is not None and last > first:
                left_s = (ended - began) / (last - first) * (self.total_steps - step)
        fields = step_fields(step, metrics, self.total_steps, left_s)
        if training and stream.isatty():  # a training step on a terminal: in place, one row
            self._draw_progress(step_line(fields, shutil.get_terminal_size().columns - 1), stream)
        else:  # a validation before training, or not a terminal: a line of its own
            self._to_console(step_line(fields), stream)

    def log_only(self, text: str) -> None:
        """Lines for the log file alone (a failed run's traceback)."""
        with self.lock:
            for line in text.rstrip("\n").splitlines():
                self._to_log(_ANSI.sub("", line))

    def _to_log(self, plain: str) -> None:
        if _STEP.search(plain):
            plain = plain_numbers(plain)
        stamped = f"{time.strftime('%H:%M:%S')} {plain}"
        if self._log is None:
            self._pending.append(stamped)
        else:
            self._log.write(stamped + "\n")
            self._log.flush()

    def _to_console(self, text: str, stream: _Stream) -> None:
        original = stream._original
        if self._progress:
            original.write("\r\x1b[K")
        original.write(text + "\n")
        if self._progress:
            original.write(self._progress)
        original.flush()

    def _draw_progress(self, text: str, stream: _Stream) -> None:
        # One row, or the next redraw's carriage return would leave the wrapped part behind.
        self._progress = text[: max(20, shutil.get_terminal_size().columns - 1)]
        stream._original.write("\r\x1b[K" + self._progress)
        stream._original.flush()

    def _end_progress(self) -> None:
        if self._progress and self._streams is not None:
            self._streams[1]._original.write("\n")
            self._progress = ""


_current: Console | None = None


def current_console() -> Console | None:
    """The :class:`Console` of this process's run, while :func:`run_console` has one installed."""
    return _current


@contextmanager
def run_console(verbose: bool) -> Iterator[Console]:
    """A :class:`Console` installed for the duration of the block; removed on every way out."""
    global _current
    console = Console(verbose=verbose or os.environ.get(VERBOSE_ENV, "") not in ("", "0"))
    if not console.verbose:
        # One line per line in the log; the console shows each error once by itself.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    console.install()
    _current = console
    try:
        yield console
    finally:
        _current = None
        console.uninstall()
