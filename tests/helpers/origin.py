"""A real HTTP origin on loopback for the media-fetch tests.

:class:`Origin` serves :class:`Route` objects from a thread (``http.server``),
on ``127.0.0.1`` or any other loopback address (``127.0.0.2`` stands for a
"public" host in tests that allow only it). It counts every connection the
kernel hands it (``accepted``), so a test can show that a refused URL caused
**no connection at all**, and keeps an access log of ``(path, Host header)``.
Routes can be changed while it runs (an origin whose ``latest.png`` changes).
"""

from __future__ import annotations

import http.server
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Route:
    """What one path answers: a status, headers and a body; ``drip_s`` sends the body
    one byte per ``drip_s`` seconds; ``location`` makes it a redirect."""

    body: bytes = b""
    status: int = 200
    content_type: str | None = "image/png"
    headers: dict[str, str] = field(default_factory=dict)
    location: str | None = None
    drip_s: float = 0.0
    #: Send this Content-Length instead of the body's own (None: the body's; -1: none,
    #: the body ends when the connection closes).
    content_length: int | None = None


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], origin: Origin) -> None:
        self.origin = origin
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        with self.origin.lock:
            self.origin.accepted += 1
        return conn, addr


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        origin = self.server.origin
        path = self.path.split("?", 1)[0]
        with origin.lock:
            origin.log.append((self.path, self.headers.get("Host", "")))
            route = origin.routes.get(path)
        if route is None:
            route = Route(b"not found", status=404, content_type="text/plain")
        with suppress(BrokenPipeError, ConnectionResetError):
            self._answer(route)

    def _answer(self, route: Route) -> None:
        self.send_response(route.status)
        if route.content_type is not None:
            self.send_header("Content-Type", route.content_type)
        if route.location is not None:
            self.send_header("Location", route.location)
        for k, v in route.headers.items():
            self.send_header(k, v)
        length = route.content_length if route.content_length is not None else len(route.body)
        if length >= 0:
            self.send_header("Content-Length", str(length))
        self.send_header("Connection", "close")
        self.end_headers()
        if route.drip_s <= 0:
            self.wfile.write(route.body)
            return
        for i in range(len(route.body)):
            self.wfile.write(route.body[i : i + 1])
            self.wfile.flush()
            time.sleep(route.drip_s)


class Origin:
    """An HTTP origin on ``host`` (a loopback address), in a thread; HTTPS with
    ``tls`` (a server context), recording the TLS server names clients sent."""

    def __init__(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.lock = threading.Lock()
        self.routes: dict[str, Route] = {}
        self.log: list[tuple[str, str]] = []
        self.server_names: list[str | None] = []
        self.accepted = 0
        self._server = _Server((host, 0), self)
        self.scheme = "http"
        if tls is not None:
            tls.sni_callback = self._sni
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _sni(self, sock: Any, name: str | None, context: Any) -> None:
        with self.lock:
            self.server_names.append(name)

    def url(self, path: str, host: str | None = None) -> str:
        """``http(s)://HOST:PORT/path`` (``host`` replaces the address, a name say)."""
        return f"{self.scheme}://{host or self.host}:{self.port}{path}"

    def set(self, path: str, route: Route, host: str | None = None) -> str:
        with self.lock:
            self.routes[path] = route
        return self.url(path, host)

    def paths(self) -> list[str]:
        with self.lock:
            return [p for p, _ in self.log]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def origin(host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> Iterator[Origin]:
    server = Origin(host, tls)
    try:
        yield server
    finally:
        server.close()
