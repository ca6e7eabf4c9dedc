from __future__ import annotations

import dataclasses

import pytest

from verl_remote import BackendSpec, SpecError
from verl_remote.kit.spec import import_string

GOOD = dict(
    name="svc",
    backend="pkg.backend:Backend",
    worker="pkg.worker:Worker",
    rollout="pkg.rollout:Replica",
    config_package="pkg",
)


def test_spec_is_frozen_and_describes_its_config_group() -> None:
    spec = BackendSpec(**GOOD)
    assert spec.search_path == "pkg://pkg"
    assert spec.config_file == "remote_backend/svc.yaml"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


def test_constructing_a_spec_imports_nothing() -> None:
    # The named modules do not exist: a spec only holds strings.
    BackendSpec(**{**GOOD, "backend": "no_such_module_xyz:Backend"})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", "", "backend name '' is invalid"),
        ("name", "has space", "backend name 'has space' is invalid"),
        ("name", "9lives", "is invalid"),
        ("backend", "pkg.backend.Backend", "backend='pkg.backend.Backend' is not an import string"),
        ("worker", "pkg.worker:", "worker='pkg.worker:' is not an import string"),
        ("rollout", None, "rollout=None is not an import string"),
        ("config_package", "pkg/config", "config_package='pkg/config' is not a dotted package name"),
    ],
)
def test_malformed_specs_are_rejected_with_the_field_named(field: str, value: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        BackendSpec(**{**GOOD, field: value})


def test_import_string_resolves_nested_attributes() -> None:
    assert import_string("os.path:join") is __import__("os").path.join
    assert import_string("verl_remote.kit.spec:BackendSpec.search_path") is BackendSpec.search_path


def test_import_string_errors_name_the_target_and_chain_the_cause() -> None:
    with pytest.raises(SpecError, match="cannot import 'no_such_module_xyz:X': ModuleNotFoundError") as info:
        import_string("no_such_module_xyz:X")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    with pytest.raises(SpecError, match="module 'os' has no attribute 'nope'"):
        import_string("os:nope")
