"""uvicorn's httptools protocol with the limits it lacks: head size, URL size, head
timeout and a connection cap.

uvicorn with httptools (tried on a bare app) answers a request with an 8 MiB
header (httptools gathers a header value whole, so a huge one also takes
quadratic time), answers a 20 KB URL, and holds a connection that never sends
a byte (its keep-alive timer starts only after a first response).
:func:`hardened_protocol` returns a subclass of its ``HttpToolsProtocol`` that

* answers 414 when the request target exceeds ``max_url_bytes`` and 431 when
  the head (request line and headers) exceeds ``max_header_bytes``, counting
  bytes as they arrive, so an oversized head is never buffered whole;
* closes a connection whose request head is not complete ``header_timeout_s``
  after its first byte (408) or, for a new connection, after it opened
  (silently: it never asked for anything);
* keeps at most ``max_connections`` open: a new connection over the cap
  closes the connection that has waited longest without a running request
  (an idle keep-alive connection, or one still sending its head), or, when
  every one is busy, is answered 503 and closed. The waiting connections are
  kept in arrival order, so finding the one to close costs O(1).

Keep-alive idle time is uvicorn's own ``timeout_keep_alive``; the body's read
deadline is the app's (``ServerConfig.body_timeout_s``), which can answer 408.
A request that is not valid HTTP gets an OpenAI-style 400 ``invalid_http`` (uvicorn's
own answer is plain text). Every refusal is counted in
``ec_frontend_http_connections_refused_total{reason}``.
"""

from __future__ import annotations

import argparse
import asyncio
import http
import importlib.util
import resource
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ec_frontend.entrypoints.http.errors import error_body
from ec_frontend.metrics import Counter


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Connection-level limits of one server (each a ``serve`` / ``proxy`` flag)."""

    max_header_bytes: int = 32 * 1024
    max_url_bytes: int = 8 * 1024
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 30.0
    max_connections: int = 4096


class _Refusal(Exception):
    """Raised inside a parser callback to stop parsing; the protocol answers it."""


_MESSAGES = {
    400: ("invalid_http", "the request is not valid HTTP/1.1"),
    408: ("request_timeout", "the request head did not arrive in time"),
    414: ("uri_too_long", "the request URL exceeds {limit} bytes"),
    431: ("request_header_fields_too_large", "the request headers exceed {limit} bytes"),
    503: ("too_many_connections", "the server has too many open connections; retry later"),
}


def _raw_error(status: int, limit: int = 0) -> bytes:
    code, message = _MESSAGES[status]
    body = error_body(status, message.format(limit=limit), None, code)
    head = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode(),
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n",
    ]
    if status == 503:
        head.append(b"retry-after: 1\r\n")
    return b"".join([*head, b"\r\n", body])


def hardened_protocol(limits: HttpLimits, refused: Counter) -> type[asyncio.Protocol]:
    """An ``HttpToolsProtocol`` subclass bound to ``limits``; ``refused`` counts by reason.

    Needs ``httptools`` (:func:`uvicorn_http_settings` falls back to h11 without it).
    """
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    def count(reason: str) -> None:
        refused.inc((reason,))

    # Connections without a running request, longest-waiting first (eviction order).
    idle: OrderedDict[HardenedHttpToolsProtocol, None] = OrderedDict()

    class HardenedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._reading_head = True
            self._head_bytes = 0
            self._header_bytes = 0
            self._head_timer: asyncio.TimerHandle | None = None
            self._refusal: tuple[int, str, int] | None = None

        # ---- connection -----------------------------------------------------

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections and not self._evict_one():
                count("connection_cap")
                self._refuse(503)
                return
            idle[self] = None
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            idle.pop(self, None)
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _busy(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _evict_one(self) -> bool:
            """Close the connection that has waited longest without a running request."""
            while idle:
                victim, _ = idle.popitem(last=False)
                if victim.transport.is_closing() or victim._busy():
                    continue
                count("evicted_idle")
                victim.transport.close()
                return True
            return False

        # ---- head limits ----------------------------------------------------

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self._head_bytes == 0 or self._busy():
                count("idle_timeout")
                self.transport.close()
                return
            count("header_timeout")
            self._refuse(408)

        def _refuse(self, status: int, limit: int = 0) -> None:
            self._cancel_head_timer()
            if not self._busy():
                self.transport.write(_raw_error(status, limit))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            if self._reading_head:
                if self._head_bytes == 0 and self._head_timer is None:
                    self._arm_head_timer()
                self._head_bytes += len(data)
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            except httptools.HttpParserError:
                if self._refusal is not None:
                    status, reason, limit = self._refusal
                    count(reason)
                    self._refuse(status, limit)
                    return
                count("invalid_http")
                self._refuse(400)
                return
            if self._reading_head and self._head_bytes > limits.max_header_bytes:
                count("header_too_large")
                self._refuse(431, limits.max_header_bytes)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            if len(self.url) > limits.max_url_bytes:
                self._refusal = (414, "url_too_long", limits.max_url_bytes)
                raise _Refusal

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_bytes += len(name) + len(value) + 4
            if self._header_bytes > limits.max_header_bytes:
                self._refusal = (431, "header_too_large", limits.max_header_bytes)
                raise _Refusal
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._reading_head = False
            self._cancel_head_timer()
            idle.pop(self, None)
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._busy():
                idle[self] = None

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._reading_head = True
            self._head_bytes = 0

    return HardenedHttpToolsProtocol


#: Descriptors kept free of client connections (engine, connectors, logs).
_RESERVED_FDS = 256


def connection_cap(requested: int) -> int:
    """``requested``, or when 0 a cap below the open-file limit (raised to its hard
    maximum first), so that idle connections can never exhaust descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if requested > 0:
        return requested
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(16, min(10_000, soft - _RESERVED_FDS))


def uvicorn_http_settings(limits: HttpLimits, refused: Counter) -> dict[str, Any]:
    """uvicorn settings for ``limits``: the hardened httptools protocol, or h11 with
    its own head-size bound (answered 400, not 431) where httptools is missing."""
    settings: dict[str, Any] = {
        "timeout_keep_alive": limits.keep_alive_timeout_s,
        "timeout_graceful_shutdown": 1,
    }
    if importlib.util.find_spec("httptools") is not None:
        settings["http"] = hardened_protocol(limits, refused)
    else:
        settings["http"] = "h11"
        settings["h11_max_incomplete_event_size"] = limits.max_header_bytes
    return settings


#: A flag of a limits group: (flag, type, default, help); help may use ``%(default)s``.
Flag = tuple[str, type, object, str]


def limits_group(p: argparse.ArgumentParser, title: str, flags: Sequence[Flag]) -> None:
    group = p.add_argument_group(title)
    for flag, kind, default, text in flags:
        group.add_argument(flag, type=kind, default=default, help=text)


def add_http_args(p: argparse.ArgumentParser) -> None:
    """Connection-level limits (the hardened HTTP protocol and the body deadline)."""
    d = HttpLimits()
    limits_group(p, "HTTP limits", [
        ("--max-header-bytes", int, d.max_header_bytes,
         "request line and headers; over it, 431 (default %(default)s)"),
        ("--max-url-bytes", int, d.max_url_bytes,
         "request URL; over it, 414 (default %(default)s)"),
        ("--header-timeout", float, d.header_timeout_s,
         "seconds for a request head to arrive, and for a new connection to send one "
         "(default %(default)s)"),
        ("--body-timeout", float, 60.0,
         "seconds for a request body to arrive; over it, 408 (default %(default)s)"),
        ("--keep-alive-timeout", float, d.keep_alive_timeout_s,
         "seconds an idle keep-alive connection stays open (default %(default)s)"),
        ("--max-connections", int, 0,
         "open connections; a new one over the cap closes the longest-waiting idle one "
         "(default: below the open-file limit, at most 10000)"),
    ])  # fmt: skip


def http_limits(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(
        max_header_bytes=args.max_header_bytes,
        max_url_bytes=args.max_url_bytes,
        header_timeout_s=args.header_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        max_connections=args.max_connections,
    )
