"""Errors a user can act on, in one place for every room. Each message says what is wrong and what to do."""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendImportError",
    "BackendNotFoundError",
    "ConfigError",
    "DuplicateBackendError",
    "ServiceStartError",
    "SpecError",
    "UnsupportedVerlError",
    "one_line",
    "root_cause",
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


class SpecError(BackendImportError, ValueError):
    """A spec, or one of the objects it names, is malformed or cannot be imported."""


class ConfigError(ValueError):
    """The overrides or the recipe do not compose into a config, or the config cannot run (exit 2)."""


class UnsupportedVerlError(RuntimeError):
    """The installed verl is missing, outside the tested range, or lacks what verl-remote relies on (exit 2)."""


class ServiceStartError(RuntimeError):
    """A backend's service failed to start; the message ends with its exception, as ``Type: message``."""


def root_cause(exc: BaseException) -> BaseException:
    """The exception a Ray task error stands for: Ray wraps what the remote call raised in ``cause`` (a
    ``RayTaskError`` of a ``RayTaskError`` when calls nest); anything else is itself."""
    while isinstance(getattr(exc, "cause", None), BaseException) and exc.cause is not exc:  # type: ignore[attr-defined]
        exc = exc.cause  # type: ignore[attr-defined]
    return exc


def one_line(exc: BaseException) -> str:
    """An exception as one line for a person: ``Type: message``, whitespace folded (the type alone when there is
    no message). A Ray task error stands for its innermost cause (:func:`root_cause`); a message that is a
    traceback stands for its last line, the error itself."""
    exc = root_cause(exc)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        lines = lines[-1:]
    text = " ".join(" ".join(lines).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
