"""The tinker SDK as the session calls it, across the range the distribution allows (``tinker>=0.25,<0.39``).

Between 0.25 and 0.38 the SDK changed how a call is made, not what it sends:

- 0.25's ``ServiceClient`` passes ``timeout`` and ``max_retries`` on to its HTTP client; 0.38's takes neither
  (it warns and ignores them) and retries by its own rules;
- 0.38 deprecates every ``*_async`` call: the plain call returns a future that can be awaited, and creating a
  client returns a future of the client (0.25's plain creating calls block instead);
- 0.38 has no call to unload a model (0.25 has one only on its internal HTTP client); the API still has the
  route (``/api/v1/unload_model``), which both SDKs' HTTP client can post to;
- 0.38's ``ServiceClient.close(status)`` finishes the session on the service; 0.25 closes only its clients.

Each helper here decides by what the installed SDK offers, not by its version number, so that the versions in
between take whichever form they have. The tests run the session with 0.25.0 (the tests' environment) and with
the newest SDK in the range (tests/test_fresh_venv.py installs it as a user would).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "PauseReporter",
    "capabilities",
    "created",
    "finish",
    "requested",
    "resolved",
    "saving_for_sampling",
    "service_client",
    "submitted",
    "unload",
    "version",
]

log = logging.getLogger(__name__)


def version() -> str:
    import tinker

    return str(getattr(tinker, "__version__", "unknown"))


def service_client(base_url: str, api_key: str, timeout_s: float, max_retries: int) -> Any:
    """A ServiceClient for ``base_url``; the HTTP client's timeout and retries where the SDK still takes them."""
    import tinker

    if "base_url" in inspect.signature(tinker.ServiceClient.__init__).parameters:  # 0.38's named arguments
        return tinker.ServiceClient(base_url=base_url, api_key=api_key)
    return tinker.ServiceClient(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=max_retries)


def _current(obj: Any, name: str) -> Callable[..., Any] | None:
    """``obj.<name>_async`` where the SDK offers it and has not deprecated it (0.25), else None."""
    variant = getattr(obj, f"{name}_async", None)
    if variant is None or getattr(variant, "__deprecated__", None):
        return None
    return variant  # type: ignore[no-any-return]


async def resolved(value: Any) -> Any:
    """The result behind what an SDK call returned: a future of either SDK, an awaitable or the value itself."""
    if hasattr(value, "result_async"):
        return await value.result_async()
    if isinstance(value, concurrent.futures.Future):
        return await asyncio.wrap_future(value)
    if inspect.isawaitable(value):
        return await value
    return value


async def submitted(obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """Submit a request and return its future without waiting for the result (``resolved`` gets it)."""
    variant = _current(obj, name)
    if variant is not None:
        return await variant(*args, **kwargs)  # 0.25: the awaited submission is the future (or the result)
    return getattr(obj, name)(*args, **kwargs)  # newer: the call returns the future at once


async def requested(obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """Make a request and wait for its result."""
    return await resolved(await submitted(obj, name, *args, **kwargs))


async def created(obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """A client made by ``obj.<name>`` (0.25 blocks in the call, newer SDKs return a future of the client)."""
    variant = _current(obj, name)
    if variant is not None:
        return await resolved(await variant(*args, **kwargs))
    return await resolved(await asyncio.to_thread(getattr(obj, name), *args, **kwargs))


async def saving_for_sampling(training: Any) -> asyncio.Future[Any]:
    """Start ``training.save_weights_and_get_sampling_client()``; return, once the save has its place in the
    training client's request order, a future of the sampler.

    Every SDK in the range numbers a training client's requests as they are called (``_get_request_id`` in the
    plain call, 0.25.0 ``training_client.py:779``, 0.38.0 :1082) and the service runs them in that order, so a
    request made after this returns runs after the save: an optimizer step cannot change the weights before the
    save has read them, while a forward pass sent meanwhile need not wait for the save's answer. 0.38's plain
    call returns a future at once; 0.25's blocks until the sampler exists (its ``_async`` variant too, with a
    blocking ``.result()``, 0.25.0 :1008, which would hold the caller's event loop), so it runs in a thread, and
    its place is taken when the thread's call numbers the request (the client's request counter moves). An SDK
    without that counter is waited on until the save is done.
    """
    loop = asyncio.get_running_loop()
    if _current(training, "save_weights_and_get_sampling_client") is None:  # 0.38: numbered in the call
        return asyncio.ensure_future(resolved(training.save_weights_and_get_sampling_client()))
    counter = getattr(training, "_request_id_counter", None)
    future = loop.run_in_executor(None, training.save_weights_and_get_sampling_client)
    if not isinstance(counter, int):
        await asyncio.wait([future])
        return future
    while getattr(training, "_request_id_counter", counter) == counter and not future.done():
        await asyncio.sleep(0.001)
    return future


async def capabilities(service: Any, base_url: str, api_key: str) -> Any:
    """The service's models: 0.25 asks through the service client, newer SDKs through a REST client of their own."""
    import tinker

    variant = _current(service, "get_server_capabilities")
    if variant is not None:
        return await variant()
    rest = await asyncio.to_thread(tinker.RestClient, base_url=base_url, api_key=api_key)  # it asks for its config
    return await resolved(rest.get_server_capabilities())


async def unload(service: Any, model_id: str) -> None:
    """Unload a model: the API's ``unload_model`` request, sent through the SDK's own HTTP client and awaited as
    the SDK awaits any request (no SDK in the range has a public call for it)."""
    from tinker import types
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.types.shared import UntypedAPIFuture

    holder = service.holder

    async def request() -> Any:
        start = time.time()
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            future = await client.post(
                "/api/v1/unload_model", body={"model_id": model_id, "type": "unload_model"}, cast_to=UntypedAPIFuture
            )
        return await _APIFuture(types.UnloadModelResponse, holder, future, start, "UnloadModel").result_async()

    await resolved(holder.run_coroutine_threadsafe(request()))


async def finish(service: Any) -> None:
    """End the session: 0.38 finishes it on the service (``close(status)``); 0.25 closes the SDK's clients."""
    import tinker

    close = getattr(service, "close", None)
    if close is None or "status" not in inspect.signature(close).parameters:
        service.holder.close()
        return
    try:
        await resolved(close("success"))
    except tinker.NotFoundError:  # a service without sessions to finish (SkyRL 0.4.0): nothing to end
        log.debug("the service has no route to finish a session")


class PauseReporter:
    """One log line when the service pauses a request of the run, which the SDK then waits out on its own.

    A Tinker service pauses a request in two ways the SDK retries (so nothing here retries again):

    - it answers the request with HTTP 429, which the SDK's HTTP client retries with backoff, honouring
      ``Retry-After`` (``tinker/_base_client.py``: ``_should_retry``, ``_calculate_retry_timeout``; 0.25.0
      :707-741 and :683-705, 0.38.0 :711-745 and :687-709), logging each response at DEBUG (0.25.0 :1030, 0.38.0
      :1053);
    - it answers a result's poll with a queue state (``paused_rate_limit``: "concurrent LoRA rate limit",
      ``paused_capacity``), which the SDK polls on and hands to the client's queue-state observer
      (``tinker/lib/api_future_impl.py``; 0.38.0 :381-395 for HTTP 408 with the state in its body, :487-492 for
      a ``try_again`` answer). The SDK's own observer logs a pause after a minute (0.25) or 15 minutes (0.38).

    The reporter says, once per pause, what is paused and why, and that the run waits at most
    ``remote_backend.timeout_s`` per call; a pause ends with the next answer to the same route (429) or the same
    client (queue state) that is not a pause.
    """

    def __init__(self, base_url: str, timeout_s: float, say: Callable[[str], None] | None = None) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.say = say or (lambda line: log.warning("%s", line))
        self.paused: dict[str, float] = {}  # what -> when the pause began

    def _begin(self, what: str, why: str) -> None:
        if what in self.paused:
            return
        self.paused[what] = time.monotonic()
        self.say(
            f"verl-remote-tinker: the service at {self.base_url} paused {what} ({why}); the SDK waits and "
            f"retries, the run waits at most remote_backend.timeout_s={self.timeout_s:g} s per call"
        )

    def _end(self, what: str) -> None:
        began = self.paused.pop(what, None)
        if began is not None:
            log.info("verl-remote-tinker: %s resumed after %.1f s", what, time.monotonic() - began)

    def queue_state(self, what: str, state: Any, reason: str | None) -> None:
        name = str(getattr(state, "value", state)).lower()
        if "paused" in name:
            self._begin(what, reason or name.replace("queuestate.", ""))
        elif "active" in name:
            self._end(what)

    def watch(self, client: Any, what: str) -> None:
        """Report the queue states the SDK hands ``client``'s observer (a sampling client is its own observer;
        a training client has one per model). A client without either is left as it is."""
        observer = getattr(client, "_queue_state_logger", client)
        original = getattr(observer, "on_queue_state_change", None)
        if original is None:
            return

        def observed(queue_state: Any, queue_state_reason: str | None = None) -> None:
            self.queue_state(what, queue_state, queue_state_reason)
            original(queue_state, queue_state_reason)

        observer.on_queue_state_change = observed

    def install(self) -> None:
        """Watch the SDK's HTTP answers for 429 (at DEBUG, on a logger of its own that passes nothing else on)."""
        logger = logging.getLogger("tinker._base_client")
        for handler in logger.handlers:
            if isinstance(handler, _Answers):  # a later session of the same process: the answers are its now
                handler.reporter = self
                return
        logger.addHandler(_Answers(self))
        logger.setLevel(logging.DEBUG)
        logger.propagate = False

    def answered(self, url: str, status: int, headers: Any) -> None:
        route = url.split("?", 1)[0].rsplit("/", 1)[-1]
        if status == 429:
            after = headers.get("retry-after") if hasattr(headers, "get") else None
            self._begin(f"requests ({route})", "HTTP 429, rate limit" + (f"; Retry-After {after} s" if after else ""))
        elif 200 <= status < 300:
            self._end(f"requests ({route})")


class _Answers(logging.Handler):
    """The SDK's DEBUG line for every HTTP answer (``HTTP Response: %s %s "%i %s" %s``) to the reporter; its
    other records above DEBUG to the SDK's parent logger, as they went before."""

    def __init__(self, reporter: PauseReporter) -> None:
        super().__init__(logging.DEBUG)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == 'HTTP Response: %s %s "%i %s" %s' and isinstance(record.args, tuple):
            _method, url, status, _reason, headers = record.args
            if isinstance(status, int):
                self.reporter.answered(str(url), status, headers)
        elif record.levelno > logging.DEBUG:
            logging.getLogger("tinker").handle(record)
