"""What a server refuses to fetch, and a slow origin that must not hold it.

One server (mock engine) is started with no media flag; another allows only
``127.0.0.2/32`` (a stand-in for a public host, so that a redirect from it can be
shown). Each refused URL is a 400
naming the part, and the origin it points at receives **no connection**
(its listening socket counts them). A slow origin (one byte per second) makes
its requests end at the fetch timeout while a concurrent text request's
latency stays as it was without any fetch.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ..helpers.origin import Origin, Route, origin
from ..server.conftest import ServerProcess
from .conftest import image_messages, png_bytes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

IMAGE = png_bytes(56, (200, 30, 30))
PARAM = "messages[0].content[1].image_url"
FETCH_TIMEOUT_S = 3.5
TOKEN_LATENCY_MS = 25
TEXT_TOKENS = 10
ROUNDS = 5


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        [
            "--mock-engine",
            "--mock-token-latency-ms",
            str(TOKEN_LATENCY_MS),
            "--allowed-media-networks",
            "127.0.0.2/32",
            "--media-fetch-timeout",
            str(FETCH_TIMEOUT_S),
        ]
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def bare() -> Iterator[ServerProcess]:
    """A server started with no media flag at all."""
    proc = ServerProcess(["--mock-engine"])
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def private() -> Iterator[Origin]:
    with origin("127.0.0.1") as o:
        yield o


@pytest.fixture(scope="module")
def public() -> Iterator[Origin]:
    with origin("127.0.0.2") as o:
        yield o


def chat(server: ServerProcess, url: str, http: httpx.Client | None = None) -> httpx.Response:
    body = {"model": "mock", "messages": image_messages(url), "max_tokens": 1}
    post = http.post if http is not None else httpx.post
    return post(server.url + "/v1/chat/completions", json=body, timeout=30.0)


def test_the_allowed_public_stand_in_is_fetched(server: ServerProcess, public: Origin) -> None:
    r = chat(server, public.set("/ok.png", Route(IMAGE)))
    assert r.status_code == 200, r.text
    assert public.paths()[-1] == "/ok.png"


@pytest.mark.parametrize(
    ("flags", "kind"),
    [
        ("none", "loopback-literal"),
        ("none", "metadata"),
        ("none", "name-to-loopback"),
        ("public-only", "loopback-literal"),
        ("public-only", "metadata"),
        ("public-only", "name-to-loopback"),
        # The first hop needs an allowed host: 127.0.0.2 plays the public one.
        ("public-only", "redirect-to-loopback"),
    ],
)
def test_refused_urls_open_no_connection(
    request: pytest.FixtureRequest, private: Origin, public: Origin, flags: str, kind: str
) -> None:
    server: ServerProcess = request.getfixturevalue("bare" if flags == "none" else "server")
    target = private.set("/secret.png", Route(IMAGE))
    url = {
        "loopback-literal": target,
        "metadata": "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "name-to-loopback": private.url("/secret.png", host="localhost"),
        "redirect-to-loopback": public.set(
            "/hop.png", Route(status=302, location=target, content_type=None)
        ),
    }[kind]
    before = private.accepted
    r = chat(server, url)
    assert r.status_code == 400, r.text
    err: Any = r.json()["error"]
    assert (err["param"], err["code"]) == (PARAM, "media_url_refused")
    assert "--allowed-media-networks" in err["message"]
    assert private.accepted == before
    if kind == "redirect-to-loopback":
        assert public.paths()[-1] == "/hop.png"  # the first hop was fetched, the second not
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_refusals_are_counted(server: ServerProcess) -> None:
    before = server.metrics().get('ec_frontend_media_fetch_refused_total{reason="address"}', 0)
    chat(server, "http://10.1.2.3/a.png")
    after = server.metrics()['ec_frontend_media_fetch_refused_total{reason="address"}']
    assert after == before + 1


def _text_latency(server: ServerProcess, http: httpx.Client) -> float:
    body = {"model": "mock", "prompt": "hello", "max_tokens": TEXT_TOKENS, "ignore_eos": True}
    started = time.perf_counter()
    r = http.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return time.perf_counter() - started


def _p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


@pytest.mark.serial
def test_a_slow_origin_does_not_hold_the_server(server: ServerProcess, public: Origin) -> None:
    """Rounds of text requests timed alone, then timed while eight requests whose image
    drips one byte per second are in flight (interleaved, so both see the same load
    from the rest of the machine): the p99 with fetches stays within 1.2x of the p99
    without, and every slow request ends at the fetch timeout with a 400."""
    slow = public.set("/drip.png", Route(IMAGE, drip_s=1.0))
    # Clients made once: making one per request (its TLS context) costs this process
    # tens of milliseconds of CPU, which would land in the timed requests.
    timed, slow_client = httpx.Client(), httpx.Client()
    for _ in range(3):
        _text_latency(server, timed)
    baseline: list[float] = []
    loaded: list[float] = []
    per_block = 6
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(ROUNDS):
            baseline += [_text_latency(server, timed) for _ in range(per_block)]
            started = time.monotonic()
            futures = [pool.submit(chat, server, slow, slow_client) for _ in range(8)]
            time.sleep(0.2)  # the fetches are under way
            loaded += [_text_latency(server, timed) for _ in range(per_block)]
            assert not any(f.done() for f in futures), "a slow fetch ended early"
            results = [f.result() for f in futures]
            ended = time.monotonic() - started
            for r in results:
                assert r.status_code == 400, r.text
                assert r.json()["error"]["code"] == "media_fetch_timeout"
                assert r.json()["error"]["param"] == PARAM
            assert FETCH_TIMEOUT_S - 0.5 < ended < FETCH_TIMEOUT_S + 3.0
    timed.close()
    slow_client.close()
    base_p99, loaded_p99 = _p99(baseline), _p99(loaded)
    print(
        f"text p99: {base_p99 * 1e3:.1f} ms without fetches, {loaded_p99 * 1e3:.1f} ms with 8 "
        f"slow fetches in flight ({len(loaded)} requests each)"
    )
    assert loaded_p99 <= 1.2 * base_p99, (base_p99, loaded_p99)
