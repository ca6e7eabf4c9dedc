"""Errors a user can act on. Each message says what is wrong and what to do."""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendImportError",
    "BackendNotFoundError",
    "DuplicateBackendError",
]


class BackendError(Exception):
    """Base class of every error about finding or loading a backend."""


class BackendNotFoundError(BackendError, LookupError):
    """No installed distribution registers a backend under the requested name."""


class DuplicateBackendError(BackendError):
    """Two or more installed distributions register the same backend name."""


class BackendImportError(BackendError, ImportError):
    """A backend's entry point, spec or class failed to import or is malformed.

    The original exception, when there is one, is chained as ``__cause__``.
    """
