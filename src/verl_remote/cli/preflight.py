"""Checks of a composed run before anything starts: seconds instead of minutes, and the fix in the message.

``verl-remote train`` runs them after composing the config and before Ray
starts. Each failure is a :class:`PreflightError` whose message names the key,
the offending value and what to do; the CLI prints it as its last line and
exits 2. What is checked:

- values verl will do arithmetic on: a key whose default is a number (or that
  verl reads as one, see :data:`NUMERIC_KEYS`) must hold a number;
- files and folders the run reads: the data files, the model and tokenizer
  (a name that is not a local path is noted as one the hub must provide);
- the checkpoint folder is writable; the checkpoint a resume would load exists;
- a backend that needs one forwarder worker is not given several;
- the backend's own preflight (:meth:`verl_remote.RemoteBackend.preflight`):
  its service reachable, the right protocol, credentials present; a
  ``UserWarning`` it raises (a token over plain http) is printed as a note.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl_remote.discovery.compose import ConfigError

__all__ = [
    "FRACTIONAL_KEYS",
    "NUMERIC_KEYS",
    "RANGES",
    "PreflightError",
    "check_layout",
    "check_numbers",
    "check_ranges",
    "probe_service",
    "run_preflight",
]


class PreflightError(ConfigError):
    """An input that would make the run fail later; the message says which key, which value and the fix."""


#: Keys whose default is null but that verl reads as numbers when set.
NUMERIC_KEYS = (
    "trainer.total_training_steps",
    "data.val_batch_size",
    "data.max_samples",
    "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.max_model_len",
)
#: Keys whose default is an integer but that verl reads as numbers: its config dataclasses type them ``float``
#: (tests/test_preflight.py holds this list to verl's annotations), or they count seconds. Every other key whose
#: default is an integer is one: a fraction there is refused.
FRACTIONAL_KEYS = frozenset(
    {
        "actor_rollout_ref.actor.entropy_coeff",
        "actor_rollout_ref.rollout.top_p",
        "actor_rollout_ref.rollout.over_sample_rate",
        "actor_rollout_ref.rollout.val_kwargs.temperature",
        "reward.reward_model.rollout.top_p",
        "actor_rollout_ref.nccl_timeout",
        "trainer.esi_redundant_time",
        "trainer.ray_wait_register_center_timeout",
        "remote_restart.backoff_s",
        "remote_restart.max_backoff_s",
    }
)
#: Sections whose numbers are not verl's: the backend's settings (its own validation types them: Ray's
#: ``num_cpus`` may be a fraction) and Ray's keyword arguments.
_NOT_VERLS = ("remote_backend.", "ray_kwargs.")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, DictConfig):
        for key, value in node.items_ex(resolve=False):
            yield from leaves(value, f"{prefix}{key!s}.")
    elif isinstance(node, ListConfig):
        for index, value in enumerate(node):
            yield from leaves(value, f"{prefix}{index}.")
    else:
        yield prefix.rstrip("."), node


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_types(config: DictConfig, defaults: DictConfig) -> None:
    """A key verl computes with must hold a number: its default's type, or :data:`NUMERIC_KEYS`; an integer where
    the default is one (but :data:`FRACTIONAL_KEYS` and the backend's settings), as verl counts with it."""
    typed = {key: value for key, value in leaves(defaults) if _number(value) or isinstance(value, bool)}
    for key in NUMERIC_KEYS:
        typed.setdefault(key, 0)
    for key, default in typed.items():
        value = OmegaConf.select(config, key, throw_on_missing=False, default=None)
        if value is None or isinstance(value, DictConfig | ListConfig):
            continue
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise PreflightError(f"{key}={value!r}: expected true or false; set {key}=true or {key}=false")
        elif not _number(value):
            kind = "an integer" if isinstance(default, int) else "a number"
            raise PreflightError(f"{key}={value!r}: expected {kind}; set {key}=<{kind.split()[-1]}>")
        elif (
            isinstance(default, int)
            and isinstance(value, float)
            and key not in FRACTIONAL_KEYS
            and not key.startswith(_NOT_VERLS)
        ):
            words = next((words for ranged, _, words in RANGES if ranged == key), "an integer")
            raise PreflightError(f"{key}={value}: not an integer; expected {words}")


#: Keys verl computes with and the values that make sense: (key, test, the valid range in words). A value
#: outside is refused before Ray starts; verl itself fails on most of them only minutes into the run, in words
#: that do not name the key (``rollout.n=0`` fails in the replay buffer after the first rollout).
RANGES: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("data.train_batch_size", lambda v: v >= 1, "an integer >= 1 (prompts per step)"),
    ("data.val_batch_size", lambda v: v >= 1, "an integer >= 1, or null for the whole validation set"),
    ("data.max_prompt_length", lambda v: v >= 1, "an integer >= 1 (tokens)"),
    ("data.max_response_length", lambda v: v >= 1, "an integer >= 1 (tokens)"),
    ("actor_rollout_ref.rollout.n", lambda v: v >= 1, "an integer >= 1 (responses per prompt)"),
    ("actor_rollout_ref.rollout.val_kwargs.n", lambda v: v >= 1, "an integer >= 1 (responses per prompt)"),
    ("actor_rollout_ref.rollout.prompt_length", lambda v: v >= 1, "an integer >= 1 (tokens)"),
    ("actor_rollout_ref.rollout.response_length", lambda v: v >= 1, "an integer >= 1 (tokens)"),
    ("actor_rollout_ref.rollout.temperature", lambda v: v >= 0, "a number >= 0 (0 samples greedily)"),
    ("actor_rollout_ref.rollout.val_kwargs.temperature", lambda v: v >= 0, "a number >= 0 (0 samples greedily)"),
    ("actor_rollout_ref.rollout.top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("actor_rollout_ref.rollout.val_kwargs.top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("actor_rollout_ref.rollout.top_k", lambda v: v >= -1, "-1 or 0 (off), or an integer >= 1"),
    ("actor_rollout_ref.rollout.val_kwargs.top_k", lambda v: v >= -1, "-1 or 0 (off), or an integer >= 1"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", lambda v: v >= 1, "an integer >= 1 (prompts per update)"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size", lambda v: v >= 1, "an integer >= 1, or null"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", lambda v: v >= 1, "an integer >= 1, or null"),
    ("actor_rollout_ref.actor.ppo_epochs", lambda v: v >= 1, "an integer >= 1"),
    ("actor_rollout_ref.actor.optim.lr", lambda v: 0 < v < math.inf, "a number > 0"),
    ("actor_rollout_ref.actor.clip_ratio", lambda v: v > 0, "a number > 0"),
    ("actor_rollout_ref.actor.clip_ratio_low", lambda v: v >= 0, "a number >= 0"),
    ("actor_rollout_ref.actor.clip_ratio_high", lambda v: v >= 0, "a number >= 0"),
    ("actor_rollout_ref.actor.clip_ratio_c", lambda v: v > 1, "a number > 1 (dual-clip PPO's lower bound)"),
    ("trainer.total_epochs", lambda v: v >= 1, "an integer >= 1"),
    ("trainer.total_training_steps", lambda v: v >= 1, "an integer >= 1, or null for total_epochs' worth"),
    # verl reads 0 as never too (``save_freq > 0``), but the reference documents -1; 0 reads like "every step".
    ("trainer.save_freq", lambda v: v == -1 or v >= 1, "-1 (never), or an integer >= 1 (every that many steps)"),
    ("trainer.test_freq", lambda v: v == -1 or v >= 1, "-1 (never), or an integer >= 1 (every that many steps)"),
    ("trainer.n_gpus_per_node", lambda v: v >= 1, "an integer >= 1 (forwarder workers per node)"),
    ("trainer.nnodes", lambda v: v >= 1, "an integer >= 1"),
    ("remote_restart.max", lambda v: v >= 0, "an integer >= 0 (restarts after a transient fault; 0: none)"),
    ("remote_restart.backoff_s", lambda v: v >= 0, "a number >= 0 (seconds before the first restart)"),
    ("remote_restart.max_backoff_s", lambda v: v >= 0, "a number >= 0 (seconds, the longest wait)"),
)


def check_ranges(config: DictConfig) -> None:
    """Each number in :data:`RANGES` within its range, and an integer where the range says so (verl counts with
    them: responses per prompt, prompts per step; a fraction there is never what was meant). How the batch sizes
    relate is verl's own config check (run before this one, :func:`verl_remote.cli.run.prepare_config`);
    micro-batches are the backend's, as verl-remote's forwarder hands it whole mini-batches, so their sizes need
    not divide."""
    for key, valid, words in RANGES:
        value = OmegaConf.select(config, key, throw_on_missing=False, default=None)
        if "integer" in words and isinstance(value, float):
            raise PreflightError(f"{key}={value}: not an integer; expected {words}")
        if _number(value) and not (math.isfinite(value) and valid(value)):
            raise PreflightError(f"{key}={value}: out of range; expected {words}")


def check_numbers(config: DictConfig, defaults: DictConfig) -> None:
    """The numbers verl computes with: of the right type (:func:`check_types`) and in range
    (:func:`check_ranges`). Reads the config only, so it can run before anything is prepared."""
    check_types(config, defaults)
    check_ranges(config)


def _paths(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, ListConfig | list | tuple):
        return [str(v) for v in value]
    return [str(value)]


def _local(path: str) -> bool:
    return "://" not in path


def check_data(config: DictConfig, skip: Collection[str] = ()) -> None:
    """Every local data file the run reads exists (but those of the keys in ``skip``)."""
    for key in ("data.train_files", "data.val_files"):
        if key in skip:
            continue
        for path in _paths(OmegaConf.select(config, key, default=None)):
            if not _local(path):
                continue
            expanded = os.path.expanduser(path)
            if not os.path.isfile(expanded):
                what = "a folder, not a file" if os.path.isdir(expanded) else "no such file"
                raise PreflightError(f"{key}={path}: {what}; point {key} at the data set's parquet file(s)")


def check_model(config: DictConfig) -> list[str]:
    """The model (and tokenizer) folders exist; a hub name is noted, or refused when the hub is off."""
    notes: list[str] = []
    model = OmegaConf.select(config, "actor_rollout_ref.model", default=None)
    if model is None:
        return notes
    for field in ("path", "tokenizer_path", "hf_config_path"):
        value = model.get(field)
        if value is None:
            continue
        key, path = f"actor_rollout_ref.model.{field}", str(value)
        expanded = os.path.expanduser(path)
        if os.path.isdir(expanded):
            if field != "tokenizer_path" and not os.path.isfile(os.path.join(expanded, "config.json")):
                raise PreflightError(
                    f"{key}={path}: the folder has no config.json, so it is not a Hugging Face model; "
                    "point it at a model folder (save_pretrained's output) or a hub name"
                )
            continue
        if os.path.exists(expanded) or path.startswith(("/", ".", "~")) or not _HUB_ID.match(path):
            raise PreflightError(f"{key}={path}: no such folder; point {key} at a local model folder or a hub name")
        if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
            raise PreflightError(
                f"{key}={path}: not a local path, and HF_HUB_OFFLINE is set, so it cannot be downloaded; "
                "download it first and point the key at the folder"
            )
        notes.append(f"{key}={path} is not a local path; it will be downloaded from the Hugging Face hub")
    return notes


def check_output(config: DictConfig) -> None:
    """The checkpoint folder can be created and written; it is not created here (the run creates it once it
    holds it): a probe in the folder, or in its nearest existing parent, is made and removed."""
    folder = str(config.trainer.default_local_dir)
    existing = os.path.abspath(os.path.expanduser(folder))
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is not a folder")
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".verl-remote-write-check-"))
    except OSError as exc:
        raise PreflightError(
            f"trainer.default_local_dir={folder}: cannot write there ({exc.strerror or exc}); "
            "set trainer.default_local_dir to a folder this user can write"
        ) from exc


def check_resume(config: DictConfig) -> list[str]:
    """The checkpoint a resume would load is there and complete (:mod:`verl_remote.runtime.checkpoints`).

    With ``resume_mode=auto`` a damaged or cut-short latest checkpoint is passed over for the newest complete
    one (the note says which and why); with ``resume_path`` it is refused, naming the file.
    """
    from verl_remote.runtime.checkpoints import check, complete_steps, resume_target

    trainer = config.trainer
    mode = str(trainer.get("resume_mode", "auto"))
    folder = str(trainer.default_local_dir)
    start_over = "set trainer.resume_mode=disable to start over"
    if mode == "resume_path":
        path = trainer.get("resume_from_path")
        if path is None or not os.path.isdir(str(path)):
            raise PreflightError(
                f"trainer.resume_from_path={path}: no such checkpoint folder (trainer.resume_mode=resume_path); "
                "point it at a global_step_<N> folder, or set trainer.resume_mode=auto"
            )
        parent = os.path.dirname(os.path.abspath(str(path)))
        problem = check(str(path))
        complete = complete_steps(parent)
        if problem is not None and complete:  # a folder of recorded checkpoints: this one was cut short or damaged
            newest = os.path.join(parent, f"global_step_{complete[0]}")
            raise PreflightError(
                f"trainer.resume_from_path={path}: {problem}; resume from a complete one, e.g. "
                f"trainer.resume_from_path={newest}"
            )
        return []
    if mode != "auto":
        return []
    try:
        # Read-only: another run may hold the folder (refused next, under the lock); the run moves the tracker.
        choice = resume_target(folder, move_tracker=False)
    except ValueError as exc:
        raise PreflightError(f"trainer.default_local_dir={folder}: {exc}; {start_over}") from exc
    if choice.step is not None and not os.path.isdir(os.path.join(folder, f"global_step_{choice.step}")):
        raise PreflightError(
            f"trainer.default_local_dir={folder}: latest_checkpointed_iteration.txt names step {choice.step}, but "
            f"{os.path.join(folder, f'global_step_{choice.step}')} does not exist; point the file at a step that "
            f"does, or {start_over}"
        )
    return [choice.note] if choice.note else []


#: W&B's modes that need no account (``WANDB_MODE``).
_WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")


def check_loggers(config: DictConfig) -> None:
    """``wandb`` among ``trainer.logger`` needs an API key where W&B looks for one (``WANDB_API_KEY``, or the
    ``~/.netrc`` entry ``wandb login`` writes), unless it logs locally (``WANDB_MODE=offline``): without one,
    wandb's ``init`` fails in verl's trainer after Ray and every actor started (or waits for a key on a terminal)."""
    import netrc
    import urllib.parse

    loggers = config.trainer.get("logger") or []
    loggers = [str(loggers)] if isinstance(loggers, str) else [str(logger) for logger in loggers]
    if "wandb" not in loggers:
        return
    import importlib.util

    if importlib.util.find_spec("wandb") is None:  # verl installs it
        raise PreflightError("trainer.logger includes wandb, which is not installed: pip install wandb")
    if os.environ.get("WANDB_MODE", "").strip().lower() in _WANDB_LOCAL_MODES or os.environ.get("WANDB_API_KEY"):
        return
    host = urllib.parse.urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        if netrc.netrc(os.environ.get("NETRC") or None).authenticators(host):
            return
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    raise PreflightError(
        f"trainer.logger includes wandb, and no W&B API key is set (WANDB_API_KEY, or the ~/.netrc entry for {host} "
        "that `wandb login` writes): export WANDB_API_KEY=<key> or run `wandb login`; WANDB_MODE=offline logs to "
        "./wandb without an account"
    )


def check_val_only(config: DictConfig) -> None:
    """``trainer.val_only`` stops verl after its validation before training: without that validation
    (``val_before_train=false``) verl would train every step instead."""
    trainer = config.trainer
    if trainer.get("val_only", False) and not trainer.get("val_before_train", True):
        raise PreflightError(
            "trainer.val_only=true with trainer.val_before_train=false: verl validates only in its validation before "
            "training, so this run would train every step; set trainer.val_before_train=true"
        )


def check_layout(config: DictConfig, name: str, single_forwarder: bool, verl_lora: bool = False) -> None:
    """A backend that needs every call from one forwarder (``requires_single_forwarder``) gets one; a LoRA adapter
    is asked only of a backend that trains one (``verl_lora``)."""
    from verl_remote.runtime.layout import lora_problem, single_forwarder_problem

    if problem := single_forwarder_problem(config, name, single_forwarder) or lora_problem(config, name, verl_lora):
        raise PreflightError(problem)


def probe_service(config: DictConfig, backend_probe: Callable[[DictConfig], None]) -> None:
    """The backend's service answers (:meth:`verl_remote.RemoteBackend.probe_service`), asked before verl is
    imported. Raises :class:`PreflightError`."""
    try:
        backend_probe(config)
    except PreflightError:
        raise
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc


def run_preflight(
    config: DictConfig,
    backend_preflight: Callable[[DictConfig], None] | None = None,
    *,
    single_forwarder: bool = False,
    verl_lora: bool = False,
) -> list[str]:
    """Every check of the prepared config (the demo's files made, paths absolute), the backend's last; the notes
    worth printing. Raises :class:`PreflightError`. The numbers (:func:`check_numbers`) are not among them: the CLI
    checks them once, before the config is prepared, so that a refused run makes nothing."""
    check_data(config)
    notes = check_model(config)
    check_output(config)
    notes += check_resume(config)
    check_layout(config, str(config.remote_backend.name), single_forwarder, verl_lora)
    check_val_only(config)
    check_loggers(config)
    if backend_preflight is not None:
        try:
            with warnings.catch_warnings(record=True) as warned:  # a backend's warnings are notes of the run
                warnings.simplefilter("always", UserWarning)
                backend_preflight(config)
        except PreflightError:
            raise
        except ValueError as exc:
            raise PreflightError(str(exc)) from exc
        notes += [str(w.message) for w in warned if issubclass(w.category, UserWarning)]
    return notes
