"""The proxy's answers when an exchange fails outside httpx's own errors, or the proxy
itself fails: the next encoder is tried, and nothing comes back as a bare 500.

A dying encoder's socket can fail under httpx with an exception httpx does not map to
its ``HTTPError`` family; it cannot be produced on demand with real processes, so the
upstream instances here are an ``httpx.MockTransport`` whose encoder ``e1`` raises such an
exception (the real-process version of the scenario is
``tests/disagg/test_faults.py::test_encoder_killed_mid_run_requests_still_answered``).
An instance that cannot load an item the request only references gets the client's
body (image inline) once more; other errors are passed back as they are.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import orjson
from ec_frontend.entrypoints.proxy.app import ProxyConfig, build_proxy_app

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "what"}, IMAGE]}],
    "max_tokens": 4,
}
ENCODER_PARAMS = {"f" * 64: {"num_tokens": 4, "peer_host": "127.0.0.1"}}


def upstreams(seen: dict[str, list[Any]]) -> httpx.MockTransport:
    """``e1`` fails below httpx, ``e2`` encodes, ``d`` answers and records its body."""

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        seen.setdefault(host, []).append(json.loads(request.content))
        if host == "e1":
            raise ConnectionResetError(104, "Connection reset by peer")
        if host == "e2":
            return httpx.Response(200, json={"ec_transfer_params": ENCODER_PARAMS})
        return httpx.Response(200, json={"object": "chat.completion", "choices": []})

    return httpx.MockTransport(handle)


def post(app: Any, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        # As a server would: the app's answer, not the exception Starlette re-raises
        # after sending it (for the server to log).
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.post("/v1/chat/completions", json=body)

    return asyncio.run(go())


def proxy_app(seen: dict[str, list[Any]]) -> tuple[Any, Any]:
    # Round-robin, so that the first item goes to ``e1`` first.
    config = ProxyConfig(
        encode_urls=("http://e1", "http://e2"),
        decode_urls=("http://d",),
        encoder_routing="round-robin",
    )
    app, proxy = build_proxy_app(config)
    proxy.client = httpx.AsyncClient(transport=upstreams(seen))
    return app, proxy


def test_an_encoder_failing_outside_httpx_errors_is_skipped() -> None:
    seen: dict[str, list[Any]] = {}
    app, proxy = proxy_app(seen)
    r = post(app, BODY)
    assert r.status_code == 200, r.text
    assert len(seen["e1"]) == 1 and len(seen["e2"]) == 1
    assert seen["d"][0]["ec_transfer_params"] == ENCODER_PARAMS
    assert proxy.metrics.encoder_retries.get() == 1
    assert proxy.metrics.encoder_requests.get(("failed",)) == 1
    assert "x-ec-fallback" not in r.headers


def test_decode_failing_outside_httpx_errors_is_a_502() -> None:
    seen: dict[str, list[Any]] = {}
    app, proxy = proxy_app(seen)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise ConnectionResetError(104, "Connection reset by peer")

    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    config = ProxyConfig(encode_urls=(), decode_urls=("http://d",))
    proxy.config = config
    r = post(app, BODY)
    assert r.status_code == 502, r.text
    error = orjson.loads(r.content)["error"]
    assert error["code"] == "upstream_unreachable"
    assert "http://d" in error["message"] and "ConnectionResetError" in error["message"]


def test_a_failure_of_the_proxy_itself_is_an_openai_style_500() -> None:
    seen: dict[str, list[Any]] = {}
    app, proxy = proxy_app(seen)

    async def broken(*args: Any) -> Any:
        raise RuntimeError("route table corrupted")

    proxy._route = broken
    r = post(app, BODY)
    assert r.status_code == 500
    error = orjson.loads(r.content)["error"]
    assert error["code"] == "proxy_error"
    assert "route table corrupted" in error["message"]


def test_prefill_that_cannot_load_an_encoded_item_gets_the_image_inline() -> None:
    """E+P+D: prefill answers that the encoder's item is gone; the proxy sends prefill
    the client's body (image inline, no ec params) and goes on to decode."""
    seen: dict[str, list[Any]] = {}
    kv = {"do_remote_prefill": True, "remote_request_id": "r"}

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        body = json.loads(request.content)
        seen.setdefault(host, []).append(body)
        if host == "e2":
            return httpx.Response(200, json={"ec_transfer_params": ENCODER_PARAMS})
        if host == "p" and "ec_transfer_params" in body:
            error = {"message": "EC transfer of media item f failed", "type": "upstream_error",
                     "param": None, "code": "ec_item_unavailable"}  # fmt: skip
            return httpx.Response(502, json={"error": error})
        if host == "p":
            return httpx.Response(200, json={"kv_transfer_params": kv})
        return httpx.Response(200, json={"object": "chat.completion", "choices": []})

    config = ProxyConfig(
        encode_urls=("http://e2",), prefill_urls=("http://p",), decode_urls=("http://d",)
    )
    app, proxy = build_proxy_app(config)
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    r = post(app, BODY)
    assert r.status_code == 200, r.text
    assert r.headers["x-ec-fallback"] == "local-encode"
    first, second = seen["p"]
    assert first["ec_transfer_params"] == ENCODER_PARAMS
    assert "ec_transfer_params" not in second
    assert second["messages"] == BODY["messages"]
    assert seen["d"][0]["kv_transfer_params"] == kv
    assert proxy.metrics.reference_retries.get() == 1


def test_other_errors_are_not_retried() -> None:
    seen: dict[str, list[Any]] = {}

    def handle(request: httpx.Request) -> httpx.Response:
        seen.setdefault(request.url.host, []).append(json.loads(request.content))
        if request.url.host == "e2":
            return httpx.Response(200, json={"ec_transfer_params": ENCODER_PARAMS})
        error = {"message": "bad", "type": "invalid_request_error", "param": None,
                 "code": "invalid_input"}  # fmt: skip
        return httpx.Response(400, json={"error": error})

    config = ProxyConfig(encode_urls=("http://e2",), decode_urls=("http://d",))
    app, proxy = build_proxy_app(config)
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    r = post(app, BODY)
    assert r.status_code == 400 and len(seen["d"]) == 1
    assert proxy.metrics.reference_retries.get() == 0


def test_an_instance_that_fails_requests_is_retried_elsewhere_and_evicted() -> None:
    """``d1`` answers every request with a 500 (its ``/health`` would say 200): each
    such request goes on to ``d2``, and ``d1`` leaves the rotation after
    ``fail_threshold`` failures in a row. A 503 from the last instance is passed back."""
    seen: dict[str, int] = {}

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        seen[host] = seen.get(host, 0) + 1
        if host == "d1":
            error = {"message": "engine failed", "type": "internal_error", "param": None,
                     "code": "internal_error"}  # fmt: skip
            return httpx.Response(500, json={"error": error})
        return httpx.Response(200, json={"object": "chat.completion", "choices": []})

    text = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    config = ProxyConfig((), decode_urls=("http://d1", "http://d2"), routing="round-robin")
    app, proxy = build_proxy_app(config)
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    answers = [post(app, text).status_code for _ in range(8)]
    assert answers == [200] * 8
    threshold = config.membership.fail_threshold
    assert seen["d1"] == threshold and seen["d2"] == 8
    assert proxy.members.evicted(proxy._decode_role()) == ["http://d1"]
    assert proxy.metrics.reroutes.get(("prefill_decode",)) == threshold

    def busy(request: httpx.Request) -> httpx.Response:
        error = {"message": "draining", "type": "server_error", "param": None,
                 "code": "draining"}  # fmt: skip
        return httpx.Response(503, json={"error": error})

    alone = ProxyConfig((), decode_urls=("http://d",))
    app, proxy = build_proxy_app(alone)
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(busy))
    r = post(app, text)
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
