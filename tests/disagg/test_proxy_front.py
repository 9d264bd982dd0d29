"""The proxy answers like the server: ``/health`` by role, OpenAI-shaped 404 / 405,
``--api-key``, vLLM's EPD proxy flag names, the server's access line, and the
server's routes that it forwards whole (``/v1/responses``, ``/tokenize``,
``/detokenize``, ``/v1/models``, ``/inference/v1/abort_requests``).

Real processes: a mock-engine server as the decode instance (10 ms a token, so a
stream can be aborted midway), and proxies in front of it (one of them also naming
an encode instance that is not running).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from ..helpers.processes import LOCAL, Proc, free_port

pytestmark = pytest.mark.slow

KEY = "proxy-key"
MODEL = "front-model"
AUTH = {"authorization": f"Bearer {KEY}"}


def _answering(proc: Proc) -> Proc:
    """``proc`` once its ``/health`` answers at all (200 or 503)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, proc.log()
        try:
            LOCAL.get(proc.url + "/health", timeout=1.0)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(proc.log())


@pytest.fixture(scope="module")
def decode() -> Iterator[Proc]:
    args = ["--mock-engine", "--mock-token-latency-ms", "10", "--served-model-name", MODEL]
    proc = Proc("serve", args, "decode").wait_ready()
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


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"model": MODEL, "prompt": "héllo"}),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/detokenize", {"model": MODEL, "tokens": [104, 105]}),
        ("/tokenize", {"prompt": 5}),
        ("/detokenize", {"tokens": "x"}),
    ],
)
def test_tokenizer_routes_forwarded(proxy: Proc, decode: Proc, path: str, body: dict) -> None:
    """The proxy answers as its decode instance does, errors included."""
    via = httpx.post(proxy.url + path, json=body, headers=AUTH, timeout=30)
    direct = httpx.post(decode.url + path, json=body, timeout=30)
    assert (via.status_code, via.json()) == (direct.status_code, direct.json())
    assert httpx.post(proxy.url + path, json=body).status_code == 401


def test_responses_forwarded(proxy: Proc) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
    whole = client.responses.create(model=MODEL, input="say something", max_output_tokens=5)
    assert whole.status == "incomplete" and whole.usage is not None
    assert whole.usage.output_tokens == 5 and whole.output_text
    events = [e.type for e in client.responses.create(
        model=MODEL, input="say something", max_output_tokens=3, stream=True
    )]  # fmt: skip
    assert events[0] == "response.created" and events[-1] == "response.incomplete"
    assert events.count("response.output_text.delta") == 3
    r = httpx.post(proxy.url + "/v1/responses", content=b"[1]", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_abort_forwarded(proxy: Proc) -> None:
    """An abort through the proxy ends a stream the proxy relays, mid-way."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 2000, "stream": True}  # fmt: skip
    finish, tokens = None, 0
    with (
        httpx.Client(timeout=30.0) as client,
        client.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                      headers={**AUTH, "x-request-id": "proxy-abort"}) as r,
    ):  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = orjson.loads(line[6:])["choices"][0]
            tokens += "role" not in choice["delta"]
            finish = choice["finish_reason"] or finish
            if tokens == 4:
                a = client.post(proxy.url + "/inference/v1/abort_requests",
                                json={"request_ids": ["proxy-abort"]}, headers=AUTH)  # fmt: skip
                assert (a.status_code, a.content) == (200, b""), a.text
    assert finish == "abort" and tokens < 2000
    bad = httpx.post(proxy.url + "/inference/v1/abort_requests", json={}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_ids"


def test_forwarded_routes_counted(proxy: Proc) -> None:
    httpx.post(proxy.url + "/tokenize", json={"prompt": "a"}, headers=AUTH)
    text = httpx.get(proxy.url + "/metrics", headers=AUTH).text
    assert re.search(r'^ec_frontend_proxy_requests_total\{endpoint="tokenize",status="200"\} [1-9]',
                     text, re.MULTILINE), text  # fmt: skip
