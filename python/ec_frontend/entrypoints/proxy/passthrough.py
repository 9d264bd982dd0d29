"""The server's routes that the proxy forwards without splitting them into stages.

* ``POST /v1/responses``, ``/tokenize``, ``/detokenize``: the whole request goes to
  one decode instance (prefill+decode in an E+PD deployment), picked by the
  routing policy (Responses by its ``instructions`` and ``input``, for prefix-cache
  affinity), the next one when it cannot be reached; its answer (a stream
  included) comes back as it is. A Responses request is therefore not split: that
  instance encodes and prefills it itself, so it must be able to (a decode
  instance started without the vision encoder refuses images). Client-supplied
  transfer params are dropped, as on the split routes.
* ``POST /inference/v1/abort_requests``: sent to every instance in rotation, of
  every role (the proxy gives each stage of a request the client's
  ``X-Request-Id``, which is what the route's ``request_ids`` name). 200 when every
  instance that answered took it; an instance's 4xx (a bad body) is passed back;
  instances that cannot be reached are skipped, and 502 when none could be.

The proxy's own checks come first: body size and read timeout, a JSON object.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from ec_frontend.entrypoints.http.errors import error_body
from ec_frontend.entrypoints.proxy.app import (
    Proxy,
    UpstreamError,
    stage_headers,
    strip_transfer_params,
)
from ec_frontend.entrypoints.proxy.routing import prefix_key

#: Path -> the ``endpoint`` label of the proxy's request counter.
WHOLE_ROUTES: dict[str, str] = {
    "/v1/responses": "responses",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
ABORT_PATH = "/inference/v1/abort_requests"

log = logging.getLogger("ec_frontend.proxy")


async def forward_whole(proxy: Proxy, endpoint: str, path: str, request: Request) -> Response:
    """One of :data:`WHOLE_ROUTES` to a decode instance (see the module docstring)."""
    headers, out_headers = stage_headers(request)
    body = await proxy.json_body(endpoint, request, out_headers)
    if isinstance(body, Response):
        return body
    removed = strip_transfer_params(endpoint, body)
    if removed:
        log.info("request %s: dropped client-supplied %s", headers["x-request-id"],
                 ", ".join(removed))  # fmt: skip
    key_body = {"model": body.get("model"), "prompt": [body.get("instructions"), body.get("input")]}
    if endpoint != "responses":
        key_body = body
    try:
        response = await proxy.to_decode(prefix_key(key_body), path, body, (headers, out_headers))
    except UpstreamError as exc:
        response = Response(exc.body, exc.status, out_headers, "application/json")
    proxy.metrics.requests.inc((endpoint, str(response.status_code)))
    return response


async def abort_everywhere(proxy: Proxy, request: Request) -> Response:
    """``/inference/v1/abort_requests`` to every instance in rotation."""
    endpoint = "abort"
    headers, out_headers = stage_headers(request)
    body = await proxy.json_body(endpoint, request, out_headers)
    if isinstance(body, Response):
        return body
    urls = sorted({url for role in proxy.members.roles() for url in proxy.members.live(role)})
    content = orjson.dumps(body)
    timeout = proxy.config.connect_timeout_s * 2

    async def one(url: str) -> tuple[str, int | None, bytes]:
        try:
            resp = await proxy.client.post(
                url + ABORT_PATH, content=content, headers=headers, timeout=timeout
            )
        except Exception as exc:
            log.warning("abort: %s unreachable: %r", url, exc)
            return url, None, b""
        return url, resp.status_code, resp.content

    answers = await asyncio.gather(*(one(u) for u in urls))
    reached = [(status, data) for _, status, data in answers if status is not None]
    refused = [(status, data) for status, data in reached if status != 200]
    if refused:
        response = Response(refused[0][1], refused[0][0], out_headers, "application/json")
    elif not reached:
        message = "no instance could be reached to abort the requests"
        response = Response(error_body(502, message, None, "upstream_unreachable"), 502,
                            out_headers, "application/json")  # fmt: skip
    else:
        response = Response(b"", 200, out_headers)
    proxy.metrics.requests.inc((endpoint, str(response.status_code)))
    return response


def register(app: FastAPI, proxy: Proxy) -> None:
    """Add the forwarded routes to the proxy's ``app``."""

    def whole(path: str, endpoint: str) -> Any:
        async def handler(request: Request) -> Response:
            return await forward_whole(proxy, endpoint, path, request)

        return handler

    for path, endpoint in WHOLE_ROUTES.items():
        app.add_api_route(path, whole(path, endpoint), methods=["POST"])

    async def abort(request: Request) -> Response:
        return await abort_everywhere(proxy, request)

    app.add_api_route(ABORT_PATH, abort, methods=["POST"])
