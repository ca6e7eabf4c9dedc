"""An HTTP proxy that fails requests on purpose, in front of a service: what a load balancer or a flaky network
does to a run (a 502, a connection cut mid-request, a refusal), on the requests a test chooses.

For backend authors' tests as for ours: point the backend's URL at :attr:`FaultProxy.url`, arm a :class:`Fault`
for a route when the run has reached the step to break, and read :attr:`FaultProxy.seen` for what reached the
proxy. It listens on 127.0.0.1 unless told otherwise, and every fault answers a bounded number of requests
(``times``). A request a fault answers never reaches the service; a service that does not answer is answered
with 502, as a load balancer answers for it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

__all__ = ["CUT", "SLOW", "Fault", "FaultProxy"]

#: A fault's status that answers nothing: the proxy closes the connection once it read the request.
CUT = 0
#: A fault's status that answers as the service does, late: the request waits ``delay_s`` before it goes on (a slow
#: network or a busy service).
SLOW = -1

#: Hop-by-hop headers and those the proxy recomputes.
_DROPPED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "server", "date"}


@dataclass
class Fault:
    """Answer ``times`` requests to ``route`` (a path's end, query left out; "" matches every path) with
    ``status`` (:data:`CUT`: close the connection instead; :data:`SLOW`: send it on after ``delay_s``), after
    letting ``skip`` of them through; requests of any method, or of ``method`` only."""

    route: str
    status: int
    times: int = 1
    skip: int = 0
    method: str | None = None
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    answered: int = 0
    passed: int = 0

    def takes(self, path: str, method: str = "GET") -> bool:
        if self.answered >= self.times or not path.split("?", 1)[0].endswith(self.route):
            return False
        if self.method is not None and method != self.method:
            return False
        if self.passed < self.skip:
            self.passed += 1
            return False
        self.answered += 1
        return True


class _Server(ThreadingHTTPServer):
    # A run opens dozens of connections at once (a step's sampling requests): socketserver's backlog of 5 would
    # overflow, and the kernel then resets connections it had accepted for it, faults nobody injected.
    request_queue_size = 1024


class FaultProxy:
    """Forwards every request to ``upstream`` and answers the armed faults. A context manager.

    Subclasses adapt what passes (:meth:`request_body`, :meth:`answer_body`): a test stand-in that speaks a newer
    protocol than the service behind it, say."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = urlsplit(upstream)
        self.faults: list[Fault] = []
        self.lock = threading.Lock()
        #: Requests per route (the path without its query) that reached the proxy, faults included.
        self.seen: Counter[str] = Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any

        self.server = _Server((host, port), Handler)  # a fault test's: 127.0.0.1, the default
        self.server.daemon_threads = True
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

    def start(self) -> FaultProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def inject(self, *faults: Fault) -> None:
        """Arm ``faults``; each answers the next matching requests, in the order armed."""
        with self.lock:
            self.faults.extend(faults)

    def answered(self, route: str) -> int:
        """How many requests to ``route`` the armed faults answered."""
        with self.lock:
            return sum(f.answered for f in self.faults if f.route == route)

    # -- for subclasses ------------------------------------------------------------------------

    def request_body(self, route: str, body: bytes, headers: dict[str, str]) -> bytes:
        """The body sent on to the service for a request to ``route`` (``headers`` may be changed in place)."""
        return body

    def answer_body(self, route: str, request: bytes, status: int, data: bytes) -> bytes:
        """The body the client gets for the service's answer to a request to ``route``."""
        return data

    # -- plumbing ------------------------------------------------------------------------------

    def _fault_for(self, path: str, method: str) -> Fault | None:
        with self.lock:
            self.seen[path.split("?", 1)[0]] += 1
            return next((f for f in self.faults if f.takes(path, method)), None)

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        fault = self._fault_for(request.path, request.command)
        if fault is not None and fault.status == CUT:
            request.close_connection = True
            request.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault is not None and fault.status == SLOW:
            time.sleep(fault.delay_s)
            fault = None
        if fault is not None:
            self._answer(request, fault.status, json.dumps(fault.body).encode(), fault.headers)
            return
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        route = request.path.split("?", 1)[0]
        try:
            sent = self.request_body(route, body, headers)
            status, data, answer_headers = self._upstream(request.command, request.path, sent, headers)
        except (OSError, ValueError) as exc:  # the service does not answer: a load balancer's 502
            self._answer(request, 502, json.dumps({"detail": f"proxy: upstream: {exc}"}).encode(), {})
            return
        self._answer(request, status, self.answer_body(route, sent, status, data), answer_headers)

    def _upstream(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        connection = http.client.HTTPConnection(self.upstream.hostname or "127.0.0.1", self.upstream.port, timeout=600)
        try:
            connection.request(method, path, body=body, headers=headers)
            answer = connection.getresponse()
            return answer.status, answer.read(), {k: v for k, v in answer.getheaders() if k.lower() not in _DROPPED}
        finally:
            connection.close()

    def _answer(self, request: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str]) -> None:
        request.send_response(status)
        for key, value in headers.items():
            request.send_header(key, value)
        if not any(k.lower() == "content-type" for k in headers):
            request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)
