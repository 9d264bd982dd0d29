"""Pull pools bounded per peer (issue 28): no one peer can starve pulls from the others.

Before, a consumer pulled through one plain pool of 8 threads served first come,
first served: 8 pulls from one peer that drips its answer held every thread until
their deadline, and a legitimate request's pull from a good peer waited behind them
(8 dripping pulls held a request for 8 s). Here the dripping peer is a real socket
server on 127.0.0.1 that sends a byte every 0.2 s, and the good peer answers at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from ec_frontend.config import (
    ECTransferConfig,
    KVTransferConfig,
    TransferTrust,
    parse_transfer_peers,
)
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.ec_side_channel import (
    PULL_WORKERS,
    PULLS_PER_PEER,
    ECSideChannelConnector,
)
from ec_frontend.connectors.factory import create_kv_connectors
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.kv_pull import PULL_WORKERS as KV_PULL_WORKERS
from ec_frontend.connectors.kv_pull import PULLS_PER_PEER as KV_PULLS_PER_PEER
from ec_frontend.connectors.kv_side_channel import KVSideChannelConnector
from ec_frontend.connectors.peer_pool import PeerPool
from ec_frontend.connectors.transfer_trust import SIGNATURE_KEY, TOKEN_KEY, new_token, signed
from ec_frontend.engine.request import Request
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.model.processor import MultiModalFeature

from .test_side_channel_limits import FakePeer, dripping, frame, tensor_answer

TIMEOUT_S = 2.0
ROWS, HIDDEN = 4, 8

# ---- the pool itself --------------------------------------------------------------


def test_one_peer_runs_at_most_its_share_and_the_others_go_first() -> None:
    pool = PeerPool(workers=4, per_peer=2, name="t")
    release = threading.Event()
    slow = [pool.submit("slow", release.wait, 10) for _ in range(6)]
    deadline = time.monotonic() + 2
    while pool.running("slow") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (pool.running("slow"), pool.queued("slow")) == (2, 4)
    # Another peer's tasks start at once, on the threads the slow peer may not take.
    fast = [pool.submit("fast", lambda i=i: i) for i in range(5)]
    assert [f.result(timeout=2) for f in fast] == list(range(5))
    assert pool.running("slow") == 2
    # A task cancelled while it waits never runs; the others finish once released.
    assert slow[-1].cancel()
    release.set()
    assert all(f.result(timeout=5) for f in slow[:-1])
    pool.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        pool.submit("fast", time.sleep, 0)


def test_freed_threads_go_to_waiting_peers_in_turn() -> None:
    pool = PeerPool(workers=1, per_peer=1, name="t")
    gate = threading.Event()
    order: list[str] = []
    first = pool.submit("a", gate.wait, 5)
    futures = [pool.submit(p, order.append, p) for p in ("a", "a", "a", "b", "c")]
    gate.set()
    first.result(timeout=5)
    for f in futures:
        f.result(timeout=5)
    # "a" queued three tasks before "b" and "c" queued one each: they alternate.
    assert order == ["a", "b", "c", "a", "a"]
    pool.shutdown(wait=True, cancel_futures=True)


def test_bounds_are_checked() -> None:
    for workers, per_peer in [(4, 0), (4, 5)]:
        with pytest.raises(ValueError, match="per_peer"):
            PeerPool(workers, per_peer, "t")


# ---- a consumer against a real dripping peer -----------------------------------------


@pytest.fixture
def peers() -> Iterator[tuple[FakePeer, FakePeer]]:
    header = frame({"ok": True, "dtype": "float32", "shape": [ROWS, HIDDEN],
                    "nbytes": ROWS * HIDDEN * 4})  # fmt: skip
    drip = FakePeer(dripping(header, 0.2))
    good = FakePeer(tensor_answer(torch.ones(ROWS, HIDDEN)))
    yield drip, good
    drip.close()
    good.close()


def consumer() -> ECSideChannelConnector:
    config = ECTransferConfig(
        "ECSideChannelConnector",
        "ec_consumer",
        {"port": 0, "timeout_s": TIMEOUT_S},
        trust=TransferTrust(peers=parse_transfer_peers("127.0.0.1")),
    )
    return ECSideChannelConnector(config, ECConnectorRole.SCHEDULER)


_hashes = iter(range(1, 1 << 30))


def request(port: int) -> Request:
    """A request with one image whose params name the (operator-named) peer at ``port``."""
    mm_hash = f"{next(_hashes):032x}"
    entry: dict[str, Any] = {"peer_host": "127.0.0.1", "peer_port": port, "num_tokens": ROWS,
                             "dtype": "float32", "shape": [ROWS, HIDDEN],
                             "token": new_token()}  # fmt: skip
    params = {mm_hash: entry}
    feature = MultiModalFeature(mm_hash, 1, ROWS, (1, 4, 4), torch.zeros(16, 8))
    sampling = SamplingParams(max_tokens=1, extra_args={"ec_transfer_params": params})
    return Request(f"r-{mm_hash[-6:]}", [1] * 8, sampling, mm_features=[feature])


def good_pull_seconds(conn: ECSideChannelConnector, drip: FakePeer, good: FakePeer) -> float:
    """Starts 2 x PULLS_PER_PEER pulls from the dripping peer, then times a pull from the
    good peer (the request's wait until its items are ready) while they drip."""
    bad = [request(drip.port) for _ in range(2 * PULLS_PER_PEER)]
    for r in bad:
        assert not conn.is_request_ready(r)
    deadline = time.monotonic() + 2
    while drip.accepted < PULLS_PER_PEER and time.monotonic() < deadline:
        time.sleep(0.01)
    mine = request(good.port)
    started = time.monotonic()
    while not conn.is_request_ready(mine) and time.monotonic() - started < 3 * TIMEOUT_S:
        time.sleep(0.005)
    elapsed = time.monotonic() - started
    assert conn.staging is not None
    (future,) = (conn.staging.take(f.mm_hash) for f in mine.mm_features)
    assert future is not None and future.result() is not None
    return elapsed


def test_a_dripping_peer_holds_at_most_its_share_and_never_delays_another_peer(
    peers: tuple[FakePeer, FakePeer],
) -> None:
    drip, good = peers
    conn = consumer()
    elapsed = good_pull_seconds(conn, drip, good)
    # The good peer's pull did not wait for the drips' deadline (2 s) ...
    assert elapsed < TIMEOUT_S / 2, elapsed
    # ... and the dripping peer never had more than its share of connections.
    assert drip.accepted == PULLS_PER_PEER < PULL_WORKERS
    conn.close()


def test_a_plain_pool_of_the_old_size_starves_the_good_peer(
    peers: tuple[FakePeer, FakePeer],
) -> None:
    # The control: the old pool (8 threads, no bound per peer) gives the dripping
    # peer every thread, and the good pull waits for the drips' deadline.
    drip, good = peers
    conn = consumer()
    conn._pool = PeerPool(PULLS_PER_PEER, PULLS_PER_PEER, "old")
    assert good_pull_seconds(conn, drip, good) >= TIMEOUT_S * 0.9
    conn.close()


# ---- KV: a decode instance pulling from a dripping prefill and a good one ----------

KV_SECRET = b"kv-pull-pool-test-secret-0123456789"
KV_PROMPT = list(range(100, 117))  # 17 tokens: 3 blocks of 8


def kv_caches() -> list[torch.Tensor]:
    return [torch.randn(2, 12, 8, 2, 4) for _ in range(2)]


def kv_request(rid: str, params: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, kv_transfer_params=params,
        status=SimpleNamespace(finish_reason="length"), output_token_ids=[9],
        num_computed_tokens=len(KV_PROMPT), num_prompt_tokens=len(KV_PROMPT),
        prompt_token_ids=KV_PROMPT, mrope_position_delta=0,
    )  # fmt: skip


def kv_config(role: str) -> KVTransferConfig:
    return KVTransferConfig(
        "KVSideChannelConnector", role, {"port": 0, "timeout_s": TIMEOUT_S},
        trust=TransferTrust(secret=KV_SECRET),
    )  # fmt: skip


def good_kv_seconds(decode: KVSideChannelConnector) -> tuple[float, int]:
    """A real prefill holds one request; 2 x KV_PULLS_PER_PEER loads go to a peer that
    drips its answer, then the good prefill's load is timed until it lands (its bytes
    checked). Returns that time and the connections the dripping peer accepted."""
    prefill, prefill_worker = create_kv_connectors(kv_config("kv_producer"))
    header = frame({"ok": True, "dtype": "float32", "shape": [2, 2, 3, 8, 2, 4],
                    "nbytes": 2 * 2 * 3 * 8 * 2 * 4 * 4, "num_tokens": len(KV_PROMPT)})  # fmt: skip
    drip = FakePeer(dripping(header, 0.2))
    try:
        src, dst = kv_caches(), kv_caches()
        prefill_worker.save_kv(src)
        _, good = prefill.request_finished(kv_request("p0", {"do_remote_decode": True}), [1, 2, 3])
        assert good is not None
        bad = {f"bad{i}": redirected(good, drip.port) for i in range(2 * KV_PULLS_PER_PEER)}

        def start(batch: dict[str, dict[str, Any]], blocks: list[int]) -> None:
            for rid, p in batch.items():
                req = kv_request(rid, dict(p))
                assert decode.get_num_new_matched_tokens(req, 0) == (len(KV_PROMPT), True)
                decode.update_state_after_alloc(req, blocks, len(KV_PROMPT))
            decode.bind_connector_metadata(decode.build_connector_meta(SimpleNamespace()))
            decode.start_load_kv(dst)

        start(bad, [0, 1, 2])
        deadline = time.monotonic() + 2
        while drip.accepted < KV_PULLS_PER_PEER and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        start({"good": good}, [5, 6, 7])
        while time.monotonic() - started < 3 * TIMEOUT_S:
            decode.wait_for_load()
            _, recving = decode.get_finished(set())
            if recving and "good" in recving:
                break
            time.sleep(0.005)
        elapsed = time.monotonic() - started
        result = decode.get_load_result(kv_request("good", None))
        assert result is not None and result.error is None, result
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, [5, 6, 7]], s[:, [1, 2, 3]])
        return elapsed, drip.accepted
    finally:
        decode.close()
        prefill.close()
        drip.close()


def redirected(params: dict[str, Any], port: int) -> dict[str, Any]:
    """``params`` pointing at ``port`` with a fresh hold token, signed again (the test
    plays a prefill that signs and then drips)."""
    body = {k: v for k, v in params.items() if k != SIGNATURE_KEY}
    body.update(remote_port=port, **{TOKEN_KEY: new_token()})
    return signed(KV_SECRET, "kv", params["remote_request_id"], body, 60.0)


def test_a_dripping_prefill_holds_at_most_its_share_of_kv_pulls() -> None:
    decode = KVSideChannelConnector(kv_config("kv_consumer"), KVConnectorRole.WORKER)
    elapsed, accepted = good_kv_seconds(decode)
    assert elapsed < TIMEOUT_S / 2, elapsed
    # The dripping prefill got its share of the threads, the rest waited in its queue.
    assert accepted == KV_PULLS_PER_PEER < KV_PULL_WORKERS


def test_kv_pulls_on_an_unbounded_pool_starve_the_good_prefill() -> None:
    # The control: every thread may go to the dripping prefill (the old plain pool).
    decode = KVSideChannelConnector(kv_config("kv_consumer"), KVConnectorRole.WORKER)
    decode._pool = PeerPool(KV_PULL_WORKERS, KV_PULL_WORKERS, "old")
    elapsed, accepted = good_kv_seconds(decode)
    assert elapsed >= TIMEOUT_S * 0.9 and accepted == KV_PULL_WORKERS
