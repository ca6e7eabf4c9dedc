"""The registry against real installed distributions (tests/packages)."""

from __future__ import annotations

import json

import pytest

from conftest import python
from verl_remote import BackendImportError, BackendNotFoundError, DuplicateBackendError
from verl_remote.discovery.registry import (
    available_backends,
    get_backend_spec,
    load_backend_class,
    load_rollout_class,
    load_worker_class,
)

ECHO = "verl-remote-echo-backend 0.1.0"
BROKEN = "verl-remote-broken-backend 0.2.0"


def test_available_backends_lists_every_registration_with_its_distribution() -> None:
    found = {(b.name, b.distribution, b.version, b.target) for b in available_backends()}
    assert ("echo", "verl-remote-echo-backend", "0.1.0", "verl_remote_echo_backend:SPEC") in found
    assert (
        "broken",
        "verl-remote-broken-backend",
        "0.2.0",
        "verl_remote_broken_backend.needs_missing_dep:SPEC",
    ) in found
    # A name claimed by two distributions is listed once per distribution.
    assert sorted(b.distribution for b in available_backends() if b.name == "twin") == [
        "verl-remote-broken-backend",
        "verl-remote-echo-backend",
    ]


def test_a_backend_resolves_by_name_to_its_spec_and_classes() -> None:
    spec = get_backend_spec("echo")
    assert spec.name == "echo"
    assert spec.config_package == "verl_remote_echo_backend"
    assert load_backend_class("echo").__qualname__ == "EchoBackend"
    assert load_worker_class("echo").__qualname__ == "EchoWorker"
    assert load_rollout_class("echo").__qualname__ == "EchoReplica"


def test_discovery_and_specs_import_nothing_heavy() -> None:
    """Listing imports no backend code; loading a spec imports only the spec's module."""
    out = python(
        "import json, sys\n"
        "import verl_remote.discovery.registry\n"
        "heavy = ['verl', 'torch', 'ray', 'hydra', 'omegaconf']\n"
        "after_import = [m for m in heavy if m in sys.modules]\n"
        "verl_remote.discovery.registry.available_backends()\n"
        "after_list = 'verl_remote_echo_backend' in sys.modules\n"
        "verl_remote.discovery.registry.get_backend_spec('echo')\n"
        "after_spec = sorted(m for m in sys.modules if m.startswith('verl_remote_echo_backend'))\n"
        "print(json.dumps([after_import, after_list, after_spec]))\n"
    )
    assert out.returncode == 0, out.stderr
    after_import, after_list, after_spec = json.loads(out.stdout)
    assert after_import == []
    assert after_list is False
    assert after_spec == ["verl_remote_echo_backend"]


def test_unknown_name_lists_every_installed_backend_and_suggests_a_close_one() -> None:
    with pytest.raises(BackendNotFoundError) as info:
        get_backend_spec("ecoh")
    message = str(info.value)
    assert message.startswith("backend 'ecoh' is not installed; installed: ")
    for backend in available_backends():
        assert str(backend) in message
    assert f"echo ({ECHO})" in message
    assert "Did you mean 'echo'?" in message


def test_an_entry_point_that_fails_to_import_names_itself_its_distribution_and_the_cause() -> None:
    with pytest.raises(BackendImportError) as info:
        get_backend_spec("broken")
    message = str(info.value)
    assert "entry point 'broken = verl_remote_broken_backend.needs_missing_dep:SPEC'" in message
    assert f"from {BROKEN}" in message
    assert "ModuleNotFoundError: No module named 'verl_remote_no_such_dependency'" in message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    # Loading a class goes through the spec and fails the same way.
    with pytest.raises(BackendImportError, match="verl_remote_no_such_dependency"):
        load_backend_class("broken")


def test_two_distributions_claiming_one_name_are_both_named() -> None:
    with pytest.raises(DuplicateBackendError) as info:
        get_backend_spec("twin")
    message = str(info.value)
    assert "backend 'twin' is registered by 2 distributions" in message
    assert f"{BROKEN} ('twin = verl_remote_broken_backend:TWIN_SPEC')" in message
    assert f"{ECHO} ('twin = verl_remote_echo_backend:TWIN_SPEC')" in message
    assert "Uninstall all but one" in message


def test_a_spec_named_differently_from_its_entry_point_is_rejected() -> None:
    with pytest.raises(
        BackendImportError,
        match="resolves to a BackendSpec named 'other'; the entry point name and BackendSpec.name must be equal",
    ):
        get_backend_spec("mismatch")


def test_an_entry_point_that_is_not_a_spec_is_rejected() -> None:
    with pytest.raises(BackendImportError, match="resolves to builtins.dict, not a verl_remote.BackendSpec"):
        get_backend_spec("notaspec")


def test_a_class_that_cannot_be_imported_names_backend_distribution_and_role() -> None:
    assert get_backend_spec("badclass").name == "badclass"  # the spec itself is fine
    with pytest.raises(BackendImportError) as info:
        load_worker_class("badclass")
    assert str(info.value).startswith(f"backend 'badclass' ({BROKEN}): worker class cannot import")
    assert "has no attribute 'NoSuchWorker'" in str(info.value)
    assert load_backend_class("badclass").__name__ == "Backend"


def test_a_backend_class_must_subclass_remote_backend() -> None:
    with pytest.raises(
        BackendImportError,
        match="'verl_remote_broken_backend.classes:Worker' is not a subclass of verl_remote.kit.backend.RemoteBackend",
    ):
        load_backend_class("notremote")


def test_the_public_api_is_what_the_package_exports() -> None:
    import verl_remote

    assert sorted(verl_remote.__all__) == sorted([*verl_remote._EXPORTS, "__version__"])
    for name in verl_remote.__all__:
        assert getattr(verl_remote, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        verl_remote.nope  # noqa: B018
