"""KV holds bounded per client (issue 28): ``do_remote_decode`` sent straight to prefill.

Before, any client could send ``{"do_remote_decode": true}`` to a prefill instance
and its KV was held until the TTL: 122 such requests held 91% of the cache. Now the
blocks one client's holds keep are bounded (``max_client_hold_fraction`` of the
cache; the client is the address the server sees, whatever the body says); past the
bound the request is answered, but its KV is not held and its
``kv_transfer_params`` say so (``hold_refused``). Real processes: a prefill instance
with a 512-block cache and a bound of 64 blocks (4 prompts of 16 blocks), a decode
instance and our proxy, all with the transfer secret.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ec_frontend.config import ConfigError, KVTransferConfig
from ec_frontend.connectors.kv_pull import PullState
from ec_frontend.connectors.kv_transfer_params import HOLD_CLIENT_KEY, stamp_hold_client

from ..disagg.conftest import proxy, serve, side_channel_kv
from ..helpers.processes import Proc, start_all

TTL_S = 4.0
PROMPT_TOKENS = 256  # 16 blocks of 16
BOUND_HOLDS = 4


@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({"do_remote_decode": True}, {"do_remote_decode": True, HOLD_CLIENT_KEY: "10.0.0.9"}),
        ({"do_remote_decode": True, HOLD_CLIENT_KEY: "forged"},
         {"do_remote_decode": True, HOLD_CLIENT_KEY: "10.0.0.9"}),
        ({"do_remote_decode": "yes", HOLD_CLIENT_KEY: "forged"}, {"do_remote_decode": "yes"}),
        ({"do_remote_prefill": True}, {"do_remote_prefill": True}),
        (None, None),
        ([1], [1]),
    ],
    ids=["stamped", "overwritten", "not-a-hold", "decode-side", "null", "not-an-object"],
)  # fmt: skip
def test_the_server_names_the_client_whatever_the_body_says(params: Any, want: Any) -> None:
    assert stamp_hold_client(params, "10.0.0.9") == want


def state(fraction: float | None = None) -> PullState[Any]:
    extra = {} if fraction is None else {"max_client_hold_fraction": fraction}
    st: PullState[Any] = PullState(
        KVTransferConfig("KVSideChannelConnector", "kv_producer", extra), ttl_s=30, timeout_s=5
    )
    st.bind_caches([torch.zeros(2, 100, 1)])  # 100 blocks
    return st


def test_the_bound_counts_blocks_per_client_and_frees_them_with_the_hold() -> None:
    st = state(0.2)  # 20 blocks per client
    assert st.reserve("a1", "a", 15) is None
    assert st.reserve("b1", "b", 20) is None
    refusal = st.reserve("a2", "a", 6)
    assert refusal is not None and "bound of 20 blocks" in refusal
    assert st.reserve("a3", "a", 5) is None
    with st.lock:
        st.free_hold("a1", sent=True)
    assert st.client_blocks == {"a": 5, "b": 20} and st.holds_refused == 1
    assert st.reserve("a4", "a", 15) is None
    # A client that holds nothing may hold one request of any size.
    assert st.reserve("c1", "c", 90) is None
    assert st.reserve("c2", "c", 1) is not None


@pytest.mark.parametrize("fraction", [0, 1.5, "x", True])
def test_the_fraction_is_checked(fraction: Any) -> None:
    with pytest.raises(ConfigError, match="max_client_hold_fraction"):
        state(fraction)


@pytest.fixture(scope="module")
def dep(builtin_model_dir: Path) -> Iterator[dict[str, Proc]]:
    m = builtin_model_dir
    engines = {
        "p": serve(m, "p", kv=side_channel_kv("kv_producer", ttl_s=TTL_S,
                                              max_client_hold_fraction=0.125),
                   extra=["--kv-cache-memory", str(4 << 20)]),
        "d": serve(m, "d", kv=side_channel_kv("kv_consumer")),
    }  # fmt: skip
    # The proxy starts beside them: it reaches its upstreams only per request.
    every = {**engines, "px": proxy("px", prefill=[engines["p"].url], decode=[engines["d"].url])}
    start_all(list(every.values()))
    yield every
    for proc in every.values():
        proc.stop()


_prompts = iter(range(1, 1 << 20))


def prompt() -> list[int]:
    k = next(_prompts)
    return [(k * 31 + i * 7) % 500 + 3 for i in range(PROMPT_TOKENS)]


def hold(p: Proc, source: str = "127.0.0.1", **params: Any) -> dict[str, Any]:
    """A client's ``do_remote_decode`` request sent from ``source``; prefill's params."""
    body = {"token_ids": prompt(), "sampling_params": {"max_tokens": 1},
            "kv_transfer_params": {"do_remote_decode": True, **params}}  # fmt: skip
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60) as c:
        r = c.post(p.url + "/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 1
    kv = r.json()["kv_transfer_params"]
    assert isinstance(kv, dict)
    return kv


def via_proxy(px: Proc, text: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": text, "max_tokens": 6, "temperature": 0}
    r = httpx.post(px.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.slow
def test_holds_of_one_client_are_bounded_and_the_refusal_says_so(dep: dict[str, Proc]) -> None:
    p = dep["p"]
    time.sleep(TTL_S + 0.5)  # no hold left from another test
    refused_before = p.metric("kv_holds_refused_total")
    # A client names another client in the body each time: the server's word wins.
    granted = [hold(p, hold_client=f"someone-else-{i}") for i in range(BOUND_HOLDS)]
    assert all(kv["do_remote_prefill"] is True for kv in granted)
    over = hold(p, hold_client="someone-else-x")
    assert over["do_remote_prefill"] is False and over["do_remote_decode"] is False
    message = over["hold_refused"]
    assert "bound of 64 blocks" in message and "max_client_hold_fraction" in message
    assert set(over) == {"do_remote_prefill", "do_remote_decode", "hold_refused"}
    assert p.metric("kv_holds_refused_total") == refused_before + 1
    assert p.metric("kv_requests_held") == BOUND_HOLDS
    # Another client (another source address) still gets its hold.
    assert hold(p, source="127.0.0.2")["do_remote_prefill"] is True
    # Once the first client's holds expire, it may hold again.
    time.sleep(TTL_S + 0.5)
    assert hold(p)["do_remote_prefill"] is True


@pytest.mark.slow
def test_the_proxy_falls_back_to_a_local_prefill_when_its_holds_are_refused(
    dep: dict[str, Proc],
) -> None:
    p, d, px = dep["p"], dep["d"], dep["px"]
    time.sleep(TTL_S + 0.5)
    # With KV moved: the answer the fallback must equal.
    received = d.metric("kv_tokens_received_total")
    want = via_proxy(px, "tell me a story about a fox")
    assert "x-kv-fallback" not in want.headers
    assert d.metric("kv_tokens_received_total") > received
    # A direct client on the proxy's address (127.0.0.1) uses up that address's bound.
    for _ in range(BOUND_HOLDS):
        hold(p)
    computed = d.metric("prompt_tokens_computed_total")
    got = via_proxy(px, "tell me a story about a fox")
    assert got.headers["x-kv-fallback"] == "local-prefill"
    assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert d.metric("prompt_tokens_computed_total") > computed
    assert "held no KV" in px.output()
