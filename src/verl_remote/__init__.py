"""verl-remote: run verl's RL loop against a training and sampling service of your own.

The public API is importable from here and cheap to import: nothing below pulls
in verl, torch or Ray. See ``docs/backend-author-guide.md`` for how to publish a
backend.
"""

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

__version__ = "0.1.0"

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
