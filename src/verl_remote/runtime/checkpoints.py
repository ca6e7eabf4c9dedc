"""Checkpoints that are complete or ignored: a completion record per save, checked before a resume.

verl writes a step's checkpoint (``global_step_<N>/``: the backend's ``actor/``
part and verl's ``data.pt``) into its final folder and then points
``latest_checkpointed_iteration.txt`` at it. A save killed midway, or a file
damaged later, leaves a latest checkpoint that fails the resume deep inside a
loader. So, after verl's save, :func:`seal` syncs every file to disk and
writes a record of the files and their sizes (``.verl-remote-complete.json``,
written atomically); before a resume :func:`resume_target` checks the
checkpoint the tracker names against its record. A checkpoint without a record
in a folder where others have one was cut short; a file missing or of another
size than recorded was damaged. With ``trainer.resume_mode=auto`` the tracker
is moved to the newest complete checkpoint, and the run says which and why;
with ``resume_path`` the run is refused, naming the file.

Checkpoints saved before records existed (no checkpoint in the folder has one)
are trusted as verl trusts them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

from verl_remote.runtime.files import current_umask

__all__ = ["RECORD", "TRACKER", "Choice", "check", "complete_steps", "resume_target", "resumes_from_checkpoint", "seal"]

RECORD = ".verl-remote-complete.json"
TRACKER = "latest_checkpointed_iteration.txt"
_STEP = re.compile(r"^global_step_(\d+)$")


def _files(folder: str) -> dict[str, int]:
    sizes = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative != RECORD and not os.path.islink(path):
                sizes[relative] = os.path.getsize(path)
    return dict(sorted(sizes.items()))


def _fsync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_synced(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, on disk before it replaces the old file. The temporary file is
    a new one (``mkstemp``: a link planted at a fixed name is not followed), readable as the umask says."""
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path))
    try:
        with os.fdopen(handle, "w") as fp:
            fp.write(text)
            fp.flush()
            os.fchmod(fp.fileno(), 0o666 & ~current_umask())
            os.fsync(fp.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def seal(step_folder: str) -> None:
    """Sync a finished save to disk and record its files: from now on it counts as complete."""
    sizes = _files(step_folder)
    for relative in sizes:
        _fsync(os.path.join(step_folder, relative))
    _write_synced(os.path.join(step_folder, RECORD), json.dumps({"files": sizes}, indent=0))
    _fsync(step_folder)


def check(step_folder: str) -> str | None:
    """None when ``step_folder`` holds what its record says; otherwise what is wrong, naming the file."""
    record = os.path.join(step_folder, RECORD)
    if not os.path.isfile(record):
        return "it has no completion record (its save did not finish)"
    try:
        with open(record) as fp:
            sizes = dict(json.load(fp)["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its completion record {record} cannot be read ({exc})"
    for relative, size in sizes.items():
        path = os.path.join(step_folder, relative)
        if not os.path.isfile(path):
            return f"{path} is missing"
        actual = os.path.getsize(path)
        if actual != int(size):
            return f"{path} has {actual} bytes, {size} were written"
    return None


def _steps(folder: str) -> list[int]:
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = _STEP.match(name)
        if match and os.path.isdir(os.path.join(folder, name)):
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def complete_steps(folder: str) -> list[int]:
    """The steps under ``folder`` whose checkpoints are complete, newest first."""
    return [step for step in _steps(folder) if check(os.path.join(folder, f"global_step_{step}")) is None]


@dataclass
class Choice:
    """What a resume in ``auto`` mode should load, and why it is not simply the latest."""

    step: int | None
    note: str | None = None


def resume_target(folder: str, *, move_tracker: bool = True) -> Choice:
    """The checkpoint an ``auto`` resume should load; moves the tracker when the latest is not complete, unless
    ``move_tracker`` is false (the preflight's look, before the run holds the folder: it writes nothing).

    Raises ValueError when the latest checkpoint is damaged and none before it is complete.
    """
    tracker = os.path.join(folder, TRACKER)
    if not os.path.isfile(tracker):
        return Choice(None)
    with open(tracker) as fp:
        text = fp.read().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker} holds {text!r}, not a step number")
    latest = int(text)
    if not any(os.path.isfile(os.path.join(folder, f"global_step_{s}", RECORD)) for s in _steps(folder)):
        return Choice(latest)  # saved before completion records: trusted as verl trusts them
    problem = check(os.path.join(folder, f"global_step_{latest}"))
    if problem is None:
        return Choice(latest)
    earlier = [step for step in complete_steps(folder) if step < latest]
    if not earlier:
        raise ValueError(
            f"the latest checkpoint, global_step_{latest}, cannot be resumed: {problem}; and no earlier "
            "checkpoint is complete"
        )
    chosen = earlier[0]
    if move_tracker:
        _write_synced(tracker, str(chosen))
    return Choice(
        chosen,
        f"the latest checkpoint, global_step_{latest}, cannot be resumed: {problem}; resuming from "
        f"global_step_{chosen}, the newest complete one",
    )


def resumes_from_checkpoint(main_config: Any) -> bool:
    """Whether verl will load a checkpoint when the run starts: ``trainer.resume_mode=resume_path``, or ``auto``
    with a checkpoint in ``trainer.default_local_dir``. A backend's ``from_config`` asks it to tell a new run from a
    resumed one before verl's ``load_checkpoint`` call comes."""
    trainer = main_config.trainer
    mode = str(trainer.get("resume_mode", "auto"))
    folder = str(trainer.default_local_dir)
    return mode == "resume_path" or (mode == "auto" and os.path.isfile(os.path.join(folder, TRACKER)))
