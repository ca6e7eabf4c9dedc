"""A run's checkpoint out as a Hugging Face model folder: ``verl-remote export``, and ``remote_export.out`` at
the end of a run.

The run folder says what it holds: its record of the run's config (:mod:`verl_remote.runtime.record`: the
backend, its settings, the model) and its complete checkpoints (:mod:`verl_remote.runtime.checkpoints`). The
backend's :meth:`~verl_remote.RemoteBackend.export` writes the weights of one step into a staging folder beside
the output, which is moved into place once it holds a model: an export cut short never looks complete. What
cannot be exported is refused in one line before any weight is read: no record, no such step, an output
folder that is not empty, a backend that does not export.

A run folder is data: the record's settings that start a program (the backend's
:attr:`~verl_remote.RemoteBackend.program_settings`, such as the command that launched its service) are cleared
before the backend sees the record, unless the user names them on the command line, so a record planted in a
shared folder runs nothing.
"""

from __future__ import annotations

import fnmatch
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_remote.discovery.compose import ConfigError
from verl_remote.runtime.files import current_umask

if TYPE_CHECKING:
    from verl_remote.kit.backend import RemoteBackend

__all__ = ["ExportPlan", "check_export_setting", "export_at_end", "exports", "plan_export", "run_export"]

#: What an exported folder holds besides its ``*.safetensors``, whatever the backend: a model's config, or an
#: adapter's.
REQUIRED = {False: "config.json", True: "adapter_config.json"}


@dataclass(frozen=True)
class ExportPlan:
    """What ``verl-remote export`` will do, once every refusal is past."""

    config: Any
    backend: str
    backend_class: type[RemoteBackend]
    step: int
    path: str  # the backend's part of the checkpoint: the path its save_checkpoint was given
    out: Path
    adapter: bool
    #: The recorded settings that start a program, cleared (not named on the command line): setting -> value.
    withheld: dict[str, str] = field(default_factory=dict)


def exports(backend_class: type) -> bool:
    """Whether a backend defines :meth:`~verl_remote.RemoteBackend.export`."""
    from verl_remote.kit.backend import RemoteBackend

    return backend_class.export.__func__ is not RemoteBackend.export.__func__  # type: ignore[attr-defined]


def _exporter(name: str, where: str) -> type[RemoteBackend]:
    """Backend ``name``'s class, which must export; ``where`` starts the refusal (the setting that asked)."""
    from verl_remote.discovery.registry import load_backend_class

    backend = load_backend_class(name)
    if not exports(backend):
        raise ConfigError(
            f"{where}backend '{name}' does not export its checkpoints (its RemoteBackend has no export method): "
            "ask its authors, or load its checkpoint with the service's own tools"
        )
    return backend


def _refuse_in_use(target: Path, where: str) -> None:
    """The output folder must be new or empty: an export never mixes with what is there."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"{where}: it exists and is not an empty folder; name a new one")


def _choose_step(folder: str, asked: str) -> int:
    from verl_remote.runtime.checkpoints import complete_steps

    steps = complete_steps(folder)
    if not steps:
        raise ConfigError(
            f"{folder} has no complete checkpoint: a run saves them every trainer.save_freq steps (and at its "
            "last step when save_freq > 0)"
        )
    if asked == "latest":
        return steps[0]
    try:
        step = int(asked)
    except ValueError:
        raise ConfigError(f"--step {asked}: a step number or 'latest'") from None
    if step not in steps:
        listed = ", ".join(str(s) for s in sorted(steps))
        raise ConfigError(f"--step {step}: {folder} has no complete checkpoint of step {step} (it has {listed})")
    return step


def plan_export(run_dir: str, step: str, out: str, *, adapter: bool, overrides: Sequence[str] = ()) -> ExportPlan:
    """Everything ``export`` checks before it reads a weight; raises :class:`ConfigError` with the reason.
    ``overrides`` (``remote_backend.KEY=VALUE``) replace the backend's recorded settings: a service that moved."""
    from verl_remote.runtime.record import RUN_RECORD, read_run_record

    folder = os.path.abspath(os.path.expanduser(run_dir))
    if not os.path.isdir(folder):
        raise ConfigError(f"{run_dir}: no such folder; give the run's trainer.default_local_dir")
    config = read_run_record(folder)
    if config is None:
        raise ConfigError(
            f"{run_dir}: no {RUN_RECORD} there, so not the folder of a verl-remote run (or of one older than the "
            "record): give the run's trainer.default_local_dir"
        )
    name = str(config.remote_backend.name)
    backend = _exporter(name, "")
    withheld = _withhold_programs(config, backend, overrides)
    _override(config, overrides)
    chosen = _choose_step(folder, step)
    target = Path(os.path.abspath(os.path.expanduser(out)))
    _refuse_in_use(target, f"--out {out}")
    part = os.path.join(folder, f"global_step_{chosen}", "actor")
    return ExportPlan(config, name, backend, chosen, part, target, adapter, withheld)


def _withhold_programs(config: Any, backend: type[RemoteBackend], overrides: Sequence[str]) -> dict[str, str]:
    """Clear the recorded settings that start a program (the backend's ``program_settings``) that the command line
    does not name; returns what was cleared."""
    from omegaconf import OmegaConf, open_dict

    named = {said.partition("=")[0] for said in overrides}
    withheld = {}
    for setting in backend.program_settings:
        key = f"remote_backend.{setting}"
        value = OmegaConf.select(config, key, default=None)
        if value in (None, "") or key in named:
            continue
        withheld[key] = str(value)
        with open_dict(config):
            OmegaConf.update(config, key, None, merge=False)
    return withheld


_ABSENT = object()


def _override(config: Any, overrides: Sequence[str]) -> None:
    """The run's recorded ``remote_backend`` settings, with ``overrides`` (and nothing else) replaced."""
    from omegaconf import OmegaConf, open_dict

    for said in overrides:
        key, eq, _ = said.partition("=")
        if not eq or not key.startswith("remote_backend.") or key == "remote_backend.name":
            raise ConfigError(
                f"{said!r}: an export takes the backend's settings only, as remote_backend.KEY=VALUE (for example a "
                "service's new address); the model, the data and the backend are the run's"
            )
        if OmegaConf.select(config, key, default=_ABSENT) is _ABSENT:
            raise ConfigError(f"{key}: the run's backend has no such setting (see its remote_backend in the record)")
        with open_dict(config):
            OmegaConf.update(config, key, OmegaConf.select(OmegaConf.from_dotlist([said]), key), merge=False)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def run_export(plan: ExportPlan) -> Path:
    """Export as planned: the backend writes into a staging folder beside ``plan.out``, moved there when done."""
    plan.out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{plan.out.name}.export-", dir=plan.out.parent))
    umask = current_umask()
    staging.chmod(0o777 & ~umask)  # a folder like any other the user makes, not mkdtemp's private one
    began = time.monotonic()
    for key, value in plan.withheld.items():
        print(
            f"verl-remote: the run's record names a program to start ({key}: {value}); an export runs no program "
            f"recorded in a run folder: to have it started, name it: {shlex.quote(f'{key}={value}')}",
            flush=True,
        )
    try:
        print(
            f"verl-remote: exporting step {plan.step} of backend '{plan.backend}' to {plan.out}"
            + (" (the adapter alone)" if plan.adapter else ""),
            flush=True,
        )
        plan.backend_class.export(plan.config, plan.step, plan.path, str(staging), adapter=plan.adapter)
        written = {p.name for p in staging.iterdir()}
        lacking = [name for name in (REQUIRED[plan.adapter], "*.safetensors") if not fnmatch.filter(written, name)]
        if lacking:
            raise RuntimeError(
                f"backend '{plan.backend}' exported no {' and no '.join(lacking)}: a bug in its export method"
            )
        for made in staging.rglob("*"):  # what the user makes is readable as their umask says (save_pretrained's
            made.chmod((0o777 if made.is_dir() else 0o666) & ~umask)  # safetensors is private otherwise)
        if plan.out.exists():  # an empty folder, checked in the plan: the staging folder takes its place
            plan.out.rmdir()
        os.replace(staging, plan.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    took = time.monotonic() - began
    print(
        f"verl-remote: exported step {plan.step} to {plan.out} ({_size(plan.out) / 1e6:.1f} MB) in {took:.1f} s",
        flush=True,
    )
    return plan.out


def check_export_setting(config: Any) -> None:
    """``remote_export.out`` of a run, checked before it starts: checkpoints to export, a folder free for the
    model, a backend that exports. Raises :class:`ConfigError`."""
    from omegaconf import OmegaConf

    out = OmegaConf.select(config, "remote_export.out", default=None)
    if not out:
        return
    if int(config.trainer.save_freq) <= 0:
        raise ConfigError(
            f"remote_export.out={out} exports the run's last checkpoint, and trainer.save_freq="
            f"{config.trainer.save_freq} saves none: set trainer.save_freq (verl saves the last step when it is > 0)"
        )
    _refuse_in_use(Path(os.path.expanduser(str(out))), f"remote_export.out={out}")
    _exporter(str(config.remote_backend.name), f"remote_export.out={out}: ")


def export_at_end(config: Any) -> Path | None:
    """The run's newest checkpoint into ``remote_export.out``, if set (the run has ended and its backend is still
    up: a service's checkpoints may go with the run's jobs)."""
    from omegaconf import OmegaConf

    out = OmegaConf.select(config, "remote_export.out", default=None)
    if not out:
        return None
    folder = str(config.trainer.default_local_dir)
    adapter = bool(OmegaConf.select(config, "remote_export.adapter", default=False))
    try:
        return run_export(plan_export(folder, "latest", str(out), adapter=adapter))
    except Exception as exc:
        again = f"verl-remote export {folder} --out {out}" + (" --adapter" if adapter else "")
        raise RuntimeError(
            f"the run trained and saved its checkpoints, but the export to remote_export.out failed ({exc}); "
            f"export it with: {again}"
        ) from exc
