"""A proxy, or a decode instance behind it, killed mid-run (issue 31's faults).

Real processes on 127.0.0.1: a mock-engine instance that registers itself with
the proxy (``serve --register-with``, every 0.5 s) and a proxy with
``--dynamic-registration`` on a fixed port. Streams are in flight through the
proxy when it is killed with SIGKILL:

* every in-flight client gets an error at once (none hangs);
* the instance sees its clients go and ends their requests (nothing stays running);
* a proxy restarted on the same port knows nothing, learns the instance from its
  next announcement, and serves again.

And a decode instance killed while non-streamed requests run on it: each of them
goes to the other instance (nothing had reached its client yet) and is answered;
the killed instance leaves the rotation.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ..helpers.processes import LOCAL, Proc, free_port

pytestmark = pytest.mark.slow

ADMIN_KEY = "restart-admin-key"
ANNOUNCE_S = 0.5
STREAMS = 4


def _proxy(port: int) -> Proc:
    args = ["--dynamic-registration", "--probe-interval", "0.5", "--port", str(port)]
    proc = Proc("proxy", args, "px", env={"ADMIN_API_KEY": ADMIN_KEY})
    proc.port, proc.url = port, f"http://127.0.0.1:{port}"
    return proc


def _serving(px: Proc, timeout_s: float) -> float:
    """Seconds until a request through ``px`` is answered 200."""
    started = time.monotonic()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    while True:
        assert px.proc.poll() is None, px.log()
        try:
            if LOCAL.post(px.url + "/v1/chat/completions", json=body, timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        assert time.monotonic() - started < timeout_s, px.log()
        time.sleep(0.05)


def test_a_proxy_killed_mid_run_fails_its_streams_and_a_new_one_serves_again() -> None:
    port = free_port()
    px = _proxy(port)
    args = ["--mock-engine", "--mock-token-latency-ms", "20", "--register-with",
            f"http://127.0.0.1:{port}", "--register-role", "prefill_decode",
            "--register-interval", str(ANNOUNCE_S)]  # fmt: skip
    server = Proc("serve", args, "pd", env={"ADMIN_API_KEY": ADMIN_KEY}).wait_ready()
    try:
        _serving(px, timeout_s=60)
        outcomes: list[tuple[str, float]] = []

        def stream() -> None:
            body = {"messages": [{"role": "user", "content": "x" * 64}], "max_tokens": 2000,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            try:
                with httpx.stream("POST", px.url + "/v1/chat/completions", json=body,
                                  timeout=60) as r:  # fmt: skip
                    for _ in r.iter_bytes():
                        pass
                outcomes.append(("finished", time.monotonic()))
            except httpx.HTTPError as exc:
                outcomes.append((type(exc).__name__, time.monotonic()))

        threads = [threading.Thread(target=stream) for _ in range(STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.metric("num_requests_running") < STREAMS:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        px.kill()
        killed = time.monotonic()
        for t in threads:
            t.join(30)
        # Every stream broke off when the proxy died, long before its 2000 tokens
        # (40 s at 20 ms a token) could have finished.
        assert len(outcomes) == STREAMS and all(kind != "finished" for kind, _ in outcomes)
        assert max(at for _, at in outcomes) - killed < 10.0
        # The instance saw its clients go: nothing keeps running there.
        deadline = time.monotonic() + 10
        while server.metric("num_requests_running") > 0:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        px = _proxy(port)
        # Learned again from the instance's next announcement.
        assert _serving(px, timeout_s=30) < 10 * ANNOUNCE_S + 10
        status = LOCAL.get(px.url + "/instances").json()
        assert status["prefill_decode"]["live"] == [server.url]
    finally:
        px.stop()
        server.stop()


def test_a_decode_instance_killed_mid_run_loses_no_request() -> None:
    args = ["--mock-engine", "--mock-token-latency-ms", "20"]
    d1, d2 = Proc("serve", args, "d1"), Proc("serve", args, "d2")
    d1.wait_ready()
    d2.wait_ready()
    px = Proc("proxy", ["--decode", d1.url, d2.url, "--routing", "round-robin",
                        "--probe-interval", "0.5"], "px")  # fmt: skip
    try:
        _serving(px, timeout_s=60)
        answers: list[int] = []

        def ask() -> None:
            body = {"messages": [{"role": "user", "content": "y" * 32}], "max_tokens": 100,
                    "ignore_eos": True}  # fmt: skip
            r = httpx.post(px.url + "/v1/chat/completions", json=body, timeout=60)
            answers.append(r.status_code)

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while d1.metric("num_requests_running") < 2:
            assert time.monotonic() < deadline, d1.log()
            time.sleep(0.02)
        d1.kill()
        for t in threads:
            t.join(60)
        assert answers == [200] * 8
        assert d2.metric("num_requests_running") == 0
        for _ in range(4):  # the survivor takes every new request
            assert _serving(px, timeout_s=10) < 10
        reroutes = px.metrics().get('ec_frontend_proxy_reroutes_total{role="prefill_decode"}', 0)
        assert reroutes >= 2
        ejected = f'ec_frontend_proxy_ejections_total{{role="prefill_decode",instance="{d1.url}"}}'
        deadline = time.monotonic() + 10
        while px.metrics().get(ejected, 0) < 1:
            assert time.monotonic() < deadline, sorted(px.metrics())
            time.sleep(0.1)
    finally:
        px.stop()
        d1.kill()
        d2.stop()
