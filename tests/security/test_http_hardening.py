"""HTTP hardening (issue 15, M5, M6 and the Low items) on real servers and raw sockets.

Head and URL size (431 / 414), head and body deadlines (408), idle connections
closed, a connection cap that 1,100 idle connections cannot turn into an
outage, a SIGTERM drain that ends on time while a client trickles its body, a
mid-upload disconnect counted as 499 (never 500), ``/metrics`` and the docs
behind the API key, and the proxy's own limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from ec_frontend.engine.mock import MockEngine, MockEngineConfig
from ec_frontend.entrypoints.openai.server import ServerConfig, build_app

from ..helpers.processes import LOCAL, Proc
from .test_limits import SMALL_PNG, chat_body, data_url, rss_kib

pytestmark = pytest.mark.slow

API_KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HEADER_LIMIT = 16 * 1024
URL_LIMIT = 4 * 1024
CONNECTIONS = 100


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    """A mock-engine server with small HTTP limits and short deadlines."""
    proc = Proc(
        "serve",
        [
            "--mock-engine", "--api-key", API_KEY, "--public-metrics",
            "--max-header-bytes", str(HEADER_LIMIT), "--max-url-bytes", str(URL_LIMIT),
            "--header-timeout", "1", "--body-timeout", "1",
        ],
        "hardened server",
    ).wait_ready()  # fmt: skip
    yield proc
    output = proc.output()
    assert proc.stop() == 0
    assert "unhandled error" not in output and "Traceback" not in output, output


def refused(proc: Proc, reason: str) -> float:
    key = f'ec_frontend_http_connections_refused_total{{reason="{reason}"}}'
    return proc.metrics().get(key, 0.0)


def requests_total(proc: Proc, endpoint: str, status: int) -> float:
    key = f'ec_frontend_requests_total{{endpoint="{endpoint}",status="{status}"}}'
    return proc.metrics().get(key, 0.0)


def assert_healthy(proc: Proc) -> None:
    assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
    r = httpx.post(
        proc.url + "/v1/completions",
        content=b'{"prompt": "still here", "max_tokens": 2}',
        headers={**AUTH, "content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 200, r.text


def raw_exchange(proc: Proc, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", proc.port), timeout=timeout) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
        return read_until_closed(s)


def read_until_closed(s: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def error_code(response: bytes) -> str:
    body = response.split(b"\r\n\r\n", 1)[1]
    return str(orjson.loads(body)["error"]["code"])


# ---- head and URL size ---------------------------------------------------------------


def test_header_over_limit_is_431(server: Proc) -> None:
    before = refused(server, "header_too_large")
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEADER_LIMIT + 10) + b"\r\n\r\n"
    response = raw_exchange(server, head)
    assert status_of(response) == 431
    assert error_code(response) == "request_header_fields_too_large"
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(300))
    response = raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert status_of(response) == 431
    assert refused(server, "header_too_large") == before + 2
    assert_healthy(server)


def test_huge_header_costs_neither_time_nor_memory(server: Proc) -> None:
    """The M5 request (a header of hundreds of MB) is cut off after the limit: the
    server closes the connection instead of buffering and parsing it."""
    for _ in range(3):
        assert_healthy(server)
    baseline = rss_kib(server.proc.pid)
    started = time.monotonic()
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        block = b"a" * 65536
        try:
            while sent < 256 * 1024 * 1024:
                s.sendall(block)
                sent += len(block)
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert sent < 16 * 1024 * 1024, f"the server read {sent} bytes of one header"
    assert time.monotonic() - started < 10
    assert_healthy(server)
    assert rss_kib(server.proc.pid) <= baseline * 1.10


def test_invalid_http_is_an_openai_style_400(server: Proc) -> None:
    before = refused(server, "invalid_http")
    response = raw_exchange(server, b"NOT AN HTTP REQUEST\r\n\r\n")
    assert status_of(response) == 400
    assert error_code(response) == "invalid_http"
    assert refused(server, "invalid_http") == before + 1
    assert_healthy(server)


def test_url_over_limit_is_414(server: Proc) -> None:
    before = refused(server, "url_too_long")
    r = httpx.get(server.url + "/health?q=" + "a" * (URL_LIMIT + 1), timeout=10)
    assert r.status_code == 414
    assert r.json()["error"]["code"] == "uri_too_long"
    assert httpx.get(server.url + "/health?q=" + "a" * 100, timeout=10).status_code == 200
    assert refused(server, "url_too_long") == before + 1


# ---- deadlines --------------------------------------------------------------------


def test_connection_that_never_sends_is_closed(server: Proc) -> None:
    before = refused(server, "idle_timeout")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        started = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server, nothing sent
        assert 0.5 < time.monotonic() - started < 6
    assert refused(server, "idle_timeout") >= before + 1


def test_slow_head_is_408(server: Proc) -> None:
    """A head that never completes (slowloris) is answered 408 after --header-timeout."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.5)
        s.sendall(b"X-Slow: 1\r\n")
        started = time.monotonic()
        response = read_until_closed(s)
        assert time.monotonic() - started < 6
    assert status_of(response) == 408
    assert error_code(response) == "request_timeout"


def test_slow_body_is_408(server: Proc) -> None:
    """A body that does not arrive within --body-timeout is answered 408."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n"
    )
    before = requests_total(server, "/v1/completions", 408)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + b'{"prompt": ')
        started = time.monotonic()
        response = read_until_closed(s)
        assert time.monotonic() - started < 6
    assert status_of(response) == 408
    assert error_code(response) == "body_timeout"
    assert requests_total(server, "/v1/completions", 408) == before + 1
    assert_healthy(server)


# ---- connections ------------------------------------------------------------------


def test_idle_connections_cannot_take_the_server_offline() -> None:
    """1,100 idle connections against a cap of 100 (and a head timeout long enough to
    keep them all): each new connection closes the longest-waiting idle one, so clients that
    send requests are still served."""
    proc = Proc(
        "serve",
        ["--mock-engine", "--api-key", API_KEY, "--public-metrics", "--header-timeout", "60",
         "--max-connections", str(CONNECTIONS)],
        "capped server",
    ).wait_ready()  # fmt: skip
    idle: list[socket.socket] = []
    try:
        for _ in range(1100):
            idle.append(socket.create_connection(("127.0.0.1", proc.port), timeout=10))
        started = time.monotonic()
        for _ in range(3):
            assert_healthy(proc)
        assert time.monotonic() - started < 10
        assert refused(proc, "evicted_idle") >= 1000
    finally:
        for s in idle:
            s.close()
    assert_healthy(proc)
    assert proc.stop() == 0


def test_cap_with_every_connection_busy_is_503_and_keep_alive_ends() -> None:
    """With two connections allowed and both streaming, a third is answered 503
    (``Retry-After``) and closed; an idle keep-alive connection is closed after
    --keep-alive-timeout."""
    proc = Proc(
        "serve",
        ["--mock-engine", "--mock-token-latency-ms", "100", "--max-connections", "2",
         "--keep-alive-timeout", "1"],
        "two-connection server",
    ).wait_ready()  # fmt: skip
    body = b'{"prompt": "abc", "max_tokens": 30, "stream": true}'
    try:
        with (
            httpx.Client(base_url=proc.url, timeout=30) as a,
            httpx.Client(base_url=proc.url, timeout=30) as b,
        ):
            streams = [c.stream("POST", "/v1/completions", content=body) for c in (a, b)]
            responses = [s.__enter__() for s in streams]
            try:
                assert [r.status_code for r in responses] == [200, 200]
                refused_response = raw_exchange(proc, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert status_of(refused_response) == 503
                assert error_code(refused_response) == "too_many_connections"
                assert b"retry-after: 1" in refused_response.lower()
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
        deadline = time.monotonic() + 10  # until the server has seen both clients leave
        while LOCAL.get(proc.url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert refused(proc, "connection_cap") >= 1
        with socket.create_connection(("127.0.0.1", proc.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            while not first.endswith(b'{"status":"ok"}'):
                first += s.recv(65536)
            assert status_of(first) == 200
            started = time.monotonic()
            assert s.recv(65536) == b""  # closed by the keep-alive timeout
            assert 0.5 < time.monotonic() - started < 6
    finally:
        assert proc.stop() == 0


def test_mid_upload_disconnect_is_a_quiet_499(server: Proc) -> None:
    """A client that hangs up halfway through its body: 499 in the metrics, no 500,
    nothing logged as an unhandled error."""
    endpoint = "/v1/chat/completions"
    before = requests_total(server, endpoint, 499)
    errors = requests_total(server, endpoint, 500)
    body = orjson.dumps(chat_body([data_url(SMALL_PNG)]))
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + body[: len(body) // 2])
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while requests_total(server, endpoint, 499) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_total(server, endpoint, 499) == before + 1
    assert requests_total(server, endpoint, 500) == errors
    assert "unhandled error" not in server.output()
    assert "Traceback" not in server.output()
    assert_healthy(server)


def test_sigterm_drain_ends_on_time_with_a_trickling_client() -> None:
    """A client sending its body one byte every 0.2 s does not hold the drain past
    --drain-timeout; the process exits 0 and logs no error."""
    proc = Proc("serve", ["--mock-engine", "--drain-timeout", "3"], "draining server")
    proc.wait_ready()
    stop = threading.Event()

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", proc.port), timeout=30) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{"
            )
            try:
                while not stop.is_set():
                    s.sendall(b" ")
                    time.sleep(0.2)
            except OSError:
                pass

    client = threading.Thread(target=trickle)
    client.start()
    try:
        time.sleep(0.5)
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(30)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        client.join(10)
    output = proc.output()
    proc.stop()
    assert code == 0, output
    assert elapsed < 3 + 1.5, f"drain took {elapsed:.1f} s with --drain-timeout 3"
    assert "unhandled error" not in output and "Traceback" not in output, output


# ---- auth on /metrics and the docs ---------------------------------------------------------


def _status(app: Any, path: str, headers: dict[str, str]) -> int:
    async def get() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get(path, headers=headers)).status_code

    return asyncio.run(get())


@pytest.mark.parametrize(
    ("flags", "path", "with_key", "status"),
    [
        ({}, "/metrics", False, 401),
        ({}, "/metrics", True, 200),
        ({}, "/docs", False, 401),
        ({}, "/redoc", False, 401),
        ({}, "/openapi.json", False, 401),
        ({}, "/docs", True, 200),
        ({}, "/health", False, 200),
        ({"public_metrics": True}, "/metrics", False, 200),
        ({"public_metrics": True}, "/docs", False, 401),
        ({"public_docs": True}, "/docs", False, 200),
        ({"public_docs": True}, "/redoc", False, 200),
        ({"public_docs": True}, "/metrics", False, 401),
    ],
)
def test_metrics_and_docs_behind_the_key(
    flags: dict[str, bool], path: str, with_key: bool, status: int
) -> None:
    engine = MockEngine(MockEngineConfig(model="m"))
    config = ServerConfig(
        model_names=("m",), max_model_len=128, api_key=API_KEY, offload_processing=False, **flags
    )
    app, _ = build_app(engine, config)
    assert _status(app, path, AUTH if with_key else {}) == status


def test_no_key_keeps_everything_public() -> None:
    engine = MockEngine(MockEngineConfig(model="m"))
    app, _ = build_app(engine, ServerConfig(model_names=("m",), max_model_len=128))
    for path in ("/metrics", "/docs", "/redoc"):
        assert _status(app, path, {}) == 200, path


# ---- the proxy's limits (M6) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def proxied() -> Iterator[tuple[Proc, Proc]]:
    """A proxy (1 MB bodies, 4 images, 2 encoder requests at a time) in front of a mock
    instance that is both its encoder and its decoder and takes 300 ms per token."""
    backend = Proc("serve", ["--mock-engine", "--mock-token-latency-ms", "300"], "backend")
    backend.wait_ready()
    proxy = Proc(
        "proxy",
        ["--encode", backend.url, "--decode", backend.url, "--max-body-bytes", "1000000",
         "--max-media-items", "4", "--max-encoder-fanout", "2", "--header-timeout", "1",
         "--max-header-bytes", str(HEADER_LIMIT)],
        "proxy",
    ).wait_ready()  # fmt: skip
    yield proxy, backend
    proxy.stop()
    assert backend.stop() == 0


def distinct_images(count: int) -> list[str]:
    """``count`` data URLs of one small PNG with distinct bytes (after its end chunk),
    so each is a separate media item to the proxy."""
    return [data_url(SMALL_PNG + b"%d" % i) for i in range(count)]


def encoder_requests(backend: Proc) -> float:
    return requests_total(backend, "/v1/chat/completions", 200)


def test_proxy_body_limit(proxied: tuple[Proc, Proc]) -> None:
    proxy, _ = proxied
    big = {"messages": [{"role": "user", "content": "x" * 2_000_000}]}
    r = httpx.post(proxy.url + "/v1/chat/completions", content=orjson.dumps(big), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: cut off while streaming
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'

    r = httpx.post(proxy.url + "/v1/chat/completions", content=chunks(), timeout=30)
    assert r.status_code == 413
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200


def test_proxy_announced_huge_body_costs_nothing(proxied: tuple[Proc, Proc]) -> None:
    """The M6 body (200 MiB) is refused from its Content-Length, unread."""
    proxy, _ = proxied
    for _ in range(3):
        assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200
    baseline = rss_kib(proxy.proc.pid)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(200 * 1024 * 1024).encode() + b"\r\n\r\n"
    )
    response = raw_exchange(proxy, head + b'{"messages": [' + b" " * 65536)
    assert status_of(response) == 413
    assert error_code(response) == "request_too_large"
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200
    assert rss_kib(proxy.proc.pid) <= baseline * 1.10


def test_proxy_media_items_refused_before_any_encoder_request(
    proxied: tuple[Proc, Proc],
) -> None:
    """The M6 request (many distinct images) reaches no encoder."""
    proxy, backend = proxied
    before = encoder_requests(backend)
    images = distinct_images(10)
    body = chat_body(images, max_tokens=1)
    r = httpx.post(proxy.url + "/v1/chat/completions", content=orjson.dumps(body), timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "too_many_media_items"
    assert r.json()["error"]["param"] == "messages"
    assert encoder_requests(backend) == before


def test_proxy_counts_references_before_any_encoder_request(
    proxied: tuple[Proc, Proc],
) -> None:
    """Issue 28: three images to encode and two ``image_embeds`` references are five
    media items against ``--max-media-items 4``: refused before any encoder request
    (before, the three were encoded and the instance refused the request after)."""
    proxy, backend = proxied
    before = encoder_requests(backend)
    body = chat_body(distinct_images(3), max_tokens=1)
    reference = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]},
                 "uuid": "ref"}  # fmt: skip
    body["messages"][0]["content"] += [reference, {**reference, "uuid": "ref-2"}]
    r = httpx.post(proxy.url + "/v1/chat/completions", content=orjson.dumps(body), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "too_many_media_items" and error["param"] == "messages"
    assert "5 media items" in error["message"]
    generate = {"token_ids": [104] * 8, "sampling_params": {"max_tokens": 1},
                "features": {"mm_hashes": ["a" * 64] * 5,
                             "mm_placeholders": [{"offset": 0, "length": 1}] * 5}}  # fmt: skip
    r = httpx.post(proxy.url + "/inference/v1/generate", json=generate, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "features.mm_hashes"
    assert encoder_requests(backend) == before
    assert requests_total(backend, "/inference/v1/generate", 400) == 0


def test_proxy_encoder_fanout_is_bounded(proxied: tuple[Proc, Proc]) -> None:
    """Four distinct images with at most two encoder requests at a time take two rounds
    of the backend's 300 ms, never one."""
    proxy, backend = proxied
    images = distinct_images(4)
    before = encoder_requests(backend)
    body = chat_body(images, max_tokens=1)
    started = time.monotonic()
    r = httpx.post(proxy.url + "/v1/chat/completions", content=orjson.dumps(body), timeout=60)
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert encoder_requests(backend) == before + 4 + 1  # four encoder requests, one decode
    assert elapsed >= 2 * 0.3 + 0.3 - 0.05, elapsed  # two encoder rounds, then decode


def test_proxy_head_limits(proxied: tuple[Proc, Proc]) -> None:
    proxy, _ = proxied
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEADER_LIMIT + 10) + b"\r\n\r\n"
    assert status_of(raw_exchange(proxy, head)) == 431
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        assert s.recv(1024) == b""  # an idle connection is closed after --header-timeout
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200
