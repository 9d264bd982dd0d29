"""A proxy started beside instances that are still loading (the quick start's
order): it does not lock them out.

Before, the proxy's probes failed while the instances loaded, evicted them, and
backed off; the first requests after the instances came up were answered 503
``no_instance`` until a backed-off probe happened to run (seen in the quick
start). Now an instance that has never answered is probed every interval, and a
role with no instance in rotation sends its requests to the evicted ones.

Real processes: a proxy whose decode instance's port has nothing behind it yet,
then a mock-engine server started on that port.
"""

from __future__ import annotations

import time

import httpx
import pytest

from ..helpers.processes import Proc, free_port

pytestmark = pytest.mark.slow

PROBE_S = 0.3


def _metric(proc: Proc, name: str) -> float:
    return sum(v for k, v in proc.metrics().items() if k.startswith(name))


def test_instances_that_come_up_after_the_proxy_are_served_at_once() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--decode", url, "--probe-interval", str(PROBE_S), "--fail-threshold", "1"]
    px = Proc("proxy", args, "px")
    server: Proc | None = None
    try:
        deadline = time.monotonic() + 60
        while True:  # the proxy is up, and has taken the silent instance out of rotation
            assert px.proc.poll() is None and time.monotonic() < deadline, px.log()
            try:
                if _metric(px, "ec_frontend_proxy_ejections_total") >= 1:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        time.sleep(8 * PROBE_S)  # long enough for a backoff to have grown
        assert httpx.get(px.url + "/health").status_code == 503
        server = Proc("serve", ["--mock-engine", "--port", str(port)], "pd")
        server.port, server.url = port, url
        server.wait_ready()
        # The first request after the instance came up is served: routed to the
        # evicted instance (none is in rotation), whose answer puts it back.
        body = {"messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}  # fmt: skip
        r = httpx.post(px.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.get(px.url + "/health").status_code == 200
    finally:
        px.stop()
        if server is not None:
            server.stop()
