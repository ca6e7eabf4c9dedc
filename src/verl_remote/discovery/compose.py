"""Compose the run config: verl's ``ppo_trainer`` plus the ``remote_backend`` group.

The CLI composes through Hydra's compose API with verl-remote's primary config
(``verl_remote/config/verl_remote.yaml``), so every verl override works as on
``python -m verl.trainer.main_ppo``, and ``remote_backend=<name>`` picks a
backend without ``+``. A recipe file (see ``configs/``) may stand in for the
primary config; it lists ``verl_remote`` first in its defaults.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from verl_remote.discovery.registry import get_backend_spec
from verl_remote.kit.errors import ConfigError

__all__ = [
    "BUILTIN_RECIPES",
    "CONFIG_MODULE",
    "CONFIG_NAME",
    "ConfigError",
    "compose_config",
    "selected_backend",
    "verl_overrides",
]

CONFIG_MODULE = "verl_remote.config"
#: The primary config: verl's ppo_trainer, the remote_backend group and what a backend needs; verl's defaults
#: for everything else.
CONFIG_NAME = "verl_remote"
#: Recipes inside verl-remote's wheel, by the name ``--recipe`` takes: config names in :data:`CONFIG_MODULE`.
BUILTIN_RECIPES = {"demo": "verl_remote_demo"}


@functools.cache
def verl_config_dir() -> str:
    """The folder of verl's trainer configs (``verl/trainer/config``), found without importing verl, once per
    process (``train`` composes twice, the run's config and the backend's defaults).

    Hydra's ``pkg://verl.trainer.config`` imports the package, and verl's ``__init__`` imports torch: about 4 s
    of a command that only composes a config (a refusal of bad input among them).
    """
    import importlib.util

    from verl_remote.discovery.compat import UnsupportedVerlError, require_supported_verl

    require_supported_verl()  # a missing or unsupported verl is named as such
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedVerlError("verl is installed but cannot be found: pip install --force-reinstall verl")
    for root in spec.submodule_search_locations:
        folder = Path(root) / "trainer" / "config"
        if (folder / "ppo_trainer.yaml").is_file():
            return str(folder)
    raise UnsupportedVerlError(f"verl's trainer configs (trainer/config/ppo_trainer.yaml) are missing: {spec.origin}")


def _search_path() -> list[str]:
    """Searched after the primary config's own folder: verl-remote's primary config (for recipes), then verl's
    trainer configs it extends. Hydra accepts a search path only from the primary config or the command line,
    and a recipe includes verl_remote.yaml, so it is given as an override. Backends' groups come from the Hydra
    search path plugin."""
    return [f"pkg://{CONFIG_MODULE}", f"file://{verl_config_dir()}"]


def _override_backend(overrides: Sequence[str]) -> str | None:
    """The backend chosen on the command line, if any (the last choice wins, as in Hydra)."""
    chosen = None
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") == "remote_backend" and value not in ("", "null"):
            chosen = value
    return chosen


def selected_backend(config: DictConfig) -> str | None:
    """The backend name a composed config selects, or ``None``."""
    section = config.get("remote_backend")
    if section is None:
        return None
    name = section.get("name")
    return str(name) if name is not None else None


def _check_yaml(path: Path) -> None:
    """A recipe that is not YAML: the file, the line and the parser's reason, not the parser's traceback."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(part for part in (exc.context, exc.problem) if part)
        raise ConfigError(f"recipe {path}{where}: not valid YAML: {problem}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"recipe {path}: not valid YAML: {exc}") from None
    if document is not None and not isinstance(document, dict):
        raise ConfigError(f"recipe {path}: must be a mapping of config keys, not a {type(document).__name__}")


def compose_config(overrides: Sequence[str] = (), recipe: str | Path | None = None) -> DictConfig:
    """Compose the run config from overrides and an optional recipe: a file, or the name of a built-in one
    (:data:`BUILTIN_RECIPES`; ``"demo"`` is the built-in demo). Without a recipe, :data:`CONFIG_NAME`.

    Raises:
        BackendError: ``remote_backend=<name>`` names a backend that is missing,
            ambiguous or broken (the message lists what is installed).
        ConfigError: Hydra rejected an override or the recipe; a key the config does not have is named with the
            nearest one it has.
    """
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides)
    backend = _override_backend(overrides)
    if backend is not None:
        get_backend_spec(backend)  # a clear BackendError before Hydra's generic one

    alone: str | None = None
    if recipe is None or (isinstance(recipe, str) and recipe in BUILTIN_RECIPES):
        context: Any = initialize_config_module(config_module=CONFIG_MODULE, version_base=None)
        config_name = CONFIG_NAME if recipe is None else BUILTIN_RECIPES[str(recipe)]
    else:
        path = Path(recipe).expanduser().resolve()
        if not path.is_file():
            builtin = ", ".join(BUILTIN_RECIPES)
            raise ConfigError(f"recipe {str(recipe)!r} does not exist (a file, or a built-in recipe: {builtin})")
        if path.suffix not in (".yaml", ".yml"):
            raise ConfigError(f"recipe {str(recipe)!r} is not a .yaml file")
        _check_yaml(path)
        # The recipe alone, from a folder of its own: Hydra searches the primary config's folder before every
        # installed group, so a remote_backend/arctic.yaml planted beside a recipe in a shared folder would replace
        # the installed one (and its launch: command would run). A recipe is one file.
        # Under a name of its own: a recipe called verl_remote.yaml would otherwise include itself for verl-remote's.
        alone = tempfile.mkdtemp(prefix="verl-remote-recipe-")
        shutil.copyfile(path, os.path.join(alone, f"{RECIPE_NAME}.yaml"))
        context = initialize_config_dir(config_dir=alone, version_base=None)
        config_name = RECIPE_NAME
    words = [f"hydra.searchpath=[{','.join(_search_path())}]", *overrides]

    try:
        with context:
            config = compose(config_name=config_name, overrides=words, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        unknown = _UNKNOWN_KEY.match(str(exc).strip())
        if unknown is None:
            said = str(exc).strip()
            if alone is not None:
                raise _recipe_error(said, Path(recipe).expanduser().resolve(), alone) from exc  # type: ignore[arg-type]
            raise ConfigError(said) from exc
        others = [o for o in overrides if o.partition("=")[0] != unknown.group(1)]
        raise _unknown_key(unknown.group(1), others, recipe) from exc
    finally:
        if alone is not None:
            shutil.rmtree(alone, ignore_errors=True)

    choice = OmegaConf.select(config, "hydra.runtime.choices.remote_backend")
    with open_dict(config):
        del config["hydra"]
    if choice is not None:
        if choice != backend:
            get_backend_spec(choice)  # chosen by a recipe: the same check as for an override
        name = selected_backend(config)
        if name != choice:
            raise ConfigError(f"remote_backend/{choice}.yaml must set 'name: {choice}' (it sets {name!r})")
    return config


#: The name a recipe file is composed under, in a folder of its own (:func:`compose_config`).
RECIPE_NAME = "verl_remote_user_recipe"
_MISSING_CONFIG = re.compile(r"Could not load '([^']+)'|Could not find '([^']+)'")


def _recipe_error(said: str, path: Path, alone: str) -> ConfigError:
    """Hydra's refusal of a recipe in the recipe's own terms: its file, not the folder it was composed from; and a
    defaults entry that names a file beside it, which a recipe cannot pull in."""
    said = said.replace(os.path.join(alone, f"{RECIPE_NAME}.yaml"), str(path)).replace(alone, str(path.parent))
    said = said.replace(RECIPE_NAME, path.stem)
    missing = _MISSING_CONFIG.search(said)
    name = next((group for group in missing.groups() if group), None) if missing else None
    if name is not None and any((path.parent / f"{name}{suffix}").is_file() for suffix in (".yaml", ".yml")):
        return ConfigError(
            f"recipe {path}: its defaults list names {name!r}, a file beside it; a recipe is read alone (a file "
            f"beside it in a shared folder must not change a run): copy the keys of {name}.yaml into the recipe"
        )
    if name is not None:
        return ConfigError(
            f"recipe {path}: its defaults list names {name!r}, a config neither verl-remote nor verl has; a recipe "
            "starts from verl_remote (or verl_remote_demo) and chooses a backend with 'override remote_backend: <name>'"
        )
    return ConfigError(f"recipe {path}: {said.splitlines()[0]}")


# Hydra's words for an override of a key the config does not have, which it follows with a hint to add the key
# with '+': a key that nothing reads, where the user almost always misspelt or misplaced one.
_UNKNOWN_KEY = re.compile(r"^Could not override '([^']+)'\.\nTo append to your config use \+")


def _unknown_key(key: str, others: list[str], recipe: str | Path | None) -> ConfigError:
    """The error for ``key``, which the config does not have: the key it has that was most likely meant."""
    try:
        config = compose_config(others, recipe=recipe)
    except ConfigError:  # another bad override: named once this one is fixed
        config = None
    guess = _closest_key(key, _keys(OmegaConf.to_container(config, resolve=False))) if config is not None else None
    if guess is not None:
        return ConfigError(f"unknown key {key}; did you mean {guess}?")
    return ConfigError(
        f"unknown key {key}: neither verl's config nor the backend's has it ('verl-remote config' prints every key); "
        f"+{key}=<value> adds it, for code of your own that reads it"
    )


def _keys(node: Any, prefix: str = "") -> list[str]:
    """Every key of a config, sections included, as dotted paths."""
    found: list[str] = []
    if isinstance(node, dict):
        for name, child in node.items():
            found.append(f"{prefix}{name}")
            found += _keys(child, f"{prefix}{name}.")
    return found


def _closest_key(key: str, keys: list[str]) -> str | None:
    """The key of ``keys`` meant by ``key``: the same name in the same section (``remote_backend.comms.url`` for
    ``remote_backend.url``), else the only key of that name anywhere, else a close spelling of the name beside it
    (``optim.lr`` for ``optim.lrr``), else the same or a close name in a close spelling of its section."""
    import difflib

    parent, _, name = key.rpartition(".")
    section = key.split(".", 1)[0]
    same_name = [k for k in keys if k.rpartition(".")[2] == name and k != key]
    for group in ([k for k in same_name if k.split(".", 1)[0] == section], same_name if len(same_name) == 1 else []):
        if group:
            return min(group, key=lambda k: (k.count("."), len(k)))
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.75)
    if close:
        return siblings[close[0]]
    elsewhere = [k for k in keys if k.rpartition(".")[0] != parent]
    for guess in difflib.get_close_matches(key, elsewhere, n=3, cutoff=0.85):  # a misspelt section: trainr.x
        if difflib.SequenceMatcher(None, name, guess.rpartition(".")[2]).ratio() >= 0.75:
            return guess
    return None


_PLAIN = re.compile(r"^[\w./:@~+-]+$")


def _override_value(value: Any, key: str) -> str:
    """``value`` in Hydra's override grammar, as one shell word."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(_override_value(item, key) for item in value) + "]"
    if isinstance(value, dict):
        items = ",".join(f"{name}:{_override_value(item, key)}" for name, item in value.items())
        return "{" + items + "}"
    text = str(value)
    if any(c.isspace() for c in text):
        raise ConfigError(f"{key}={text!r}: a value with spaces cannot be printed as one override word")
    if text.startswith("${"):
        return text  # an interpolation, kept as such
    if _PLAIN.match(text) and text.lower() not in ("null", "true", "false", "nan", "inf", "-inf"):
        try:
            float(text)
        except ValueError:
            return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        found: dict[str, Any] = {}
        for name, child in node.items():
            found.update(_leaves(child, f"{prefix}{name}."))
        return found
    return {prefix[:-1]: node}


def verl_overrides(config: DictConfig, group_defaults: DictConfig | None) -> list[str]:
    """The settings of ``config`` that differ from verl's own ``ppo_trainer`` config, as verl overrides.

    With ``+remote_backend=<name>`` in front, they make ``python -m verl.trainer.main_ppo`` compose ``config``:
    ``remote_backend`` keys appear only where they differ from the group file's (``group_defaults``). Keys the
    group brings into verl's config (``verl_remote_launcher/remote.yaml``) take no ``+``.
    """
    from importlib.resources import files

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        base = compose(config_name="ppo_trainer")
    mine = OmegaConf.to_container(config, resolve=False)
    theirs = OmegaConf.to_container(base, resolve=False)
    launcher = OmegaConf.to_container(
        OmegaConf.create((files(CONFIG_MODULE) / "verl_remote_launcher" / "remote.yaml").read_text())
    )
    assert isinstance(mine, dict) and isinstance(theirs, dict) and isinstance(launcher, dict)
    backend = mine.pop("remote_backend", None) or {}
    flat_theirs = _leaves(theirs)
    brought = _leaves(launcher)
    words = []
    for key, value in _leaves(mine).items():
        if key not in flat_theirs and key not in brought:
            words.append(f"+{key}={_override_value(value, key)}")
        elif flat_theirs.get(key, brought.get(key)) != value:
            words.append(f"{key}={_override_value(value, key)}")
    group = OmegaConf.to_container(group_defaults, resolve=False) if group_defaults is not None else {}
    flat_group = _leaves(group) if isinstance(group, dict) else {}
    for key, value in _leaves(backend).items():
        if flat_group.get(key, object()) != value:
            words.append(f"remote_backend.{key}={_override_value(value, key)}")
    return words
