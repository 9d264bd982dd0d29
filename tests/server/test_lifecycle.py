"""Request lifecycle on a mock engine that takes time per token.

A client that leaves mid-stream (or mid non-stream request) gets its engine
request aborted and everything it held freed; SIGTERM drains: new requests get
503 while those in flight finish, then the process exits 0.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from .conftest import ServerProcess

pytestmark = pytest.mark.slow

TOKEN_MS = 20


@pytest.fixture(scope="module")
def slow_server() -> Iterator[ServerProcess]:
    server = ServerProcess(["--mock-engine", "--mock-token-latency-ms", str(TOKEN_MS)])
    yield server
    assert server.stop() == 0


def chat(stream: bool, max_tokens: int, image: bool = False) -> bytes:
    content: object = "tell me a long story"
    if image:
        from .conftest import png_data_url

        content = [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": png_data_url()}},
        ]
    return orjson.dumps(
        {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    )


IDLE = {
    "ec_frontend_num_requests_running": 0.0,
    "ec_frontend_kv_blocks_used": 0.0,
    "ec_frontend_encoder_cache_refs": 0.0,
    "ec_frontend_http_requests_in_flight": 0.0,
}


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if all(m[k] == v for k, v in IDLE.items()) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_engine_resources(slow_server: ServerProcess, stream: bool) -> None:
    before = slow_server.metrics()
    aborted = before.get("ec_frontend_requests_aborted_total", 0.0)
    with httpx.Client(base_url=slow_server.url, timeout=30) as client:
        if stream:
            with client.stream(
                "POST", "/v1/chat/completions", content=chat(True, 2000, image=True)
            ) as r:
                got = 0
                for line in r.iter_lines():
                    got += line.startswith("data: ")
                    if got >= 5:
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(
                    "/v1/chat/completions", content=chat(False, 2000, image=True), timeout=0.5
                )
    m = wait_idle(slow_server)
    assert {k: m[k] for k in IDLE} == IDLE
    assert m["ec_frontend_requests_aborted_total"] == aborted + 1
    assert m["ec_frontend_encoder_items_computed_total"] >= 1


def test_metrics_exposition(slow_server: ServerProcess) -> None:
    httpx.post(slow_server.url + "/v1/completions", content=b'{"prompt": "ab", "max_tokens": 3}')
    text = httpx.get(slow_server.url + "/metrics").text
    assert "# TYPE ec_frontend_requests_total counter" in text
    assert 'ec_frontend_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "# TYPE ec_frontend_time_to_first_token_seconds histogram" in text
    assert "# TYPE ec_frontend_inter_token_latency_seconds histogram" in text
    for name in (
        "encoder_items_computed_total",
        "encoder_cache_hits_total",
        "ec_items_loaded_total",
        "ec_items_saved_total",
        "ec_load_fallbacks_total",
        "prompt_tokens_computed_total",
        "kv_tokens_received_total",
        "generation_tokens_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage",
        "encoder_cache_usage",
    ):
        assert f"\nec_frontend_{name} " in text, name


def test_sigterm_drains_then_exits_zero() -> None:
    server = ServerProcess(["--mock-engine", "--mock-token-latency-ms", str(TOKEN_MS)])
    results: dict[str, object] = {}

    def long_request() -> None:
        r = httpx.post(
            server.url + "/v1/completions",
            content=b'{"prompt": "drain", "max_tokens": 40}',
            timeout=30,
        )
        results["status"] = r.status_code
        results["finish"] = r.json()["choices"][0]["finish_reason"]

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.2)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    refused = httpx.post(
        server.url + "/v1/completions", content=b'{"prompt": "new", "max_tokens": 1}'
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "draining"
    assert httpx.get(server.url + "/health").status_code == 503
    t.join(30)
    assert results == {"status": 200, "finish": "length"}
    assert server.proc.wait(30) == 0
    server.stop()


def test_sigterm_aborts_after_drain_timeout() -> None:
    server = ServerProcess(
        ["--mock-engine", "--mock-token-latency-ms", str(TOKEN_MS), "--drain-timeout", "0.3"]
    )
    results: dict[str, object] = {}

    def long_stream() -> None:
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            content=b'{"prompt": "x", "max_tokens": 3000, "stream": true}',
            timeout=30,
        ) as r:
            results["lines"] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    t = threading.Thread(target=long_stream)
    t.start()
    time.sleep(0.3)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert time.monotonic() - started < 10
    t.join(30)
    lines = results["lines"]
    assert isinstance(lines, list) and lines[-1] == "data: [DONE]"
    final = orjson.loads(lines[-2][6:])
    assert final["choices"][0]["finish_reason"] == "abort"
    server.stop()
