"""A test aid, not product: an HTTP proxy in front of a Tinker-API server that adapts and injects.

**Adapts.** From tinker 0.26 the SDK requires what SkyRL 0.4.0's server never sends: the answer to a sample
request (``POST /api/v1/asample``, an ``UntypedAPIFuture``) must carry ``sample_sequence_ids``, one id per
requested sample (tinker 0.38.0 ``types/shared/untyped_api_future.py:15``;
``lib/public_interfaces/sampling_client.py:80-88`` asserts it and stamps each id on its sequence, :431). The
proxy adds exactly that field, ``num_samples`` ids taken from the request, to each such answer, and changes
nothing else. SDK 0.25 ignores the field.

And from 0.26 a training client is created from a checkpoint by one request, a ``load_weights`` that names no
model but ``session_id`` and ``model_seq_id``, the model then being ``<session_id>:train:<model_seq_id>``
(0.38.0 ``lib/public_interfaces/service_client.py:397-433``, ``types/load_weights_request.py``); SkyRL 0.4.0's
``load_weights`` needs a ``model_id`` (``skyrl/tinker/api.py:860-865``). The proxy does what SDK 0.25 does
for such a server (0.25.0 ``service_client.py`` ``create_training_client_from_state_with_optimizer``): it asks
the server for the checkpoint's base model and rank (``/api/v1/weights_info``), creates that model, loads the
checkpoint into it, and from then on writes the server's model id for the SDK's in every request and the
SDK's for the server's in every answer.

So SkyRL's server can be driven by every SDK in verl-remote-tinker's range;
:mod:`verl_remote_tinker.testing.local_server` starts one in front of the server it runs.

**Injects.** A test can ask for answers the real services give and the local server does not, each a
:class:`Fault` for a route: HTTP 429 with ``Retry-After`` (a rate limit; the SDK's HTTP client retries it,
``tinker/_base_client.py`` ``_should_retry``/``_calculate_retry_timeout``), HTTP 408 with a ``queue_state``
body on ``/api/v1/retrieve_future`` (a paused queue; ``tinker/lib/api_future_impl.py``, 0.25.0 :159-166 and
:332-341, 0.38.0 :163-170 and :381-395, polls again and hands the state to the client's observer), or a refusal
(HTTP 400 with the service's words). A request answered by a fault never reaches the server.
"""

from __future__ import annotations

import json
import uuid
from http.server import BaseHTTPRequestHandler
from typing import Any

from verl_remote.testing.proxy import Fault, FaultProxy

__all__ = ["Fault", "TinkerProxy"]


class TinkerProxy(FaultProxy):
    """Forwards every request to ``upstream``; adds ``sample_sequence_ids``; answers faults. A context manager."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(upstream, host=host, port=port)
        self.models: dict[str, str] = {}  # the SDK's model id -> the server's, for models created by a load
        self.api_keys: set[str] = set()  # the X-API-Key headers seen (the SDK's, tinker/lib/_auth_token_provider.py)

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        if key := request.headers.get("X-API-Key"):
            with self.lock:
                self.api_keys.add(key)
        super()._handle(request)

    def request_body(self, route: str, body: bytes, headers: dict[str, str]) -> bytes:
        if "protobuf" in headers.get("Content-Type", headers.get("content-type", "")):
            body = self._swapped_in_proto(body, headers)
        elif route.endswith("/api/v1/load_weights"):
            body = self._created_for_load(body, headers)
        return self._swapped(body, to_server=True)

    def answer_body(self, route: str, request: bytes, status: int, data: bytes) -> bytes:
        if status == 200 and route.endswith("/api/v1/asample"):
            data = _with_sequence_ids(request, data)
        return self._swapped(data, to_server=False)

    def _post(self, route: str, payload: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        status, data, _ = self._upstream("POST", route, json.dumps(payload).encode(), headers)
        if status != 200:
            raise ValueError(f"{route}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)  # type: ignore[no-any-return]

    def _created_for_load(self, body: bytes, headers: dict[str, str]) -> bytes:
        """A load that creates its model (newer SDKs) as the server knows it: create the model, then load it."""
        asked = json.loads(body or b"{}")
        if asked.get("model_id") or not asked.get("session_id") or asked.get("model_seq_id") is None:
            return body
        headers = {**headers, "Content-Type": "application/json"}
        info = self._post("/api/v1/weights_info", {"tinker_path": asked["path"]}, headers)
        created = self._post(
            "/api/v1/create_model",
            {
                "session_id": asked["session_id"],
                "base_model": asked.get("base_model") or info["base_model"],
                "lora_config": {"rank": int(info.get("lora_rank") or 0)},
            },
            headers,
        )
        while True:  # the model exists once its creation is done (a 408 is the server's "not yet")
            status, data, _ = self._upstream(
                "POST", "/api/v1/retrieve_future", json.dumps({"request_id": created["request_id"]}).encode(), headers
            )
            if status == 200:
                break
            if status != 408:
                raise ValueError(f"/api/v1/retrieve_future: HTTP {status}: {data[:300]!r}")
        with self.lock:
            self.models[f"{asked['session_id']}:train:{asked['model_seq_id']}"] = str(created["model_id"])
        load = {"model_id": created["model_id"], "path": asked["path"], "optimizer": bool(asked.get("optimizer"))}
        return json.dumps({**load, "type": "load_weights"}).encode()

    def _swapped_in_proto(self, body: bytes, headers: dict[str, str]) -> bytes:
        """A forward(-backward) request, which newer SDKs send as the SDK's protobuf message (0.38.0
        ``resources/training.py:36-42``, zstd-compressed where the server's client config asks), with the
        server's model id for the SDK's. Left as it came when it names no model created by a load."""
        with self.lock:
            models = dict(self.models)
        if not models:
            return body
        import zstandard
        from tinker.proto import tinker_public_pb2

        encoding = next((k for k in headers if k.lower() == "content-encoding"), None)
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(body) if encoding else body
        message = tinker_public_pb2.ForwardBackwardRequest()
        message.ParseFromString(raw)
        if message.model_id not in models:
            return body
        message.model_id = models[message.model_id]
        if encoding:
            del headers[encoding]
        return bytes(message.SerializeToString())

    def _swapped(self, data: bytes, *, to_server: bool) -> bytes:
        """``data`` with each model id of the SDK's written as the server's (or back)."""
        with self.lock:
            pairs = list(self.models.items())
        for sdk_id, server_id in pairs:
            old, new = (sdk_id, server_id) if to_server else (server_id, sdk_id)
            data = data.replace(f'"{old}"'.encode(), f'"{new}"'.encode())
        return data


def _with_sequence_ids(request_body: bytes, answer: bytes) -> bytes:
    """The sample request's answer with one ``sample_sequence_ids`` entry per requested sample."""
    try:
        asked = json.loads(request_body or b"{}")
        future = json.loads(answer)
    except ValueError:
        return answer  # not JSON: left for the SDK to refuse
    if not isinstance(future, dict) or "sample_sequence_ids" in future:
        return answer
    count = int(asked.get("num_samples", 1)) if isinstance(asked, dict) else 1
    future["sample_sequence_ids"] = [f"seq-{uuid.uuid4().hex}" for _ in range(count)]
    return json.dumps(future).encode()
