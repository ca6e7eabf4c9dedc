"""An HTTP client for Arctic's RL service, for either protocol generation.

One method per protocol call, each raising :class:`ArcticError` with the call,
the URL and the server's own message when anything goes wrong, so that a
failed training step says which request failed where. Only idempotent calls
(health, status, job) are retried. An auth token, when configured, is sent as
``Authorization: Bearer ...`` and never logged or put in an error.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx

from verl_arctic import wire
from verl_arctic.routes import ENCODING, GENERATIONS, Route, route
from verl_remote import transient_status

__all__ = [
    "ANSWER_CAP_BYTES",
    "ArcticClient",
    "ArcticError",
    "aread_capped",
    "describe_answer",
    "probe_generation",
    "read_capped",
]


class ArcticError(RuntimeError):
    """An Arctic call failed; the message names the call, the server and the reason.

    ``transient``: whether another try may succeed (``verl-remote train`` then restarts the run from its last
    checkpoint, and a sampling request is retried; verl_remote.kit.faults): no answer at all, an HTTP status of
    the moment (502, 503, 504, 429, 408), or a job the server no longer has (it restarted). By default, what the
    status says.
    """

    def __init__(self, message: str, *, status: int | None = None, transient: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.transient = transient_status(status) if transient is None else transient


def describe_answer(response: httpx.Response) -> str:
    """The server's own message: FastAPI's ``detail``, a text body's first line, or what a binary body is."""
    kind = response.headers.get("content-type", "").split(";")[0].strip() or "no content type"
    try:
        body = response.json()
    except ValueError:
        try:
            text = response.content.decode("utf-8")
        except UnicodeDecodeError:
            return f"{len(response.content)} bytes of {kind}, not Arctic's JSON"
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            return response.reason_phrase
        first = lines[0] if len(lines[0]) <= 200 else lines[0][:200] + "..."
        return first if kind == "text/plain" else f"{first} ({kind}, not Arctic's JSON)"
    detail = body.get("detail", body) if isinstance(body, dict) else body
    return detail if isinstance(detail, str) else str(detail)


#: The most of an answer's body read to describe it (an error, a probe): whatever answers at a wrong URL (a proxy's
#: page, a file server, a stream that never ends) costs at most this much memory and time.
ANSWER_CAP_BYTES = 1 << 20


def _described(response: httpx.Response, head: bytes) -> httpx.Response:
    """A response to describe: ``response``'s status and content type with ``head``, the start of its body."""
    kind = {"content-type": response.headers["content-type"]} if "content-type" in response.headers else {}
    return httpx.Response(response.status_code, headers=kind, content=head, request=response.request)


def read_capped(response: httpx.Response, cap: int = ANSWER_CAP_BYTES) -> httpx.Response:
    """A streamed, unread ``response`` with at most ``cap`` bytes of its body read (see :func:`_described`)."""
    head = bytearray()
    for chunk in response.iter_bytes():
        head += chunk
        if len(head) >= cap:
            break
    return _described(response, bytes(head[:cap]))


async def aread_capped(response: httpx.Response, cap: int = ANSWER_CAP_BYTES) -> httpx.Response:
    """:func:`read_capped` for a response of an ``AsyncClient``."""
    head = bytearray()
    async for chunk in response.aiter_bytes():
        head += chunk
        if len(head) >= cap:
            break
    return _described(response, bytes(head[:cap]))


def _reason(exc: httpx.HTTPError) -> str:
    """What an HTTP error says, but for a header value httpx refused as it wrote the request: its message quotes the
    header, which may be the bearer token (a token file with a line break inside), so it is never shown."""
    if isinstance(exc, httpx.LocalProtocolError):
        return "the request was not sent: httpx refused a header value (not shown: it may carry the token)"
    return str(exc)


def _get_capped(url: str, *, timeout: float, headers: dict[str, str] | None) -> httpx.Response:
    with httpx.stream("GET", url, timeout=timeout, headers=headers) as response:
        return read_capped(response)


def probe_health(url: str, *, timeout: float = 10.0, headers: dict[str, str] | None = None) -> None:
    """The server at ``url`` answers Arctic's ``GET /health`` with ``{"status": "OK"}`` and takes the credentials;
    ``ArcticError`` naming the setting to change otherwise."""
    base = url.rstrip("/")
    try:
        response = _get_capped(f"{base}/health", timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        raise ArcticError(
            f"remote_backend.comms.url={base}: nothing answers there ({_reason(exc)}); start Arctic's RL server at "
            "that address, or set remote_backend.comms.url to where it runs (remote_backend.comms.launch starts one "
            "for the run)"
        ) from exc
    if response.status_code in (401, 403):
        raise ArcticError(
            f"remote_backend.comms.url={base}: the server refused the credentials (HTTP {response.status_code}); "
            "set remote_backend.comms.token_env to the environment variable holding a valid token",
            status=response.status_code,
        )
    try:
        healthy = response.json() == {"status": "OK"}
    except ValueError:
        healthy = False
    if not healthy:
        raise ArcticError(
            f"remote_backend.comms.url={base}: GET /health answered HTTP {response.status_code} with "
            f"{describe_answer(response)}, not Arctic's {{'status': 'OK'}}; is an Arctic RL server at that address?",
            status=response.status_code,
        )


def probe_generation(url: str, *, timeout: float = 10.0, headers: dict[str, str] | None = None) -> str:
    """Which protocol generation the server at ``url`` speaks, without side effects.

    ``GET /forward-backward`` is 405 on main (the route exists, for POST) and 404
    on v0.1; ``/health`` is identical in both and cannot tell them apart.
    """
    base = url.rstrip("/")
    try:
        response = _get_capped(f"{base}/forward-backward", timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        raise ArcticError(f"cannot reach the Arctic server at {base} to detect its protocol: {_reason(exc)}") from exc
    if response.status_code == 405:
        return "main"
    if response.status_code == 404:
        return "v0.1"
    raise ArcticError(
        f"the server at {base} answered GET /forward-backward with HTTP {response.status_code}; "
        "it does not look like an Arctic RL server (set remote_backend.comms.api explicitly to skip detection)"
    )


class ArcticClient:
    """Synchronous calls for the trainer side; :meth:`agenerate` for the rollout server's event loop."""

    def __init__(
        self,
        url: str,
        generation: str = "auto",
        *,
        token: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 1800.0,
        retries: int = 3,
    ) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        self.retries = max(0, int(retries))
        if generation == "auto":
            generation = probe_generation(self.url, timeout=connect_timeout, headers=self._headers)
        if generation not in GENERATIONS:
            raise ValueError(f"unknown Arctic protocol generation {generation!r}; use auto, {', '.join(GENERATIONS)}")
        self.generation = generation
        self.encoding = ENCODING[generation]
        # No keep-alive: uvicorn closes the connection after an unhandled server error (a bare 500), and a
        # request on that pooled connection would then fail with "connection reset" instead of its own answer.
        self._http = httpx.Client(
            timeout=self._timeout, headers=self._headers, limits=httpx.Limits(max_keepalive_connections=0)
        )
        # agenerate's client: one per event loop, made on first use. A client per request made a step's requests
        # (rows x n at once) build as many clients, TLS context included, on the loop their connect timeouts run on,
        # which under load was enough to time them out before they reached the server.
        self._async_http: httpx.AsyncClient | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None

    def close(self) -> None:
        self._http.close()
        # agenerate's client holds no idle connection (no keep-alive), so dropping it leaves nothing open.
        self._async_http = self._async_loop = None

    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._async_http is None or self._async_loop is not loop:
            self._async_http = httpx.AsyncClient(
                timeout=self._timeout, headers=self._headers, limits=httpx.Limits(max_keepalive_connections=0)
            )
            self._async_loop = loop
        return self._async_http

    # -- plumbing ----------------------------------------------------------------------------

    def _request_args(
        self, spec: Route, job_id: int | None, body: Any, params: dict[str, Any] | None
    ) -> tuple[str, dict[str, Any]]:
        path = spec.path.format(job_id=job_id)
        query = dict(params or {})
        if spec.job_query:
            if job_id is None:
                raise ValueError(f"Arctic call {spec.path} needs a job id")
            query["job_id"] = job_id
        kwargs: dict[str, Any] = {}
        url = str(httpx.URL(f"{self.url}{path}").copy_merge_params(query))
        if spec.request == "binary":
            kwargs["content"] = wire.encode(self.encoding, body)
            kwargs["headers"] = {"Content-Type": "application/octet-stream"}
        elif spec.request == "json" and body is not None:
            kwargs["json"] = body
        return url, kwargs

    def _decode(self, operation: str, spec: Route, url: str, response: httpx.Response) -> Any:
        try:
            if spec.response == "binary":
                return wire.decode(self.encoding, response.content)
            return response.json()
        except ValueError as exc:  # wire.WireError and json's JSONDecodeError both are
            raise ArcticError(
                f"Arctic call {operation} ({spec.method} {url}) answered HTTP {response.status_code} with a body "
                f"that is not Arctic's {spec.response} answer ({describe_answer(response)}): {exc}",
                status=response.status_code,
            ) from exc

    def _fail(self, operation: str, spec: Route, url: str, response: httpx.Response) -> ArcticError:
        said = describe_answer(response)
        # A job the server does not know (``_verify_job``: 0.1.2 rl/http_server.py:100-107, 0.1.4
        # common/http_server.py:125-132): the run created it, so the server lost it, restarting.
        lost = response.status_code == 404 and re.fullmatch(r"Job \d+ not found", said) is not None
        return ArcticError(
            f"Arctic call {operation} ({spec.method} {url}) failed: HTTP {response.status_code}: {said}"
            + ("; the server no longer has the job: it restarted" if lost else ""),
            status=response.status_code,
            transient=True if lost else None,
        )

    def call(
        self, operation: str, *, job_id: int | None = None, body: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        spec = route(self.generation, operation)
        url, kwargs = self._request_args(spec, job_id, body, params)
        attempts = 1 + (self.retries if spec.idempotent else 0)
        for attempt in range(attempts):
            try:
                with self._http.stream(spec.method, url, **kwargs) as streamed:
                    if streamed.is_success:
                        streamed.read()
                        response = streamed
                    else:  # an error's body, read up to a cap: only its first line is shown
                        response = read_capped(streamed)
            except httpx.TimeoutException as exc:
                error = ArcticError(
                    f"Arctic call {operation} ({spec.method} {url}) timed out: {_reason(exc)}", transient=True
                )
            except httpx.HTTPError as exc:
                error = ArcticError(
                    f"Arctic call {operation} ({spec.method} {url}) failed: cannot reach the server: {_reason(exc)}",
                    transient=isinstance(exc, httpx.TransportError),
                )
            else:
                if response.is_success:
                    return self._decode(operation, spec, url, response)
                if not spec.idempotent or response.status_code < 500:
                    raise self._fail(operation, spec, url, response)
                error = self._fail(operation, spec, url, response)
            if attempt + 1 < attempts:
                time.sleep(min(2.0**attempt, 10.0))
        raise error

    async def agenerate(self, job_id: int, prompts: list[str], sampling_params: dict[str, Any]) -> dict[str, Any]:
        """``/generate`` from an event loop (the rollout server); not retried."""
        spec = route(self.generation, "generate")
        url, kwargs = self._request_args(spec, job_id, self._generate_body(prompts, sampling_params), None)
        try:
            async with self._async_client().stream(spec.method, url, **kwargs) as streamed:
                if streamed.is_success:
                    await streamed.aread()
                    response = streamed
                else:
                    response = await aread_capped(streamed)
        except httpx.HTTPError as exc:
            # Some of httpx's errors have no message (a connect timeout): name the error then.
            reason = _reason(exc) or f"{type(exc).__name__} (remote_backend.connect_timeout_s, read_timeout_s)"
            raise ArcticError(
                f"Arctic call generate ({spec.method} {url}) failed: {reason}",
                transient=isinstance(exc, httpx.TransportError),
            ) from exc
        if not response.is_success:
            raise self._fail("generate", spec, url, response)
        result: dict[str, Any] = self._decode("generate", spec, url, response)
        return result

    # -- the protocol --------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("health")
        return result

    def initialize(self, job_config: dict[str, Any]) -> int:
        return int(self.call("initialize", body=job_config)["job_id"])

    def job(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self.call("job", job_id=job_id)
        return result

    def wait_running(self, job_id: int, timeout: float, interval: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status = self.job(job_id).get("status")
            if status == "RUNNING":
                return
            if time.monotonic() > deadline:
                raise ArcticError(
                    f"Arctic job {job_id} at {self.url} is not RUNNING after {timeout:.0f}s (status {status})"
                )
            time.sleep(interval)

    def destroy(self, job_id: int, job_type: str) -> None:
        self.call("destroy", job_id=job_id, body={"job_type": job_type})

    def forward_backward(self, job_id: int, payload: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.call("forward_backward", job_id=job_id, body=payload)
        return result

    def forward(self, job_id: int, payload: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.call("forward", job_id=job_id, body=payload)
        return result

    def step(self, job_id: int) -> dict[str, Any]:
        body = {"learning_rate": None} if self.generation == "main" else None
        result: dict[str, Any] = self.call("step", job_id=job_id, body=body)
        return result

    def save(self, job_id: int, path: str, step: int, *, export_hf: bool = False) -> dict[str, Any]:
        body = {"path": path, "step": step, "export_hf": export_hf} if self.generation == "main" else None
        result: dict[str, Any] = self.call("save", job_id=job_id, body=body)
        return result

    def load_checkpoint(self, job_id: int, path: str, step: int) -> dict[str, Any]:
        result: dict[str, Any] = self.call("load_checkpoint", job_id=job_id, body={"path": path, "step": step})
        return result

    def weight_sync(
        self, training_job: int, sampling_job: int, *, colocate: bool, cuda_ipc: bool, low_memory: bool
    ) -> None:
        if self.generation == "main":
            body: dict[str, Any] = {
                "source_sub_job_id": training_job,
                "target_sub_job_ids": [sampling_job],
                "cuda_ipc": cuda_ipc,
                "low_memory": low_memory,
            }
            self.call("weight_sync", job_id=training_job, body=body)
        else:
            body = {
                "training_job_id": training_job,
                "sampling_job_id": sampling_job,
                "colocate": colocate,
                "cuda_ipc": cuda_ipc,
                "low_memory": low_memory,
            }
            self.call("weight_sync", body=body)

    def weight_norm(self, training_job: int, sampling_job: int) -> dict[str, Any]:
        """Parameter norms of the training and sampling jobs (equal right after a weight sync)."""
        body = {"training_job_id": training_job, "sampling_job_id": sampling_job}
        result: dict[str, Any] = self.call("weight_norm", body=body)
        return result

    def sleep_inference(self, job_id: int, level: int = 1) -> None:
        self.call("sleep_inference", job_id=job_id, params={"level": level})

    def wake_inference(self, job_id: int, tags: list[str] | None = None) -> None:
        self.call("wake_inference", job_id=job_id, body=tags)

    def reset_prefix_cache(self, job_id: int) -> None:
        self.call("reset_prefix_cache", job_id=job_id)

    def _generate_body(self, prompts: list[str], sampling_params: dict[str, Any]) -> dict[str, Any]:
        return {"prompts": prompts, "sampling_params": sampling_params}

    def generate(self, job_id: int, prompts: list[str], sampling_params: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.call(
            "generate", job_id=job_id, body=self._generate_body(prompts, sampling_params)
        )
        return result
