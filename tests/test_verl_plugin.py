"""verl itself loads verl-remote's hook through its `verl.plugins` entry points."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from conftest import python
from verl_remote.integration import verl_plugin


def test_import_verl_alone_loads_the_plugin_and_verls_registries_find_the_remote_trainer_and_replica() -> None:
    """What `python -m verl.trainer.main_ppo` does: import verl (which loads the plugin, verl-remote not imported
    before), then look the trainer mode and the rollout replica up in verl's registries."""
    out = python(
        "import json, sys\n"
        "assert 'verl_remote' not in sys.modules\n"
        "import verl\n"
        "plugin = sys.modules.get('verl_remote.integration.verl_plugin')\n"
        "registered = plugin is not None and plugin.is_registered()\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "lazy = 'verl_remote.integration.trainer' not in sys.modules\n"
        "trainer = get_trainer_cls('remote')\n"
        "replica = get_rollout_replica_class('verl_remote')\n"
        "print(json.dumps([registered, lazy, trainer.__module__ + '.' + trainer.__name__, replica.__name__,\n"
        "                  get_trainer_cls('sync').__name__]))\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    registered, lazy, trainer, replica, sync = json.loads(out.stdout.strip().splitlines()[-1])
    assert registered is True
    assert lazy is True  # verl-remote's trainer is imported when verl asks for it, not by the plugin
    assert trainer == "verl_remote.integration.trainer.RemotePPOTrainer"
    assert replica == "BackendRolloutReplica"
    assert sync == "PPOTrainerSync"


def test_register_is_idempotent() -> None:
    verl_plugin.register()
    verl_plugin.register()
    assert verl_plugin.is_registered()


def test_verl_loads_nothing_when_plugins_are_disabled_and_doctor_says_why(
    monkeypatch: pytest.MonkeyPatch, cli_main: Any
) -> None:
    env = {"VERL_USE_EXTERNAL_PLUGINS": "none"}
    out = python("import sys, verl; print('verl_remote.integration.verl_plugin' in sys.modules)", env=env)
    assert out.stdout.strip().splitlines()[-1] == "False"
    # `verl-remote doctor` reads the same variable verl reads, and says what it does.
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    code, stdout, _err = cli_main("doctor", "--no-ray")
    assert code == 1
    assert "[FAIL] verl loads the verl-remote plugin: VERL_USE_EXTERNAL_PLUGINS='none' stops verl" in stdout
    # An allowlist naming the plugin passes the same check (doctor's line for it: tests/test_cli.py).
    from verl_remote.cli.doctor import check_plugin

    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "verl_remote")
    allowlisted = check_plugin()
    assert allowlisted.ok, allowlisted.detail
    assert allowlisted.name == "verl loads the verl-remote plugin"


def test_verls_launcher_sees_the_group_with_plus_and_config_overrides_make_it_compose_the_same_run(
    cli_main: Any,
) -> None:
    """`python -m verl.trainer.main_ppo +remote_backend=NAME $(verl-remote config --overrides ...)`: verl's own
    launcher finds the backend's group through the search path plugin and composes the run verl-remote does."""
    chosen = ["remote_backend=echo", "remote_backend.state_dir=/srv/x"]
    code, words, err = cli_main("config", "--overrides", *chosen)
    assert code == 0, err[-3000:]
    overrides = words.split()
    assert "trainer.v1.trainer_mode=remote" in overrides and "actor_rollout_ref.rollout.name=verl_remote" in overrides
    assert "remote_backend.state_dir=/srv/x" in overrides  # differs from the group file's value
    theirs = python(
        "import sys, runpy\n"
        f"sys.argv = ['main_ppo', '+remote_backend=echo', *{overrides!r}, '--cfg', 'job']\n"
        "runpy.run_module('verl.trainer.main_ppo', run_name='__main__')\n"
    )
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    printed = yaml.safe_load(theirs.stdout)
    assert printed["remote_backend"] == {"name": "echo", "state_dir": "/srv/x"}
    # A `+` adds a key verl's config does not have; verl-remote's config has it already.
    code, mine, err = cli_main("config", "remote_backend=echo", *(word.removeprefix("+") for word in overrides))
    assert code == 0, err[-3000:]
    assert printed == yaml.safe_load(mine)
