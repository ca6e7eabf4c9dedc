"""The run folder's record of the run: the config it ran with, for what reads the folder later.

A run writes ``verl-remote-run.yaml`` into its checkpoint folder (``trainer.default_local_dir``) as it starts,
under either launcher: the whole config, resolved, as the run got it (paths made absolute by ``verl-remote
train``). ``verl-remote export`` reads it to know the backend, its settings and the model a checkpoint belongs
to. A run resumed in the folder writes it again. Backends read tokens from the environment or a file, never from
the config; what looks like a secret anyway (a key named token, password, secret or API key, a variable of
``ray_kwargs.ray_init.runtime_env.env_vars``, an ``${oc.env:...}`` resolved into it) is recorded as ``***``
(:func:`verl_remote.kit.secrets.redact`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from omegaconf import DictConfig, OmegaConf

from verl_remote.kit.secrets import redact

__all__ = ["RUN_RECORD", "read_run_record", "resume_problem", "write_run_record"]

RUN_RECORD = "verl-remote-run.yaml"


def write_run_record(config: Any) -> str:
    """Write the run's config into its checkpoint folder, atomically; returns the record's path."""
    folder = str(config.trainer.default_local_dir)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, RUN_RECORD)
    handle, temporary = tempfile.mkstemp(prefix=f".{RUN_RECORD}.", dir=folder)
    try:
        with os.fdopen(handle, "w") as fp:
            fp.write(OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(config, resolve=True)))))
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


def read_run_record(folder: str) -> DictConfig | None:
    """The config the run in ``folder`` recorded, or None when there is no record."""
    path = os.path.join(folder, RUN_RECORD)
    if not os.path.isfile(path):
        return None
    config = OmegaConf.load(path)
    assert isinstance(config, DictConfig)
    return config


def resume_problem(config: Any) -> str | None:
    """Why the run cannot resume from the checkpoint its folder holds (``trainer.resume_mode=auto``): the folder's
    record names another backend, whose checkpoints this one cannot read; None otherwise."""
    from verl_remote.runtime.checkpoints import resumes_from_checkpoint

    if str(config.trainer.get("resume_mode", "auto")) != "auto" or not resumes_from_checkpoint(config):
        return None
    folder = str(config.trainer.default_local_dir)
    recorded = read_run_record(folder)
    theirs = None if recorded is None else OmegaConf.select(recorded, "remote_backend.name", default=None)
    mine = str(config.remote_backend.name)
    if theirs is None or str(theirs) == mine:
        return None
    return (
        f"trainer.default_local_dir={folder} holds the checkpoints of a run of backend '{theirs}' (its {RUN_RECORD}), "
        f"which backend '{mine}' cannot resume: give this run a folder of its own (trainer.default_local_dir, or "
        "trainer.experiment_name), or set trainer.resume_mode=disable to start over there"
    )
