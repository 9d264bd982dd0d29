"""The proxy answers like the server: ``/health`` by role, OpenAI-shaped 404 / 405,
``--api-key``, vLLM's EPD proxy flag names, and the server's access line.

Real processes: a mock-engine server as the decode instance, and proxies in front
of it (one of them also naming an encode instance that is not running).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from ..helpers.processes import Proc, free_port

pytestmark = pytest.mark.slow

KEY = "proxy-key"
AUTH = {"authorization": f"Bearer {KEY}"}


def _answering(proc: Proc) -> Proc:
    """``proc`` once its ``/health`` answers at all (200 or 503)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, proc.log()
        try:
            httpx.get(proc.url + "/health", timeout=1.0)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(proc.log())


@pytest.fixture(scope="module")
def decode() -> Iterator[Proc]:
    proc = Proc("serve", ["--mock-engine"], "decode").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def proxy(decode: Proc) -> Iterator[Proc]:
    args = ["--decode-servers-urls", decode.url, "--prefill-servers-urls", "none",
            "--api-key", KEY, "--log-level", "info"]  # fmt: skip
    proc = _answering(Proc("proxy", args, "proxy"))
    yield proc
    proc.stop()


def test_health_and_routes(proxy: Proc) -> None:
    assert httpx.get(proxy.url + "/health").status_code == 200
    r = httpx.get(proxy.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "route_not_found"
    r = httpx.get(proxy.url + "/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_api_key(proxy: Proc) -> None:
    r = httpx.get(proxy.url + "/v1/models")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(proxy.url + "/v1/models", headers=AUTH).status_code == 200


def test_access_line(proxy: Proc) -> None:
    httpx.get(proxy.url + "/v1/nothing", headers={**AUTH, "x-request-id": "proxy-404"})
    deadline = time.monotonic() + 10
    pattern = (
        r'^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO ec_frontend\.access: \S+ "GET /v1/nothing" '
        r"404 [\d.]+ ms rid=proxy-404 code=route_not_found param=-$"
    )
    while not re.search(pattern, proxy.output(), re.MULTILINE):
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.1)


def test_health_by_role(decode: Proc) -> None:
    """No decode instance: 503. No encoder: 200, saying so (decode encodes itself)."""
    dead = f"http://127.0.0.1:{free_port()}"
    no_decode = Proc("proxy", ["--decode-servers-urls", f"{dead},{dead}"], "no-decode")
    no_encoder = Proc(
        "proxy", ["--encode-servers-urls", dead, "--decode-servers-urls", decode.url], "no-e"
    )
    try:
        r = httpx.get(_answering(no_decode).url + "/health", timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_healthy_instance"
        assert r.json()["error"]["message"] == "no healthy instance for: decode"
        r = httpx.get(_answering(no_encoder).url + "/health", timeout=10)
        assert (r.status_code, r.json()) == (200, {"status": "ok", "encode": "unreachable"})
    finally:
        no_decode.stop()
        no_encoder.stop()
