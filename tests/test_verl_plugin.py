"""verl itself loads verl-remote's hook through its `verl.plugins` entry points."""

from __future__ import annotations

import json

from conftest import cli, python
from verl_remote import verl_plugin


def test_import_verl_loads_the_plugin_without_importing_verl_remote_first() -> None:
    out = python(
        "import json, sys\n"
        "assert 'verl_remote' not in sys.modules\n"
        "import verl\n"
        "plugin = sys.modules.get('verl_remote.verl_plugin')\n"
        "print(json.dumps(plugin is not None and plugin.is_registered()))\n"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) is True


def test_register_is_idempotent() -> None:
    verl_plugin.register()
    verl_plugin.register()
    assert verl_plugin.is_registered()


def test_verl_loads_nothing_when_plugins_are_disabled_and_doctor_says_why() -> None:
    env = {"VERL_USE_EXTERNAL_PLUGINS": "none"}
    out = python("import sys, verl; print('verl_remote.verl_plugin' in sys.modules)", env=env)
    assert out.stdout.strip().splitlines()[-1] == "False"
    doctor = cli("doctor", "--no-ray", env=env)
    assert doctor.returncode == 1
    assert "[FAIL] verl loads the verl-remote plugin: VERL_USE_EXTERNAL_PLUGINS='none' stops verl" in doctor.stdout
    allowlisted = cli("doctor", "--no-ray", env={"VERL_USE_EXTERNAL_PLUGINS": "verl_remote"})
    assert "[ok  ] verl loads the verl-remote plugin" in allowlisted.stdout
