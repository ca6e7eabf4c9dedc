"""Which failures are worth another try: a fault of the moment (a lost connection, a load balancer's 502, a
service that restarted) or one that happens again whatever is tried (a refused request, a bug, a bad config).

``verl-remote train`` restarts a run from its last checkpoint after a transient fault and retries a sampling
request after one (docs/reliability.md); everything else stops the run at once. A backend says which of its
errors are transient by giving them a ``transient`` attribute, or a ``status`` (the service's HTTP status);
what it does not classify is judged by its type (a lost connection, a timeout). Free of verl and of any HTTP
library: an error is recognised by its type's name where the library may not be installed.
"""

from __future__ import annotations

import asyncio

__all__ = ["TRANSIENT_STATUS", "is_transient", "transient_status"]

#: HTTP statuses that say "not now" rather than "never": a request timeout, a rate limit, a gateway that could
#: not reach the service, a service unavailable for a moment, a gateway timeout. Every other 4xx is a refusal
#: that would be repeated; a 500 is the service's own error (a bug, a bad batch), not a passing state.
TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})

#: Errors of HTTP clients that mean the request got no answer (httpx's TransportError family, the tinker SDK's
#: and OpenAI-style SDKs' connection and timeout errors, aiohttp's), by class name along the type's bases.
_NO_ANSWER = frozenset(
    {
        "TransportError",  # httpx: ConnectError, ReadError, RemoteProtocolError, timeouts, ...
        "TimeoutException",  # httpx
        "APIConnectionError",  # tinker, openai (APITimeoutError is one)
        "APITimeoutError",
        "ClientConnectionError",  # aiohttp
        "ServerTimeoutError",  # aiohttp
    }
)


def transient_status(status: int | None) -> bool:
    """Whether an HTTP answer with ``status`` is worth another try (:data:`TRANSIENT_STATUS`)."""
    return status is not None and int(status) in TRANSIENT_STATUS


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it stands for or comes from: Ray's ``cause`` (a remote call's own error), then
    ``__cause__`` and ``__context__``; each once, outermost first."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop(0)
        if any(current is known for known in seen):
            continue
        seen.append(current)
        for nxt in (getattr(current, "cause", None), current.__cause__, current.__context__):
            if isinstance(nxt, BaseException):
                todo.append(nxt)
    return seen


def _own_word(exc: BaseException) -> bool | None:
    """What ``exc`` says of itself: its ``transient`` attribute, else its ``status`` or ``status_code``; None."""
    said = getattr(exc, "transient", None)
    if isinstance(said, bool):
        return said
    for name in ("status", "status_code"):
        status = getattr(exc, name, None)
        if isinstance(status, int) and not isinstance(status, bool) and 100 <= status < 600:
            return transient_status(status)
    return None


def _by_type(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True  # refused, reset, aborted, a broken pipe; a timeout
    return any(base.__name__ in _NO_ANSWER for base in type(exc).__mro__)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a fault of the moment, worth a retry or a restart from the last checkpoint.

    The first error along the chain (:func:`_causes`, outermost first) that says so itself decides: a
    ``transient`` attribute, else an HTTP ``status`` (:data:`TRANSIENT_STATUS`). Where none does, a lost
    connection or a timeout anywhere in the chain is transient; anything else is not.
    """
    chain = _causes(exc)
    for error in chain:
        said = _own_word(error)
        if said is not None:
            return said
    return any(_by_type(error) for error in chain)
