"""The built-in demo: a tiny model (and its variant for LoRA services), tokenizer and "say N" data set made
locally (:mod:`.assets`), its reward (:mod:`.reward`), the ``verl-remote://demo/...`` config values that
name them, and when a command is the demo (:func:`recipe_for`).

The demo's settings (its lengths, batch, learning rate, steps) are a recipe of their own,
``verl_remote/config/verl_remote_demo.yaml``: a run of the user's own model or data composes verl's defaults
instead, and never gets them by accident."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, open_dict

from verl_remote.discovery.compose import ConfigError

__all__ = [
    "DEMO_PREFIX",
    "DEMO_RECIPE",
    "OWN_INPUT_KEYS",
    "is_demo_value",
    "recipe_for",
    "resolve_demo_assets",
    "starts_from_demo",
]

#: Config values starting with this name an asset of the built-in demo, made on first use.
DEMO_PREFIX = "verl-remote://demo/"
#: The built-in recipe of the demo's settings (``--recipe demo``).
DEMO_RECIPE = "demo"
#: The keys that make a run the user's own: a command that names a model or data of its own composes verl's
#: defaults, not the demo's.
OWN_INPUT_KEYS = ("actor_rollout_ref.model.path", "data.train_files", "data.val_files")


def is_demo_value(value: Any) -> bool:
    """Whether a config value names the demo's assets only: ``verl-remote://demo/...``, or the files they resolve
    to (the demo's cache folder, its reward file); a list when each of its items does."""
    if isinstance(value, list | tuple):
        return bool(value) and all(is_demo_value(item) for item in value)
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):  # a list as an override writes it
        return is_demo_value([item.strip().strip("'\"") for item in text[1:-1].split(",") if item.strip()])
    if text.startswith(DEMO_PREFIX):
        return True
    text = text.removeprefix("file://")
    if "://" in text or not text:
        return False
    from verl_remote.demo.assets import default_cache_dir

    cache = default_cache_dir().expanduser().resolve()
    path = Path(text).expanduser().resolve()
    return path == cache or cache in path.parents or path == (Path(__file__).parent / "reward.py").resolve()


def recipe_for(overrides: Sequence[str], recipe: str | None) -> str | None:
    """The recipe a command composes: the one it names; else the demo (:data:`DEMO_RECIPE`) when its overrides name
    no model and no data of their own (:data:`OWN_INPUT_KEYS`); else none, which is verl's defaults."""
    if recipe is not None:
        return recipe
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") in OWN_INPUT_KEYS and not is_demo_value(value):
            return None
    return DEMO_RECIPE


#: The demo's recipe as a recipe's defaults list names it.
DEMO_CONFIG = "verl_remote_demo"
#: The data keys that make a run's task its own (the demo's task with the user's model is a legitimate mix).
OWN_DATA_KEYS = ("data.train_files", "data.val_files")


def starts_from_demo(recipe: str) -> bool:
    """Whether a recipe is the demo's settings: ``--recipe demo``, or a file whose defaults list names them."""
    if recipe == DEMO_RECIPE:
        return True
    import yaml

    try:
        document = yaml.safe_load(Path(recipe).expanduser().read_text())
    except (OSError, yaml.YAMLError):
        return False  # composing it says what is wrong
    defaults = document.get("defaults") if isinstance(document, dict) else None
    return isinstance(defaults, list) and any(str(entry).strip() == DEMO_CONFIG for entry in defaults)


def _demo_values(config: DictConfig) -> Iterator[tuple[Any, Any, str]]:
    """(container, key, value) for every string value naming a demo asset."""
    stack: list[Any] = [config]
    while stack:
        node = stack.pop()
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
        for key, value in items:
            if isinstance(value, DictConfig | ListConfig):
                stack.append(value)
            elif isinstance(value, str) and value.startswith(DEMO_PREFIX):
                yield node, key, value


def resolve_demo_assets(config: DictConfig) -> bool:
    """Replace ``verl-remote://demo/...`` values with the demo's files, creating them once."""
    found = list(_demo_values(config))
    if not found:
        return False
    from pathlib import Path

    from verl_remote.demo import reward
    from verl_remote.demo.assets import demo_assets_made, ensure_demo_assets

    if not demo_assets_made():  # said only when something is made
        print("verl-remote: preparing the demo's model, tokenizer and data (once, then cached) ...", flush=True)
    assets = ensure_demo_assets()
    paths = {
        "model": assets.model_path,
        "lora-model": assets.lora_model_path,
        "train.parquet": assets.train_file,
        "val.parquet": assets.val_file,
        "reward.py": Path(reward.__file__),
    }
    with open_dict(config):
        for node, key, value in found:
            name = value.removeprefix(DEMO_PREFIX)
            if name not in paths:
                known = ", ".join(DEMO_PREFIX + n for n in paths)
                raise ConfigError(f"unknown demo asset {value!r}; known: {known}")
            node[key] = str(paths[name])
    return True
