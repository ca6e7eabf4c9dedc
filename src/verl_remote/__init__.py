"""verl-remote: run verl's RL loop against a training and sampling service of your own.

The public API is importable from here. Names are loaded on first use (PEP 562),
because verl imports ``verl_remote.verl_plugin`` in every process at the end of
``import verl``, and that import must stay cheap: importing this package itself
costs almost nothing. See ``docs/backend-author-guide.md`` for how to publish a
backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "RemoteBackend": "verl_remote.backend",
    "BackendSpec": "verl_remote.spec",
    "SpecError": "verl_remote.spec",
    "BackendError": "verl_remote.errors",
    "BackendImportError": "verl_remote.errors",
    "BackendNotFoundError": "verl_remote.errors",
    "DuplicateBackendError": "verl_remote.errors",
    "ENTRY_POINT_GROUP": "verl_remote.registry",
    "InstalledBackend": "verl_remote.registry",
    "available_backends": "verl_remote.registry",
    "get_backend_spec": "verl_remote.registry",
    "load_backend_class": "verl_remote.registry",
    "load_rollout_class": "verl_remote.registry",
    "load_worker_class": "verl_remote.registry",
}

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendError",
    "BackendImportError",
    "BackendNotFoundError",
    "BackendSpec",
    "DuplicateBackendError",
    "InstalledBackend",
    "RemoteBackend",
    "SpecError",
    "__version__",
    "available_backends",
    "get_backend_spec",
    "load_backend_class",
    "load_rollout_class",
    "load_worker_class",
]

if TYPE_CHECKING:
    from verl_remote.backend import RemoteBackend
    from verl_remote.errors import BackendError, BackendImportError, BackendNotFoundError, DuplicateBackendError
    from verl_remote.registry import (
        ENTRY_POINT_GROUP,
        InstalledBackend,
        available_backends,
        get_backend_spec,
        load_backend_class,
        load_rollout_class,
        load_worker_class,
    )
    from verl_remote.spec import BackendSpec, SpecError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'verl_remote' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
