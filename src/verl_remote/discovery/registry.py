"""Find backends through the ``verl.remote_backends`` entry-point group.

Installing a wheel that declares::

    [project.entry-points."verl.remote_backends"]
    arctic = "verl_arctic:SPEC"

is all it takes for ``arctic`` to resolve by name in any process that uses this
environment: the CLI, verl's driver and TaskRunner, and every Ray worker. Nothing
is imported until asked for, nothing is cached that could go stale, and every
failure names the entry point and the distribution that shipped it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from verl_remote.kit.errors import BackendImportError, BackendNotFoundError, DuplicateBackendError, one_line
from verl_remote.kit.spec import BackendSpec, SpecError, import_string

if TYPE_CHECKING:
    from verl_remote.kit.backend import RemoteBackend

__all__ = [
    "ENTRY_POINT_GROUP",
    "InstalledBackend",
    "available_backends",
    "get_backend_spec",
    "installed_backend",
    "load_backend_class",
    "load_rollout_class",
    "load_worker_class",
    "resolve_class",
]

ENTRY_POINT_GROUP = "verl.remote_backends"


@dataclass(frozen=True)
class InstalledBackend:
    """One registration in the entry-point group, before anything is imported."""

    name: str
    target: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"

    @property
    def entry_point(self) -> str:
        return f"{self.name} = {self.target}"

    def load_spec(self) -> BackendSpec:
        """Import the entry point and check that it is this backend's spec."""
        where = (
            f"entry point '{self.entry_point}' in group '{ENTRY_POINT_GROUP}' from {self.distribution} {self.version}"
        )
        ep = EntryPoint(name=self.name, value=self.target, group=ENTRY_POINT_GROUP)
        try:
            spec = ep.load()
        except Exception as exc:
            raise BackendImportError(
                f"backend '{self.name}': {where} failed to import: {one_line(exc)}. "
                f"Reinstall or upgrade {self.distribution}, or uninstall it if you do not use it."
            ) from exc
        if not isinstance(spec, BackendSpec):
            raise BackendImportError(
                f"backend '{self.name}': {where} resolves to {type(spec).__module__}.{type(spec).__qualname__}, "
                "not a verl_remote.BackendSpec. This is a bug in that distribution."
            )
        if spec.name != self.name:
            raise BackendImportError(
                f"backend '{self.name}': {where} resolves to a BackendSpec named '{spec.name}'; "
                "the entry point name and BackendSpec.name must be equal. This is a bug in that distribution."
            )
        return spec


def _describe_dist(ep: EntryPoint) -> tuple[str, str]:
    dist = ep.dist
    if dist is None:  # entry points built by hand, never from an installed distribution
        return "<unknown distribution>", "?"
    return dist.metadata["Name"] or dist.name, dist.version


def available_backends() -> list[InstalledBackend]:
    """Every registration in ``verl.remote_backends``, sorted by name; imports nothing.

    A name registered by two distributions appears twice here;
    :func:`get_backend_spec` refuses to pick one.
    """
    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        distribution, version = _describe_dist(ep)
        found.append(InstalledBackend(name=ep.name, target=ep.value, distribution=distribution, version=version))
    return sorted(found, key=lambda b: (b.name, b.distribution))


def installed_backend(name: str) -> InstalledBackend:
    """The single registration of ``name``, with the errors a user can act on."""
    installed = available_backends()
    matches = [b for b in installed if b.name == name]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        listing = ", ".join(str(b) for b in installed) or "none"
        hint = difflib.get_close_matches(name, sorted({b.name for b in installed}), n=1)
        did_you_mean = f" Did you mean '{hint[0]}'?" if hint else ""
        raise BackendNotFoundError(
            f"backend '{name}' is not installed; installed: {listing}.{did_you_mean} "
            "Install the distribution that provides it (pip install ...), then run 'verl-remote list'."
        )
    claims = " and ".join(f"{b.distribution} {b.version} ('{b.entry_point}')" for b in matches)
    raise DuplicateBackendError(
        f"backend '{name}' is registered by {len(matches)} distributions: {claims}. "
        "Uninstall all but one of them (pip uninstall ...)."
    )


def get_backend_spec(name: str) -> BackendSpec:
    """Load the :class:`BackendSpec` registered as ``name``."""
    return installed_backend(name).load_spec()


def resolve_class(installed: InstalledBackend, spec: BackendSpec, role: str) -> type[Any]:
    """Import the ``backend``, ``worker`` or ``rollout`` class of a spec already loaded from ``installed``.

    The backend class must subclass :class:`~verl_remote.RemoteBackend`.
    """
    from verl_remote.kit.backend import RemoteBackend

    base: type[Any] = RemoteBackend if role == "backend" else object
    target: str = getattr(spec, role)
    where = f"backend '{installed.name}' ({installed.distribution} {installed.version})"
    try:
        obj = import_string(target)
    except SpecError as exc:
        raise BackendImportError(f"{where}: {role} class {exc}") from exc.__cause__
    if not isinstance(obj, type):
        raise BackendImportError(f"{where}: {role} {target!r} is a {type(obj).__name__}, not a class")
    if not issubclass(obj, base):
        raise BackendImportError(f"{where}: {target!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return obj


def _load_class(name: str, role: str) -> type[Any]:
    installed = installed_backend(name)
    return resolve_class(installed, installed.load_spec(), role)


def load_backend_class(name: str) -> type[RemoteBackend]:
    """Import the backend's :class:`~verl_remote.RemoteBackend` subclass."""
    cls: type[RemoteBackend] = _load_class(name, "backend")
    return cls


def load_worker_class(name: str) -> type[Any]:
    """Import the backend's forwarder worker class."""
    return _load_class(name, "worker")


def load_rollout_class(name: str) -> type[Any]:
    """Import the backend's rollout replica class."""
    return _load_class(name, "rollout")
