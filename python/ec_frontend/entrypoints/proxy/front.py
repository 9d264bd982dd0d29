"""What the proxy answers itself, as the server does: ``/health`` by role, OpenAI-shaped
404 / 405, the API key and the access line.

* ``/health``: 200 when each role a request cannot do without (decode; prefill
  when the proxy has prefill instances) has at least one instance whose
  ``/health`` answers 200 within ``connect_timeout_s``; else 503
  ``no_healthy_instance`` naming the roles without one. Encoders are optional (a
  request whose encoders are down is encoded by its prefill or decode instance):
  when none answers, the 200 body says ``"encode": "unreachable"``. The instances
  are probed at most once a second.
* Unknown routes and wrong methods: ``route_not_found`` (404) and
  ``method_not_allowed`` (405), in OpenAI's error shape.
* :class:`ApiKeyGate`: ``--api-key`` on every route but ``/health`` (401
  ``invalid_api_key``). The proxy sends its own calls to the instances without a
  key; instances behind it are reached on a private network.
* :class:`AccessLog`: the server's access line (``entrypoints/http/middleware.py``).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from ec_frontend.entrypoints.http.errors import error_body
from ec_frontend.entrypoints.http.middleware import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    error_fields,
    log_access,
)

_JSON = "application/json"
_PROBE_EVERY_S = 1.0


class RoleHealth:
    """``/health`` of the proxy: see the module docstring."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        roles: Callable[[], dict[str, tuple[str, ...]]],
        timeout_s: float,
        report: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.client = client
        self.roles = roles  # the instances of each role now, live or out of rotation
        self.timeout_s = timeout_s
        self.report = report  # each probe's result, for the membership
        self._at = -1e9
        self._down: list[str] = []
        self._lock = asyncio.Lock()

    async def _up(self, url: str) -> bool:
        try:
            resp = await self.client.get(url + "/health", timeout=self.timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def forget(self, *_: object) -> None:
        """Drop the cached answer (an instance came back: a cached "down" is stale)."""
        self._at = -1e9

    async def down_roles(self) -> list[str]:
        async with self._lock:
            if time.monotonic() - self._at >= _PROBE_EVERY_S:
                down = []
                for role, urls in self.roles().items():
                    if not urls:
                        continue
                    results = await asyncio.gather(*(self._up(u) for u in urls))
                    if self.report is not None:
                        for url, ok in zip(urls, results, strict=True):
                            self.report(url, ok)
                    if not any(results):
                        down.append(role)
                self._down, self._at = down, time.monotonic()
            return self._down

    async def __call__(self) -> Response:
        down = await self.down_roles()
        needed = [role for role in down if role != "encode"]
        if not down:
            return Response(b'{"status":"ok"}', media_type=_JSON)
        if not needed:
            return Response(b'{"status":"ok","encode":"unreachable"}', media_type=_JSON)
        message = f"no healthy instance for: {', '.join(needed)}"
        return Response(error_body(503, message, None, "no_healthy_instance"), 503,
                        media_type=_JSON)  # fmt: skip


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 / 405 in OpenAI's error shape."""
    status = getattr(exc, "status_code", 500)
    if status == 404:
        body = error_body(404, "no such route", None, "route_not_found")
    elif status == 405:
        body = error_body(405, "method not allowed on this route", None, "method_not_allowed")
    else:
        body = error_body(status, str(getattr(exc, "detail", exc)), None, "http_error")
    headers = dict(getattr(exc, "headers", None) or {}) if isinstance(exc, HTTPException) else {}
    return Response(body, status, headers=headers, media_type=_JSON)


class ApiKeyGate:
    """``Authorization: Bearer KEY`` on every route but ``/health`` (401 otherwise)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                body = error_body(401, "invalid or missing API key", None, "invalid_api_key")
                response = Response(body, 401, headers={"www-authenticate": "Bearer"},
                                    media_type=_JSON)  # fmt: skip
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AccessLog:
    """One access line per request, as the server writes it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]
        body = bytearray()

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif status[0] >= 400 and len(body) < 8192:
                body.extend(message.get("body", b"")[:8192])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            code, param = error_fields(body) if status[0] >= 400 else (None, None)
            rid = dict(scope["headers"]).get(b"x-request-id", b"-")
            log_access(scope, status[0], start, rid, code, param)


def wrap(app: Any, api_key: str | None, access_log: bool) -> Any:
    """The proxy's app behind the API key and the access line, as asked."""
    if api_key:
        app = ApiKeyGate(app, api_key)
    if access_log:
        app = AccessLog(app)
    return app
