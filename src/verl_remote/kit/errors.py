"""Errors a user can act on. Each message says what is wrong and what to do."""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendImportError",
    "BackendNotFoundError",
    "DuplicateBackendError",
    "one_line",
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


def one_line(exc: BaseException) -> str:
    """An exception as one line for a person: ``Type: message``, whitespace folded (the type alone when there is
    no message). A Ray task error stands for its innermost cause (Ray wraps the remote exception in ``cause``);
    a message that is a traceback stands for its last line, the error itself."""
    while isinstance(getattr(exc, "cause", None), BaseException) and exc.cause is not exc:  # type: ignore[attr-defined]
        exc = exc.cause  # type: ignore[attr-defined]
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        lines = lines[-1:]
    text = " ".join(" ".join(lines).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
