"""What a ``verl.remote_backends`` entry point resolves to.

A :class:`BackendSpec` names a backend's classes and its Hydra config package as
import strings, so that publishing one, discovering it and reading it import
nothing heavy: the driver, the Hydra plugin and every Ray worker can look at
every installed backend without paying for (or being broken by) its code.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from verl_remote.kit.errors import SpecError, one_line

__all__ = ["BackendSpec", "SpecError", "import_string"]

# A backend name is a Hydra group option and a CLI word: keep it to safe characters.
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_IMPORT_STRING = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$")


def import_string(target: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute.

    Raises :class:`SpecError` naming the string and the original exception, which
    is chained, so that the user sees which backend class failed and why.
    """
    if not _IMPORT_STRING.match(target):
        raise SpecError(f"{target!r} is not an import string of the form 'package.module:attr'")
    module_name, _, attr_path = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise SpecError(f"cannot import {target!r}: {one_line(exc)}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise SpecError(f"cannot import {target!r}: module {module_name!r} has no attribute {attr_path!r}") from exc
    return obj


@dataclass(frozen=True)
class BackendSpec:
    """Everything verl-remote needs to know to use a backend, as import strings.

    Attributes:
        name: the backend's name, as in ``remote_backend=<name>``; must equal the
            entry point's name.
        backend: ``"module:Class"`` of the :class:`~verl_remote.RemoteBackend` subclass.
        worker: ``"module:Class"`` of the forwarder worker that verl's trainer drives.
        rollout: ``"module:Class"`` of the rollout replica that answers generation.
        config_package: importable package that holds ``remote_backend/<name>.yaml``;
            it is added to Hydra's search path as ``pkg://<config_package>``.
    """

    name: str
    backend: str
    worker: str
    rollout: str
    config_package: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise SpecError(
                f"backend name {self.name!r} is invalid: use a letter followed by letters, digits, '_' or '-'"
            )
        for field in ("backend", "worker", "rollout"):
            value = getattr(self, field)
            if not isinstance(value, str) or not _IMPORT_STRING.match(value):
                raise SpecError(
                    f"backend {self.name!r}: {field}={value!r} is not an import string "
                    "of the form 'package.module:Class'"
                )
        if not isinstance(self.config_package, str) or not _MODULE.match(self.config_package):
            raise SpecError(
                f"backend {self.name!r}: config_package={self.config_package!r} is not a dotted package name"
            )

    @property
    def search_path(self) -> str:
        """The Hydra search path entry for this backend's config group."""
        return f"pkg://{self.config_package}"

    @property
    def config_file(self) -> str:
        """The group file's path inside :attr:`config_package`."""
        return f"remote_backend/{self.name}.yaml"
