"""A pure-ASGI middleware in front of the app: request ids, drain, auth, metrics.

For each HTTP request it

* takes ``X-Request-Id`` from the client (or makes one), stores it in
  ``scope["ec_request_id"]`` and echoes it on the response;
* refuses new work with 503 while the server drains (``/metrics`` stays up);
* checks ``Authorization: Bearer <key>`` on every route when an API key is
  configured (401 otherwise), except the liveness probes (``/health``,
  ``/ping``) and, when made public, ``/metrics`` and the API docs (``/docs``,
  ``/redoc``, ``/openapi.json``); an unknown path needs the key too, so that the
  routes a server has cannot be listed without it;
* counts ``ec_frontend_requests_total{endpoint,status}`` and the generation
  requests in flight, which the drain waits on;
* logs one access line per request (logger ``ec_frontend.access``): client,
  method, path, status, time, request id and, for a 4xx or 5xx, the error's
  ``code`` and ``param``; with ``log_requests``, the request body too (up to
  ``max_log_len`` characters).

It is written against raw ASGI, not ``BaseHTTPMiddleware``, to keep the
per-request cost to a few dictionary operations.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ec_frontend.entrypoints.http.errors import APIError
from ec_frontend.metrics import ServerMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Endpoints whose label is their path, beside the wrapped app's own routes
#: (:meth:`FrontMiddleware.endpoint_label`); a path no route serves is counted as
#: ``unmatched``, which keeps a scanner's random paths from adding series.
KNOWN_ENDPOINTS: frozenset[str] = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/inference/v1/generate",
        "/v1/models",
        "/health",
        "/metrics",
        "/docs",
        "/redoc",
        "/openapi.json",
    }
)
GENERATION_ENDPOINTS: frozenset[str] = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/inference/v1/generate"}
)
#: Routes that answer without the API key: liveness probes, which a load balancer or
#: an orchestrator calls without credentials and which reveal nothing but "up".
ALWAYS_PUBLIC: frozenset[str] = frozenset({"/health", "/ping"})
DOCS_PATHS: frozenset[str] = frozenset(
    {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
)
access_log = logging.getLogger("ec_frontend.access")
#: Bytes of an error response read for its code and param.
_ERROR_PEEK = 8192
#: A client's X-Request-Id is used when it is 1 to 256 visible ASCII characters.
_VALID_ID = re.compile(rb"[\x21-\x7e]{1,256}")
_VALID_ID_STR = re.compile(r"[\x21-\x7e]{1,256}")
#: The longest request id a client may choose (``X-Request-Id``, a generate ``request_id``).
MAX_REQUEST_ID_CHARS = 256


def valid_request_id(value: str) -> bool:
    """Whether ``value`` may name a request: 1 to 256 visible ASCII characters (no
    space, no control or non-ASCII character), the ``X-Request-Id`` rule."""
    return _VALID_ID_STR.fullmatch(value) is not None


class FrontState:
    """Mutable server state the middleware and the drain share."""

    def __init__(
        self,
        metrics: ServerMetrics,
        api_key: str | None,
        max_in_flight: int,
        *,
        public_metrics: bool = False,
        public_docs: bool = False,
        access_log: bool = True,
        log_requests: bool = False,
        max_log_len: int | None = None,
    ) -> None:
        self.metrics = metrics
        self.access_log = access_log
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self.api_key = api_key.encode() if api_key else None
        self.max_in_flight = max_in_flight
        self.draining = False
        public: set[str] = set(ALWAYS_PUBLIC)
        if public_metrics:
            public.add("/metrics")
        if public_docs:
            public |= DOCS_PATHS
        #: Paths that answer without the API key; every other path needs it.
        self.public_paths: frozenset[str] = frozenset(public)

    def needs_key(self, path: str) -> bool:
        """Whether ``path`` is behind the API key (when one is configured)."""
        return path not in self.public_paths


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


Handler = Callable[[Request], Awaitable[Response]]


def _with_request_id(send: Send, rid: bytes) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
        await send(message)

    return wrapped


class FrontMiddleware:
    """See the module docstring. ``routes`` maps POST paths to handlers called
    directly (bypassing the wrapped app); ``on_error`` (the server's one error
    handler) renders their exceptions and this middleware's own refusals."""

    def __init__(
        self,
        app: ASGIApp,
        state: FrontState,
        routes: Mapping[str, Handler],
        on_error: Callable[[Exception], Response],
    ) -> None:
        self.app = app
        self.state = state
        self.routes = routes
        self.on_error = on_error
        #: Paths served by a route of ``app``, read on the first request (routes
        #: are all added by then).
        self._route_paths: frozenset[str] | None = None

    def endpoint_label(self, path: str) -> str:
        """The ``endpoint`` label of a request for ``path``: the route, or ``unmatched``."""
        if self._route_paths is None:
            found = {getattr(r, "path", None) for r in getattr(self.app, "routes", ())}
            self._route_paths = KNOWN_ENDPOINTS | {p for p in found if isinstance(p, str)}
        return path if path in self._route_paths else "unmatched"

    def _admission(self, scope: Scope, path: str) -> APIError | None:
        """Why a request may not proceed (drain, API key, overload), or ``None``."""
        state = self.state
        if state.draining and path != "/metrics":
            return APIError(
                503, "the server is shutting down", code="draining", headers={"connection": "close"}
            )
        key = state.api_key
        if key is not None and state.needs_key(path):
            auth = _header(scope, b"authorization") or b""
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, key):
                return APIError(
                    401,
                    "invalid or missing API key",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
        if (
            path in GENERATION_ENDPOINTS
            and scope["method"] == "POST"
            and state.metrics.in_flight >= state.max_in_flight
        ):
            return APIError(503, "the server is overloaded; retry later", code="overloaded")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.state.metrics
        path: str = scope["path"]
        endpoint = self.endpoint_label(path)
        rid = _header(scope, b"x-request-id")
        if rid is None or _VALID_ID.fullmatch(rid) is None:
            rid = uuid.uuid4().hex.encode()
        scope["ec_request_id"] = rid.decode()

        start = time.perf_counter()
        reject = self._admission(scope, path)
        if reject is not None:
            response = self.on_error(reject)
            await response(scope, receive, _with_request_id(send, rid))
            metrics.requests.inc((endpoint, str(reject.status)))
            if self.state.access_log:
                log_access(scope, reject.status, start, rid, reject.code, reject.param)
            return
        if self.state.log_requests:
            receive = _logging_receive(receive, rid, self.state.max_log_len)

        generation = path in GENERATION_ENDPOINTS and scope["method"] == "POST"
        status_holder = [500]
        error_body = bytearray()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_holder[0] = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            elif status_holder[0] >= 400 and len(error_body) < _ERROR_PEEK:
                error_body.extend(message.get("body", b"")[:_ERROR_PEEK])
            await send(message)

        if generation:
            metrics.in_flight += 1
        try:
            handler = self.routes.get(path) if generation else None
            if handler is None:
                await self.app(scope, receive, send_wrapper)
            else:
                try:
                    response = await handler(Request(scope, receive))
                except Exception as exc:
                    response = self.on_error(exc)
                await response(scope, receive, send_wrapper)
        finally:
            if generation:
                metrics.in_flight -= 1
            metrics.requests.inc((endpoint, str(status_holder[0])))
            if self.state.access_log:
                code, param = error_fields(error_body) if status_holder[0] >= 400 else (None, None)
                log_access(scope, status_holder[0], start, rid, code, param)


def error_fields(body: bytes | bytearray) -> tuple[str | None, str | None]:
    """``(code, param)`` of an OpenAI-shaped error body (``None`` where absent)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None, None
    if not isinstance(error, dict):
        return None, None
    code, param = error.get("code"), error.get("param")
    return (None if code is None else str(code)), (None if param is None else str(param))


def log_access(
    scope: Scope, status: int, start: float, rid: bytes, code: str | None, param: str | None
) -> None:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    extra = ""
    if status >= 400:
        extra = f" code={code or '-'} param={param or '-'}"
    access_log.info(
        '%s "%s %s" %d %.1f ms rid=%s%s',
        who,
        scope["method"],
        scope["path"],
        status,
        (time.perf_counter() - start) * 1000,
        rid.decode(),
        extra,
    )


def _logging_receive(receive: Receive, rid: bytes, limit: int | None) -> Receive:
    """``receive`` that logs the request body once it is read (``--enable-log-requests``)."""
    body = bytearray()

    async def wrapped() -> Message:
        message = await receive()
        if message["type"] == "http.request":
            if limit is None or len(body) < limit:
                body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                text = body.decode(errors="replace")
                if limit is not None:
                    text = text[:limit]
                access_log.info("request rid=%s body: %s", rid.decode(), text)
        return message

    return wrapped
