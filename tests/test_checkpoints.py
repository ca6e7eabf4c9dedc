"""Completion records: a checkpoint cut short or damaged is named, and an auto resume passes it over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from verl_remote.runtime.checkpoints import RECORD, TRACKER, check, complete_steps, resume_target, seal

pytestmark = pytest.mark.faults


def _save(folder: Path, step: int, payload: bytes = b"weights", sealed: bool = True) -> Path:
    step_folder = folder / f"global_step_{step}"
    (step_folder / "actor").mkdir(parents=True)
    (step_folder / "actor" / "model.pt").write_bytes(payload * step)
    (step_folder / "data.pt").write_bytes(b"dataloader")
    if sealed:
        seal(str(step_folder))
    (folder / TRACKER).write_text(str(step))
    return step_folder


def test_a_sealed_checkpoint_is_complete_until_a_file_changes_size(tmp_path: Path) -> None:
    step = _save(tmp_path, 2)
    assert check(str(step)) is None
    (step / "actor" / "model.pt").write_bytes(b"cut")
    assert check(str(step)) == f"{step / 'actor' / 'model.pt'} has 3 bytes, 14 were written"
    (step / "data.pt").unlink()
    assert check(str(step)) == f"{step / 'actor' / 'model.pt'} has 3 bytes, 14 were written"


def test_auto_resume_passes_over_a_save_cut_short_for_the_newest_complete_one(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    _save(tmp_path, 6, sealed=False)  # verl moved the tracker, the record never came
    looked = resume_target(str(tmp_path), move_tracker=False)  # the preflight's look, before the run holds the folder
    assert looked.step == 4 and (tmp_path / TRACKER).read_text() == "6"
    choice = resume_target(str(tmp_path))
    assert choice.step == 4 and (tmp_path / TRACKER).read_text() == "4"
    assert choice.note == (
        "the latest checkpoint, global_step_6, cannot be resumed: it has no completion record (its save did not "
        "finish); resuming from global_step_4, the newest complete one"
    )
    assert complete_steps(str(tmp_path)) == [4, 2]
    assert resume_target(str(tmp_path)).note is None  # now the latest is complete


def test_a_damaged_only_checkpoint_is_refused_and_old_folders_are_trusted(tmp_path: Path) -> None:
    only = _save(tmp_path / "run", 2)
    (only / "data.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="data.pt has 0 bytes, 10 were written; and no earlier checkpoint"):
        resume_target(str(tmp_path / "run"))
    _save(tmp_path / "old", 2, sealed=False)  # saved before completion records existed
    assert resume_target(str(tmp_path / "old")).step == 2


def test_a_run_refused_in_a_held_folder_leaves_its_checkpoints_as_they_were(tmp_path: Path, cli_main: Any) -> None:
    """The preflight only looks: the tracker is moved by the run that holds the folder, never by a second one."""
    from verl_remote.cli.run import hold_run_folder

    folder = tmp_path / "ckpt"
    _save(folder, 2)
    _save(folder, 4, sealed=False)  # the live run is saving step 4
    with hold_run_folder(str(folder)):
        code, _out, err = cli_main("train", f"trainer.default_local_dir={folder}", "trainer.total_training_steps=6")
    assert code == 2, err[-2000:]
    assert "another verl-remote run (pid " in err
    assert (folder / TRACKER).read_text() == "4"


def test_a_folder_holding_another_backends_run_is_refused_before_ray_by_both_launchers(
    tmp_path: Path, cli_main: Any
) -> None:
    """A run resumes from the checkpoint its folder holds; one of another backend's run (the folder's
    verl-remote-run.yaml says whose) cannot be read: refused in one line, naming the way out, and nothing in the
    folder touched. verl's own launcher refuses it in the same words when it builds the trainer."""
    from verl_remote.discovery.compose import compose_config
    from verl_remote.integration.trainer import RemotePPOTrainer

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "verl-remote-run.yaml").write_text("remote_backend:\n  name: arctic\n")
    (folder / TRACKER).write_text("2")
    said = (
        f"trainer.default_local_dir={folder} holds the checkpoints of a run of backend 'arctic' (its "
        "verl-remote-run.yaml), which backend 'local' cannot resume: give this run a folder of its own"
    )
    code, _out, err = cli_main("train", f"trainer.default_local_dir={folder}")
    assert code == 2 and said in err.strip().splitlines()[-1], err[-2000:]
    assert sorted(p.name for p in folder.iterdir()) == [TRACKER, "verl-remote-run.yaml"]
    config = compose_config(["remote_backend=local", f"trainer.default_local_dir={folder}"], recipe="demo")
    with pytest.raises(ValueError, match=r"holds the checkpoints of a run of backend 'arctic'"):
        RemotePPOTrainer(config)


def test_the_runs_lock_and_log_are_private_and_a_link_planted_there_is_not_followed(tmp_path: Path) -> None:
    import os
    import stat

    from verl_remote.cli.console import Console
    from verl_remote.cli.run import LOCK_FILE, hold_run_folder
    from verl_remote.discovery.compose import ConfigError

    folder = tmp_path / "run"
    with hold_run_folder(str(folder)):
        assert stat.S_IMODE((folder / LOCK_FILE).stat().st_mode) == 0o600
    console = Console()
    console.open_log(folder / "logs" / "train.log")
    assert stat.S_IMODE((folder / "logs" / "train.log").stat().st_mode) == 0o600
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("")
    planted = tmp_path / "planted"
    planted.mkdir()
    os.symlink(elsewhere, planted / LOCK_FILE)
    refused = pytest.raises(ConfigError, match=r"cannot open the run's lock .*a symbolic link there is not followed")
    with refused, hold_run_folder(str(planted)):
        pass
    os.symlink(elsewhere, planted / "train.log")
    with pytest.raises(OSError):
        Console().open_log(planted / "train.log")
    # A checkpoint's record is written through a new temporary file, not a fixed name a link could sit at.
    step = _save(tmp_path / "ckpt", 1, sealed=False)
    os.symlink(elsewhere, f"{step}/{RECORD}.tmp")  # where it was written before
    seal(str(step))
    assert elsewhere.read_text() == "" and complete_steps(str(tmp_path / "ckpt")) == [1]
