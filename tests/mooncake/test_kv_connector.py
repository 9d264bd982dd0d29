"""``MooncakeConnector`` halves in one process, over real Transfer Engines on loopback.

A prefill and a decode connector (each with its own engine) move a request's KV
blocks; the tests follow the scheduler's calls (params, matched tokens, alloc,
metadata, load, poll) and check the bytes that landed, the completion report
that frees prefill's hold, the TTL, a peer that never answers (bounded by
``timeout_s``), a layout that does not match and params that are unusable.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from ec_frontend.config import KVTransferConfig, TransferTrust, parse_transfer_peers
from ec_frontend.connectors.kv_base import KVConnectorRole, KVLoadResult
from ec_frontend.connectors.mooncake_kv import MooncakeConnector, RemoteLayout, read_plan
from ec_frontend.connectors.transfer_trust import SIGNATURE_KEY, signed

PROMPT = list(range(40, 61))  # 21 tokens: 3 blocks of 8
SECRET = b"mooncake-kv-test-secret-0123456789"


def caches(num_blocks: int = 12, layers: int = 2) -> list[torch.Tensor]:
    return [torch.randn(2, num_blocks, 8, 2, 4) for _ in range(layers)]


def connector(
    role: str, *, secret: bytes | None = SECRET, peers: str | None = None, **extra: Any
) -> MooncakeConnector:
    rules = parse_transfer_peers(peers) if peers else None
    config = KVTransferConfig.from_json(
        {"kv_connector": "MooncakeConnector", "kv_role": role,
         "kv_connector_extra_config": {"timeout_s": 10.0, **extra}},
        trust=TransferTrust(secret=secret, peers=rules),
    )  # fmt: skip
    return MooncakeConnector(config, KVConnectorRole.WORKER)


def request(rid: str, **params: Any) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, kv_transfer_params=params or None,
        status=SimpleNamespace(finish_reason="length"), output_token_ids=[5],
        num_computed_tokens=len(PROMPT), num_prompt_tokens=len(PROMPT),
        prompt_token_ids=PROMPT, mrope_position_delta=0,
    )  # fmt: skip


@pytest.fixture
def prefill() -> Iterator[tuple[MooncakeConnector, list[torch.Tensor]]]:
    p, kv = connector("kv_producer", ttl_s=30.0), caches()
    p.save_kv(kv)
    yield p, kv


def resign(params: dict[str, Any], **change: Any) -> dict[str, Any]:
    """``params`` with ``change`` applied, signed afresh (the test plays the prefill)."""
    body = {k: v for k, v in {**params, **change}.items() if k != SIGNATURE_KEY}
    return signed(SECRET, "kv", params["remote_request_id"], body, 60.0)


def hand_over(p: MooncakeConnector, rid: str, blocks: list[int]) -> dict[str, Any]:
    delay, params = p.request_finished(request(rid, do_remote_decode=True), blocks)
    assert delay and params is not None
    return params


def load(d: MooncakeConnector, kv: list[torch.Tensor], rid: str, params: dict[str, Any],
         local: list[int]) -> KVLoadResult | None:  # fmt: skip
    req = request(rid, **params)
    assert d.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    d.update_state_after_alloc(req, local, len(PROMPT))
    d.bind_connector_metadata(d.build_connector_meta(SimpleNamespace()))
    d.start_load_kv(kv)
    deadline = time.monotonic() + 20
    while True:
        d.wait_for_load()
        _, recving = d.get_finished(set())
        if recving:
            assert recving == {rid}
            return d.get_load_result(req)
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_blocks_land_and_prefill_frees_on_report(prefill: Any) -> None:
    p, src = prefill
    d, dst = connector("kv_consumer"), caches(num_blocks=9)
    params = hand_over(p, "r1", [7, 8, 2])
    assert p.num_requests_held == 1
    result = load(d, dst, "r1", params, [1, 2, 5])
    assert result is not None and result.error is None and result.first_token_id == 5
    for s, t in zip(src, dst, strict=True):
        assert torch.equal(t[:, [1, 2, 5]], s[:, [7, 8, 2]])
    sent, _ = p.get_finished(set())
    assert sent == {"r1"} and p.num_requests_held == 0 and p.num_tokens_sent == len(PROMPT)


def test_unread_hold_is_freed_at_its_ttl() -> None:
    p = connector("kv_producer", ttl_s=0.2)
    p.save_kv(caches())
    hand_over(p, "r2", [1, 2, 3])
    assert p.get_finished(set()) == (None, None)
    time.sleep(0.3)
    assert p.get_finished(set())[0] == {"r2"} and p.num_requests_held == 0


def test_peer_that_never_answers_fails_within_timeout(prefill: Any) -> None:
    p, _ = prefill
    params = hand_over(p, "r3", [1, 2, 3])
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        params = resign(params, remote_port=silent.getsockname()[1])
        start = time.monotonic()
        result = load(connector("kv_consumer", timeout_s=1.0), caches(), "r3", params, [1, 2, 3])
    assert time.monotonic() - start < 1.0 + 3
    assert result is not None and result.error is not None and "no answer in 1s" in result.error


def test_prefill_gone_and_other_layout_fail_the_request(prefill: Any) -> None:
    p, _ = prefill
    params = hand_over(p, "r4", [1, 2, 3])
    gone = resign(params, remote_port=1)
    # A refused connection and another layout fail at once; the default 10 s deadline keeps a
    # busy machine from turning them into a timeout (the timeout is the test above, at 1 s).
    result = load(connector("kv_consumer"), caches(), "r4", gone, [1, 2, 3])
    assert result is not None and "Transfer Engine read" in (result.error or "")
    d = connector("kv_consumer")
    other = [torch.zeros(2, 12, 16, 2, 4) for _ in range(2)]
    result = load(d, other, "r4", resign(params), [1, 2, 3])
    assert result is not None and "layout" in (result.error or "")


@pytest.mark.parametrize(
    "change",
    [{"remote_kv_addrs": []}, {"remote_block_bytes": "x"}, {"remote_done_addr": 0},
     {"remote_block_ids": [1, 2, 99]}, {"prompt_hash": "0" * 32}, {"remote_port": 0}],
)  # fmt: skip
def test_unusable_params_mean_a_local_prefill(prefill: Any, change: dict[str, Any]) -> None:
    p, _ = prefill
    params = resign(hand_over(p, "r5", [1, 2, 3]), **change)
    d = connector("kv_consumer")
    assert d.get_num_new_matched_tokens(request("r5", **params), 0) == (0, False)
    assert d.local_prefill_fallbacks == 1


def test_unsigned_params_need_an_explicit_opt_in() -> None:
    p = connector("kv_producer", secret=None)
    p.save_kv(caches())
    params = hand_over(p, "r6", [1, 2, 3])
    assert SIGNATURE_KEY not in params
    strict = connector("kv_consumer", secret=None, peers="127.0.0.1")
    assert strict.get_num_new_matched_tokens(request("r6", **params), 0) == (0, False)
    # The opt-in alone is not enough: with no named peer nothing is trusted.
    unnamed = connector("kv_consumer", secret=None, allow_unsigned_params=True)
    assert unnamed.get_num_new_matched_tokens(request("r6", **params), 0) == (0, False)
    trusting = connector("kv_consumer", secret=None, peers="127.0.0.1", allow_unsigned_params=True)
    result = load(trusting, caches(), "r6", params, [1, 2, 3])
    assert result is not None and result.error is None


def test_read_plan_merges_adjacent_blocks() -> None:
    kv = caches(num_blocks=10, layers=1)
    block = 8 * 2 * 4 * 4
    remote = RemoteLayout((1 << 20,), 20, block, 1, (4, 5, 6, 9))
    dst, src, lengths = read_plan([0, 1, 2, 3], remote, kv)
    base = kv[0].data_ptr()
    assert dst == [base, base + 3 * block, base + 10 * block, base + 13 * block]
    assert src == [(1 << 20) + 4 * block, (1 << 20) + 9 * block,
                   (1 << 20) + 24 * block, (1 << 20) + 29 * block]  # fmt: skip
    assert lengths == [3 * block, block, 3 * block, block]
