"""The built-in demo: a tiny model (and its variant for LoRA services), tokenizer and "say N" data set made
locally (:mod:`.assets`), its reward (:mod:`.reward`), and the ``verl-remote://demo/...`` config values that
name them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, open_dict

from verl_remote.discovery.compose import ConfigError

__all__ = ["DEMO_PREFIX", "resolve_demo_assets"]

#: Config values starting with this name an asset of the built-in demo, made on first use.
DEMO_PREFIX = "verl-remote://demo/"


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
    from verl_remote.demo.assets import ensure_demo_assets

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
