"""The run's own inputs, checked before anything starts: the model and data it names, its data in verl's RL
format, a reward for every ``data_source``, and none of the demo's inputs mixed into a run of the user's by
accident.

``verl-remote train`` runs :func:`check_inputs` on the composed config, before verl is imported and before
the demo's files are made, so each refusal takes seconds. What verl needs of a data file (its RL dataset and
reward managers read these): the prompt column (``data.prompt_key``, default ``prompt``) as a list of chat
messages; ``data_source``, which picks the reward; ``reward_model`` with a ``ground_truth`` field, which the
reward function is given. A reward function (``reward.custom_reward_function.path`` and ``.name``) must
exist and be defined in its file; without one, verl's built-in rewards must score every ``data_source``
(:mod:`verl_remote.integration.rewards`).

The demo's inputs (its model, data, validation set and reward; :func:`verl_remote.demo.is_demo_value`) only
fit the demo's task (``data_source`` :data:`~verl_remote.demo.assets.DATA_SOURCE`): one of them beside data of
another task is refused, naming the key to set. A legitimate mix (a model of one's own on the demo's task) is
said in one line.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from verl_remote.cli.preflight import PreflightError, check_data, check_model
from verl_remote.demo import DEMO_CONFIG, DEMO_PREFIX, DEMO_RECIPE, OWN_DATA_KEYS, is_demo_value, starts_from_demo
from verl_remote.demo.assets import DATA_SOURCE as DEMO_SOURCE

__all__ = ["check_inputs", "data_sources", "demo_recipe_problem"]

MODEL_KEY = "actor_rollout_ref.model.path"
TRAIN_KEY = "data.train_files"
VAL_KEY = "data.val_files"
REWARD_KEY = "reward.custom_reward_function.path"
REWARD_NAME_KEY = "reward.custom_reward_function.name"
#: The columns verl's reward managers read, besides the prompt: every manager it registers reads both.
REWARD_COLUMNS = ("data_source", "reward_model")


@dataclass
class DataFiles:
    """The parquet files of one data key, as far as they can be read here (local files only)."""

    key: str
    value: str
    #: The data_source values of the files read; None when any could not be read (a remote path).
    sources: set[str] | None = field(default_factory=set)

    @property
    def demo(self) -> bool:
        """The demo's task: named as the demo's, or holding its data_source only."""
        return is_demo_value(self.value) or self.sources == {DEMO_SOURCE}

    def describe(self) -> str:
        if self.sources:
            return f"{self.key}={self.value} (data_source {_names(self.sources)})"
        return f"{self.key}={self.value}"


def _names(values: set[str], limit: int = 3) -> str:
    ordered = sorted(values)
    shown = ", ".join(repr(v) for v in ordered[:limit])
    return shown + (f" and {len(ordered) - limit} more" if len(ordered) > limit else "")


def _paths(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, list | tuple) or OmegaConf.is_list(value):
        return [str(v) for v in value]
    return [str(value)]


def _local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def data_sources(path: str) -> set[str]:
    """The distinct ``data_source`` values of a local parquet file (that column only is read)."""
    import pyarrow.parquet as pq

    return {str(v) for v in pq.read_table(path, columns=["data_source"]).column(0).unique().to_pylist()}


def _check_columns(key: str, path: str, prompt_key: str, reward_columns: bool) -> Iterator[str]:
    """The file's columns as verl reads them; yields its data_source values (none when it has no such column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
    except (OSError, pa.ArrowException) as exc:
        raise PreflightError(
            f"{key}={path}: not a parquet file verl can read ({exc}); write it with pandas' "
            "DataFrame.to_parquet (docs/user-guide.md, 'Your data')"
        ) from exc
    if metadata.num_rows == 0:  # before its columns: an empty column's type says nothing of the data
        raise PreflightError(f"{key}={path}: no rows, nothing to train on; point it at your data set")
    schema = metadata.schema.to_arrow_schema()
    names = set(schema.names)
    needed = [prompt_key, *(REWARD_COLUMNS if reward_columns else ())]
    missing = [column for column in needed if column not in names]
    if missing:
        raise PreflightError(
            f"{key}={path}: no column {', '.join(repr(c) for c in missing)} (it has {', '.join(schema.names)}); "
            f"verl's RL data needs {', '.join(repr(c) for c in needed)} (docs/user-guide.md, 'Your data')"
            + ("; set data.prompt_key to the prompt's column" if prompt_key in missing else "")
        )
    prompt = schema.field(prompt_key).type
    if not (pa.types.is_list(prompt) or pa.types.is_large_list(prompt)) or not pa.types.is_struct(prompt.value_type):
        kind = "plain text" if pa.types.is_string(prompt) or pa.types.is_large_string(prompt) else str(prompt)
        raise PreflightError(
            f"{key}={path}: column {prompt_key!r} holds {kind}, not chat messages; verl applies the model's chat "
            f"template to a list of messages: [{{'role': 'user', 'content': '...'}}] (docs/user-guide.md, 'Your data')"
        )
    if reward_columns:
        reward = schema.field("reward_model").type
        if not pa.types.is_struct(reward) or reward.get_field_index("ground_truth") < 0:
            raise PreflightError(
                f"{key}={path}: column 'reward_model' holds {reward}; verl's reward managers read "
                "reward_model['ground_truth'] and give it to the reward function: {'ground_truth': ...} in every row"
            )
    if "data_source" in names:
        yield from data_sources(path)


def _defined(path: str, name: str) -> None:
    """The reward file parses and binds ``name`` at its top level (a function, an import, an assignment)."""
    try:
        tree = ast.parse(Path(path).read_bytes(), filename=path)  # Python's own reading: a coding line, else UTF-8
    except UnicodeDecodeError as exc:  # ast raises SyntaxError for most bad bytes, this for some
        raise PreflightError(
            f"{REWARD_KEY}={path}: not UTF-8 (byte {exc.start}: {exc.reason}); save it as UTF-8, as Python reads it"
        ) from None
    except SyntaxError as exc:
        if "codec can't decode" in str(exc.msg) or "encoding problem" in str(exc.msg):
            raise PreflightError(
                f"{REWARD_KEY}={path}, line {exc.lineno}: not UTF-8 ({exc.msg}); save it as UTF-8, as Python reads it"
            ) from None
        raise PreflightError(f"{REWARD_KEY}={path}, line {exc.lineno}: not valid Python: {exc.msg}") from None
    bound: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.append(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound += [alias.asname or alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound += [t.id for t in targets if isinstance(t, ast.Name)]
    if name not in bound:
        functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        has = f"it defines {', '.join(functions)}" if functions else "it defines no function"
        raise PreflightError(
            f"{REWARD_NAME_KEY}={name}: {path} has no {name!r} ({has}); set {REWARD_NAME_KEY} to the reward function"
        )


def _not_set(config: DictConfig, defaults: DictConfig | None, key: str) -> bool:
    """Whether ``key`` holds verl's default because the user did not set it (``defaults``: the config composed
    with nothing of the user's, for a run that is not the demo)."""
    if defaults is None:
        return False
    return bool(OmegaConf.select(config, key, default=None) == OmegaConf.select(defaults, key, default=None))


def _check_unset_inputs(config: DictConfig, unset: set[str]) -> None:
    """A model or data key the user did not set, whose verl default is not there: named as such."""
    for key, kind in ((MODEL_KEY, "model"), (TRAIN_KEY, "training data"), (VAL_KEY, "validation data")):
        value = OmegaConf.select(config, key, default=None)
        if value is None or key not in unset:
            continue
        if not all(os.path.exists(os.path.expanduser(p)) for p in _paths(value) if _local(p)):
            raise PreflightError(
                f"{key} is not set, and verl's default {value} is not there: set {key} to your {kind} "
                "(a run that names a model or data of its own gets verl's defaults, not the demo's; "
                "docs/user-guide.md, 'Your model, your data, your reward')"
            )


def _reward(config: DictConfig) -> tuple[str | None, str]:
    reward = config.get("reward") or {}
    function = reward.get("custom_reward_function") or {}
    path = function.get("path")
    return (str(path) if path else None), str(function.get("name") or "compute_score")


def check_inputs(config: DictConfig, defaults: DictConfig | None = None) -> list[str]:
    """The model, data and reward of a composed run (see the module); the line to print for a mix of the demo's
    inputs and the user's, if any. ``defaults`` is the config composed with nothing of the user's, for a run that
    is not the demo (so that a key left at verl's default is named as such). Raises :class:`PreflightError`."""
    unset = {key for key in (MODEL_KEY, TRAIN_KEY, VAL_KEY) if _not_set(config, defaults, key)}
    check_data(config, skip=unset)  # what the user set, first
    if MODEL_KEY not in unset and not str(OmegaConf.select(config, MODEL_KEY, default="")).startswith(DEMO_PREFIX):
        check_model(config)  # its notes are run_preflight's to print (the demo's model is made later)
    _check_unset_inputs(config, unset)
    reward_path, reward_name = _reward(config)
    reward_section = config.get("reward") or {}
    manager = reward_section.get("reward_manager") or {}
    # verl's registered reward managers all score rows by data_source and reward_model.ground_truth; a manager of
    # the user's own (source: importlib) reads what it reads.
    registered = str(manager.get("source", "register")) == "register"
    if reward_path is not None and not reward_path.startswith((DEMO_PREFIX, "pkg://")):
        local = os.path.expanduser(reward_path.removeprefix("file://"))
        if not os.path.isfile(local):
            raise PreflightError(
                f"{REWARD_KEY}={reward_path}: no such file; point it at your reward function's .py file"
            )
        _defined(local, reward_name)

    prompt_key = str(OmegaConf.select(config, "data.prompt_key", default="prompt"))
    files: dict[str, DataFiles] = {}
    for key in (TRAIN_KEY, VAL_KEY):
        value = OmegaConf.select(config, key, default=None)
        found = files[key] = DataFiles(
            key, str(value) if not OmegaConf.is_list(value) else "[" + ",".join(_paths(value)) + "]"
        )
        for path in _paths(value):
            if path.startswith(DEMO_PREFIX):
                found.sources = None if found.sources is None else found.sources | {DEMO_SOURCE}
            elif not _local(path) or found.sources is None:
                found.sources = None
            else:
                local = os.path.expanduser(path.removeprefix("file://"))
                found.sources |= set(_check_columns(key, local, prompt_key, registered))
    train, val = files[TRAIN_KEY], files[VAL_KEY]

    model = OmegaConf.select(config, MODEL_KEY, default=None)
    model_demo = model is not None and is_demo_value(model)
    reward_demo = reward_path is not None and is_demo_value(reward_path)
    own = [f for f in (train, val) if f.sources is not None and not f.demo]
    if model_demo and own:
        raise PreflightError(
            f"{MODEL_KEY}={model} is the demo's model, whose tokenizer knows only the demo's words, but "
            f"{own[0].describe()} is data of your own: set {MODEL_KEY} to your model"
        )
    if reward_demo and own:
        raise PreflightError(
            f"{REWARD_KEY}={reward_path} is the demo's reward, which scores only the demo's task (data_source "
            f"{DEMO_SOURCE!r}), but {own[0].describe()} is another task: set {REWARD_KEY} to your reward "
            f"function's file (and {REWARD_NAME_KEY} to its name)"
        )
    if val.demo and train in own:
        raise PreflightError(
            f"{VAL_KEY}={val.value} is the demo's validation set, but {train.describe()} is data of your own: "
            f"set {VAL_KEY} to your validation set (your training file will do)"
        )
    with_reward_model = bool((reward_section.get("reward_model") or {}).get("enable", False))
    if reward_path is None and registered and not with_reward_model:
        _check_builtin_rewards(train, val)
    _check_enough_rows(config, train)

    parts = {
        "model": model_demo,
        "data": train.demo,
        "validation set": val.demo,
        "reward": reward_demo,
    }
    demo = [name for name, is_demo in parts.items() if is_demo]
    if not demo or len(demo) == len(parts):
        return []
    mine = [name for name, is_demo in parts.items() if not is_demo]
    return [f"the demo's {_join(demo)} with your {_join(mine)}"]


def _check_enough_rows(config: DictConfig, train: DataFiles) -> None:
    """A step takes data.train_batch_size prompts and verl's loader drops an incomplete last batch: a training set
    smaller than one batch runs no step (verl fails dividing by its zero steps per epoch)."""
    import pyarrow.parquet as pq

    paths = [p for p in _paths(OmegaConf.select(config, TRAIN_KEY, default=None)) if not p.startswith(DEMO_PREFIX)]
    if not paths or not all(_local(p) for p in paths):
        return
    rows = sum(pq.read_metadata(os.path.expanduser(p.removeprefix("file://"))).num_rows for p in paths)
    limit = OmegaConf.select(config, "data.train_max_samples", default=-1)
    if isinstance(limit, int) and limit > 0:
        rows = min(rows, limit)
    batch = OmegaConf.select(config, "data.train_batch_size", default=None)
    if rows == 0:
        raise PreflightError(
            f"{train.key}={train.value}: no rows, so there is nothing to train on; point it at a data set"
        )
    if isinstance(batch, int) and rows < batch:
        raise PreflightError(
            f"data.train_batch_size={batch}: {train.key}={train.value} has {rows} rows, fewer than one step's "
            f"prompts, so no step would run (verl drops an incomplete batch); set data.train_batch_size to {rows} "
            "or less"
        )


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _check_builtin_rewards(*files: DataFiles) -> None:
    """Without a reward function of the user's, verl's built-in rewards must score every data_source."""
    from verl_remote.integration.rewards import builtin_rewards

    builtin = builtin_rewards()
    if builtin is None:  # a verl whose source does not read as expected: its reward worker will say
        return
    for found in files:
        unscored = {s for s in found.sources or () if not builtin.scores(s)}
        if not unscored:
            continue
        hint = (
            f"; the demo's task is scored by {REWARD_KEY}={DEMO_PREFIX}reward.py"
            if unscored == {DEMO_SOURCE}
            else f" (verl scores {builtin.summary()})"
        )
        raise PreflightError(
            f"{found.key}={found.value}: no reward is set and verl has none for data_source {_names(unscored)}: set "
            f"{REWARD_KEY}=<your reward .py file> and {REWARD_NAME_KEY}=<its function> (docs/user-guide.md, "
            f"'Your reward'){hint}"
        )


def _the_demos_task(value: Any) -> bool:
    """Whether data files hold the demo's task only (copies of its files, say): every row's ``data_source`` the
    demo's. A file that cannot be read is not (the run's input checks say why)."""
    paths = [str(v) for v in value] if isinstance(value, list | tuple) or OmegaConf.is_list(value) else [str(value)]
    try:
        return all(data_sources(os.path.expanduser(path.removeprefix("file://"))) == {DEMO_SOURCE} for path in paths)
    except Exception:  # not a local parquet file with a data_source column
        return False


def demo_recipe_problem(recipe: str | None, config: DictConfig) -> str | None:
    """A recipe that starts from the demo's settings, with data of the user's own (another task than the demo's):
    the demo's lengths, batch, learning rate and steps (made for its tiny model and two-token answers) would run
    the user's task without a word. One line naming the recipe, the demo's settings and the fix; None otherwise."""
    if recipe is None or not starts_from_demo(recipe):
        return None
    own = [
        (key, value)
        for key in OWN_DATA_KEYS
        if (value := OmegaConf.select(config, key, default=None)) is not None
        and not is_demo_value(value)
        and not _the_demos_task(value)
    ]
    if not own:
        return None
    key, value = own[0]
    shown = value if isinstance(value, str) else list(value)
    settings = ", ".join(
        f"{name}={OmegaConf.select(config, name, default=None)}"
        for name in (
            "data.max_prompt_length",
            "data.max_response_length",
            "actor_rollout_ref.actor.optim.lr",
            "trainer.total_training_steps",
        )
    )
    named = "--recipe demo" if recipe == DEMO_RECIPE else f"recipe {recipe}"
    return (
        f"{named} starts from the demo's settings ({DEMO_CONFIG}: {settings}), made for the demo's tiny model, but "
        f"{key}={shown} is data of your own: start the recipe from verl_remote, verl's defaults "
        "(defaults: [verl_remote, _self_]), and set what your run needs (configs/README.md)"
    )
