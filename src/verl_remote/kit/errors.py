"""Errors a user can act on, in one place for every room. Each message says what is wrong and what to do."""

from __future__ import annotations

__all__ = [
    "HEADER_REFUSED",
    "BackendError",
    "BackendImportError",
    "BackendNotFoundError",
    "ConfigError",
    "DuplicateBackendError",
    "ServiceStartError",
    "SpecError",
    "UnsupportedVerlError",
    "header_refused",
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
    """A backend's service failed to start; the message ends with its exception, as ``Type: message``.

    Never a transient fault (:func:`verl_remote.is_transient`): a service that did not start, or did not start in
    its time, would do the same after a restart."""

    transient = False


def root_cause(exc: BaseException) -> BaseException:
    """The exception a Ray task error stands for: Ray wraps what the remote call raised in ``cause`` (a
    ``RayTaskError`` of a ``RayTaskError`` when calls nest); anything else is itself."""
    while isinstance(getattr(exc, "cause", None), BaseException) and exc.cause is not exc:  # type: ignore[attr-defined]
        exc = exc.cause  # type: ignore[attr-defined]
    return exc


#: What an HTTP client's refusal of a header value says instead of its own message, which quotes the header (a
#: bearer token included).
HEADER_REFUSED = (
    "the request was not sent: the HTTP client refused one of its header values (not shown, as a header may carry "
    "a credential); check the token the settings point at"
)


def header_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised from, an HTTP client's refusal of a header value as it wrote the request
    (httpx's, httpcore's or h11's ``LocalProtocolError``): its message quotes the header it refused."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if type(current).__name__ == "LocalProtocolError":
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def one_line(exc: BaseException) -> str:
    """An exception as one line for a person: ``Type: message``, whitespace folded (the type alone when there is
    no message). A Ray task error stands for its innermost cause (:func:`root_cause`); a message that is a
    traceback stands for its last line, the error itself. An HTTP client's refusal of a header value is never
    quoted (:data:`HEADER_REFUSED`): its message holds the header, a token included."""
    exc = root_cause(exc)
    if header_refused(exc):
        return f"{type(exc).__name__}: {HEADER_REFUSED}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        lines = lines[-1:]
    text = " ".join(" ".join(lines).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
