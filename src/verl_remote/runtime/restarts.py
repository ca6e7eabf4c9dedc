"""Restarts after a transient fault: whether a failed run goes on, how long it waits, and where it resumes.

``verl-remote train`` runs the whole run again in the same command (Ray, the backend, verl's trainer) from the
last checkpoint this command saved, as Ray Train's ``FailureConfig(max_failures=...)`` and TorchElastic's
``--max-restarts`` do; the settings are ``remote_restart`` (docs/config-reference.md). A fault that is not
transient (verl_remote.kit.faults), or the same fault at the same step right after a restart, stops the run.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from verl_remote.kit.errors import one_line
from verl_remote.kit.faults import is_transient
from verl_remote.runtime.checkpoints import RECORD, complete_steps, resume_target

__all__ = ["Restarts", "resumed_config"]


@dataclass
class Restarts:
    """The ``remote_restart`` settings of a run, and the restarts it made so far."""

    max: int
    backoff_s: float
    max_backoff_s: float
    count: int = 0
    _last: tuple[int, str] | None = None

    @classmethod
    def from_config(cls, config: Any) -> Restarts:
        settings = OmegaConf.select(config, "remote_restart", default=None) or {}
        return cls(
            max=int(settings.get("max", 0)),
            backoff_s=float(settings.get("backoff_s", 10.0)),
            max_backoff_s=float(settings.get("max_backoff_s", 120.0)),
        )

    def wait_s(self) -> float:
        """The wait before the restart just counted: ``backoff_s``, doubled for each one before, at most
        ``max_backoff_s``."""
        return float(min(self.backoff_s * 2 ** max(0, self.count - 1), self.max_backoff_s))

    def refusal(self, exc: BaseException, step: int) -> str | None:
        """Why the run that failed with ``exc`` at ``step`` is not restarted; None: restart it (and count it)."""
        if not is_transient(exc):
            return "not transient"  # a refusal, a bug, a bad config: it would fail again; said as it always was
        if self.max <= 0:
            return "a transient fault; restarts are off (remote_restart.max=0)"
        said = _shape(exc)
        if self._last == (step, said):
            return f"the same fault at step {step} right after a restart"
        if self.count >= self.max:
            restarts = "restart" if self.count == 1 else "restarts"
            return f"a transient fault, after {self.count} {restarts} (remote_restart.max={self.max})"
        self._last = (step, said)
        self.count += 1
        return None


def _shape(exc: BaseException) -> str:
    """An error's line with its numbers (ports, ids, counts) left out: the same fault says the same shape."""
    return re.sub(r"\d+", "#", one_line(exc))


def resumed_config(config: DictConfig, since: float) -> tuple[DictConfig, int]:
    """``config`` for the run's next attempt, and the step it resumes from (0: the start): the newest complete
    checkpoint this command saved (one sealed at or after ``since``), else what the command began from."""
    folder = str(config.trainer.default_local_dir)
    for step in complete_steps(folder):  # newest first
        path = os.path.join(folder, f"global_step_{step}")
        if os.path.getmtime(os.path.join(path, RECORD)) >= since:
            again = copy.deepcopy(config)
            with open_dict(again):
                again.trainer.resume_mode = "resume_path"
                again.trainer.resume_from_path = path
            return again, step
    mode = str(config.trainer.resume_mode)
    if mode == "resume_path":
        found = re.search(r"global_step_(\d+)", str(config.trainer.resume_from_path))
        return config, int(found.group(1)) if found else 0
    if mode == "auto":
        with contextlib.suppress(ValueError):  # a damaged folder: verl's own resume says so
            return config, resume_target(folder, move_tracker=False).step or 0
    return config, 0
