"""Issue 28: no request stalls the others, every route but the probes needs the key,
admission counts the fan-out, aborts are exact and reach the whole group, and a
generate ``request_id`` follows the ``X-Request-Id`` rules.

Real server processes on loopback (``--mock-engine``); one server is shared by the
tests of this module that only read it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from ec_frontend.metrics import parse_text

from ..helpers.processes import Proc

pytestmark = pytest.mark.slow

API_KEY = "guard-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
MODEL = "mock-model"
#: The mock server's ``--max-model-len``; ``/detokenize`` takes at most 16x as many ids.
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    """A mock server with an API key, 20 ms per engine step and an engine-request
    limit of 512."""
    proc = Proc(
        "serve",
        ["--mock-engine", "--api-key", API_KEY, "--served-model-name", MODEL,
         "--max-model-len", str(MAX_MODEL_LEN), "--mock-token-latency-ms", "20",
         "--max-engine-requests", "512"],
        "server",
    ).wait_ready()  # fmt: skip
    yield proc
    assert proc.stop() == 0


def metrics(server: Proc) -> dict[str, float]:
    """``/metrics`` of ``server`` (behind the key here)."""
    return parse_text(httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text)


def settled(server: Proc, name: str, expected: float, timeout_s: float = 10.0) -> float:
    """``ec_frontend_<name>`` once it equals ``expected`` or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    value = metrics(server).get("ec_frontend_" + name, 0.0)
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.05)
        value = metrics(server).get("ec_frontend_" + name, 0.0)
    return value


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


# ---- auth: every route but /health and /ping ---------------------------------------------

GEN = {"max_tokens": 1}
#: ``(method, path, body)`` of every route the server has, with a body that succeeds.
PROTECTED: list[tuple[str, str, Any]] = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", chat(max_tokens=1)),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 1}),
    ("POST", "/inference/v1/generate", {"token_ids": [104, 105], "sampling_params": GEN}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [104, 105]}),
    ("GET", "/version", None),
    ("POST", "/inference/v1/abort_requests", {"request_ids": ["nobody"]}),
    ("GET", "/metrics", None),  # no --public-metrics
    ("GET", "/docs", None),  # no --public-docs
    ("GET", "/redoc", None),
    ("GET", "/openapi.json", None),
]
PUBLIC: list[tuple[str, str]] = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_route_needs_the_key(server: Proc, method: str, path: str, body: Any) -> None:
    url = server.url + path
    r = httpx.request(method, url, json=body, timeout=30)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    wrong = {"authorization": "Bearer not-the-key"}
    assert httpx.request(method, url, json=body, headers=wrong, timeout=30).status_code == 401
    r = httpx.request(method, url, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("method", "path"), PUBLIC, ids=[f"{m} {p}" for m, p in PUBLIC])
def test_probe_is_public(server: Proc, method: str, path: str) -> None:
    assert httpx.request(method, server.url + path, timeout=30).status_code == 200


def test_unknown_route_needs_the_key(server: Proc) -> None:
    """Without the key nobody learns which routes exist."""
    assert httpx.get(server.url + "/no-such-route", timeout=30).status_code == 401
    r = httpx.get(server.url + "/no-such-route", headers=AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found"


# ---- generate request_id: the X-Request-Id rules ------------------------------------------


@pytest.mark.parametrize(
    "request_id",
    ["x" * 257, "x" * 1_000_000, "a\nb", "a b", "evil\u202eid", "é", "", "tab\tid"],
    ids=["257-chars", "1MB", "newline", "space", "rtl-override", "non-ascii", "empty", "tab"],
)
def test_generate_request_id_is_checked(server: Proc, request_id: str) -> None:
    body = {"token_ids": [104, 105], "sampling_params": {"max_tokens": 1},
            "request_id": request_id}  # fmt: skip
    r = httpx.post(server.url + "/inference/v1/generate", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "request_id" and error["code"] == "invalid_value"
    assert request_id not in r.text or request_id == ""  # never echoed
    assert len(r.content) < 1000


def test_generate_request_id_within_the_rules_is_echoed(server: Proc) -> None:
    rid = "gen-" + "~" * 252
    body = {"token_ids": [104, 105], "sampling_params": {"max_tokens": 1}, "request_id": rid}
    r = httpx.post(server.url + "/inference/v1/generate", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["request_id"] == rid


# ---- the event loop: client-sized work never blocks /health -------------------------------


def worst_health_latency_while(work: Callable[[], Any], server: Proc) -> tuple[float, int, Any]:
    """Run ``work`` in a thread and poll ``/health`` (one kept-alive connection) until it
    ends: ``(the slowest answer in seconds, how many answers, what work returned)``."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    worst, polls = 0.0, 0
    with httpx.Client(timeout=10) as client:
        assert client.get(server.url + "/health").status_code == 200  # connected
        thread.start()
        while thread.is_alive():
            started = time.perf_counter()
            assert client.get(server.url + "/health").status_code == 200
            worst = max(worst, time.perf_counter() - started)
            polls += 1
            time.sleep(0.005)
    thread.join()
    return worst, polls, result[0]


def detokenize_raw(server: Proc, body: bytes) -> httpx.Response:
    headers = {**AUTH, "content-type": "application/json"}
    return httpx.post(server.url + "/detokenize", content=body, headers=headers, timeout=120)


@pytest.mark.serial
def test_detokenize_of_10m_ids_leaves_health_responsive(server: Proc) -> None:
    """10M ids (20 MB): refused by the documented cap without being parsed, while
    ``/health`` keeps answering within 0.2 s."""
    body = b'{"tokens": [' + b"7," * (10_000_000 - 1) + b"7]}"
    worst, polls, r = worst_health_latency_while(lambda: detokenize_raw(server, body), server)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "too_many_tokens" and error["param"] == "tokens"
    assert str(16 * MAX_MODEL_LEN) in error["message"] and "--max-prompt-chars" in error["message"]
    assert polls >= 3, polls
    assert worst < 0.2, worst


@pytest.mark.serial
def test_detokenize_at_the_cap_runs_off_the_loop(server: Proc) -> None:
    """Eight requests of the most ids allowed (65,536 each) are decoded on the
    processing pool while ``/health`` keeps answering within 0.2 s."""
    cap = 16 * MAX_MODEL_LEN
    ids = [0x4E00 + i % 20000 for i in range(cap)]
    body = orjson.dumps({"tokens": ids})
    over = orjson.dumps({"tokens": [*ids, 65]})

    def burst() -> list[httpx.Response]:
        responses: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: responses.append(detokenize_raw(server, body)))
                   for _ in range(8)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return responses

    worst, polls, responses = worst_health_latency_while(burst, server)
    assert [r.status_code for r in responses] == [200] * 8
    assert responses[0].json()["prompt"] == "".join(chr(i) for i in ids)
    assert polls >= 1 and worst < 0.2, (polls, worst)
    r = detokenize_raw(server, over)  # one id over the cap, parsed: the count is named
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens"
    assert f"{cap + 1} token ids" in r.json()["error"]["message"]


@pytest.mark.serial
@pytest.mark.parametrize("path", ["/tokenize", "/inference/v1/abort_requests"])
def test_millions_of_json_values_are_refused_unparsed(server: Proc, path: str) -> None:
    """20M small values (40 MB) in a field the route ignores: refused before the JSON
    parser builds them, while ``/health`` keeps answering within 0.2 s."""
    body = b'{"prompt": "hi", "request_ids": ["x"], "junk": [' + b"1," * 20_000_000 + b"1]}"

    def send() -> httpx.Response:
        headers = {**AUTH, "content-type": "application/json"}
        return httpx.post(server.url + path, content=body, headers=headers, timeout=120)

    worst, polls, r = worst_health_latency_while(send, server)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "too_many_values"
    assert polls >= 3 and worst < 0.2, (polls, worst)


# ---- admission: the fan-out is counted on arrival ------------------------------------------


def test_four_simultaneous_256_way_requests_against_512(server: Proc) -> None:
    """Four 256-way requests at once (two prompts, n=128: the parser's largest n)
    against ``--max-engine-requests 512``: two are served, two get 429, and the engine
    (its own counters) sees 512 requests, never more."""
    body = {"model": MODEL, "prompt": ["abc", "abd"], "n": 128, "max_tokens": 10}
    prompt = len("abc")
    computed = "prompt_tokens_computed_total"
    before = metrics(server).get("ec_frontend_" + computed, 0.0)
    barrier = threading.Barrier(4)
    results: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(timeout=120) as client:
            barrier.wait()
            url = server.url + "/v1/completions"
            results.append(client.post(url, json=body, headers=AUTH))

    def four() -> None:
        threads = [threading.Thread(target=post) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    thread = threading.Thread(target=four)
    thread.start()
    peak = 0.0
    while thread.is_alive():
        m = metrics(server)
        engine = m.get("ec_frontend_num_requests_running", 0.0)
        engine += m.get("ec_frontend_num_requests_waiting", 0.0)
        peak = max(peak, engine)
        time.sleep(0.02)
    thread.join()
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200, 200, 429, 429], [r.text[:200] for r in results]
    for r in results:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "too_many_engine_requests"
            assert r.headers["retry-after"] == "1"
        else:
            assert len(r.json()["choices"]) == 256
    assert peak <= 512, peak
    entered = (settled(server, computed, before + 512 * prompt) - before) / prompt
    assert entered == 512, entered
    # Everything was given back: a full 512 fits again.
    r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 1},
                   headers=AUTH, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text


# ---- abort: exact ids, across the API servers of a group ------------------------------------

ABORT = "/inference/v1/abort_requests"
SERVER_HEADER = "x-ec-frontend-server"


def wait_running(server: Proc, count: int, timeout_s: float = 20.0) -> None:
    """Until the engine runs ``count`` requests."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics(server).get("ec_frontend_num_requests_running", 0.0) == count:
            return
        time.sleep(0.02)
    raise AssertionError(f"the engine never ran {count} requests")


def test_abort_is_exact(server: Proc) -> None:
    """``team`` aborts both choices of ``team`` and neither ``team-7`` nor
    ``team-12345678`` (ids of the shape of ``team``'s choices and collision suffixes)."""
    requests = {"team": 2, "team-7": 1, "team-12345678": 1, "team-0": 1}
    results: dict[str, httpx.Response] = {}

    def run(rid: str, n: int) -> None:
        headers = {**AUTH, "x-request-id": rid}
        body = chat("abcdef", n=n, max_tokens=80)
        url = server.url + "/v1/chat/completions"
        results[rid] = httpx.post(url, json=body, headers=headers, timeout=60)

    threads = [threading.Thread(target=run, args=item) for item in requests.items()]
    for t in threads:
        t.start()
    wait_running(server, sum(requests.values()))
    r = httpx.post(server.url + ABORT, json={"request_ids": ["team"]}, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    for t in threads:
        t.join()
    aborted = results.pop("team")
    assert aborted.status_code == 503 and aborted.json()["error"]["code"] == "aborted"
    for rid, other in results.items():
        assert other.status_code == 200, (rid, other.text)
        assert other.headers["x-request-id"] == rid
        assert [c["finish_reason"] for c in other.json()["choices"]] == ["length"], rid
        assert other.json()["usage"]["completion_tokens"] == 80


@pytest.mark.parametrize(
    ("ids", "param"),
    [(["a b"], "request_ids[0]"), (["ok", "x" * 257], "request_ids[1]"),
     (["id"] * 1025, "request_ids")],
)  # fmt: skip
def test_abort_ids_are_bounded(server: Proc, ids: list[str], param: str) -> None:
    r = httpx.post(server.url + ABORT, json={"request_ids": ids}, headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def group() -> Iterator[Proc]:
    """Two API servers in front of one mock engine, 20 ms per step."""
    proc = Proc(
        "serve",
        ["--mock-engine", "--api-key", API_KEY, "--served-model-name", MODEL,
         "--mock-token-latency-ms", "20", "--api-server-count", "2"],
        "group",
    ).wait_ready()  # fmt: skip
    yield proc
    assert proc.stop() == 0


def pinned_client(proc: Proc, index: str, tries: int = 200) -> httpx.Client:
    """A client whose kept-alive connection reached API server ``index``."""
    for _ in range(tries):
        client = httpx.Client(timeout=30)
        if client.get(proc.url + "/health").headers[SERVER_HEADER] == index:
            return client
        client.close()
    raise AssertionError(f"no connection reached server {index}")


def test_abort_reaches_the_request_through_either_server(group: Proc) -> None:
    """A stream runs on one server; the abort goes through the other one, whichever that
    is, until both servers have been the one aborting. Each stream ends at once with
    ``finish_reason: "abort"``."""
    aborted_through: set[str] = set()
    for attempt in range(12):
        rid = f"far-{attempt}"
        body = chat("abcdef", max_tokens=3000, stream=True)
        with (
            httpx.Client(timeout=60) as streamer,
            streamer.stream(
                "POST",
                group.url + "/v1/chat/completions",
                json=body,
                headers={**AUTH, "x-request-id": rid},
            ) as r,
        ):
            assert r.status_code == 200
            owner = r.headers[SERVER_HEADER]
            other = "1" if owner == "0" else "0"
            if other in aborted_through:
                continue  # this direction is shown; try for the other one
            lines = r.iter_lines()
            tokens = 0
            for line in lines:
                if line.startswith("data: {") and '"content":"' in line and '"role"' not in line:
                    tokens += 1
                    if tokens == 3:
                        break
            aborter = pinned_client(group, other)
            try:
                a = aborter.post(group.url + ABORT, json={"request_ids": [rid]}, headers=AUTH)
            finally:
                aborter.close()
            assert a.status_code == 200 and a.headers[SERVER_HEADER] == other
            finish = None
            for line in lines:
                if line.startswith("data: {"):
                    choice = orjson.loads(line[6:])["choices"][0]
                    finish = choice["finish_reason"] or finish
                    tokens += 1
            assert finish == "abort", finish
            assert tokens < 500, tokens  # ended at the abort, not at max_tokens
            aborted_through.add(other)
        if aborted_through == {"0", "1"}:
            break
    assert aborted_through == {"0", "1"}
