"""The two halves of a connector share state only through the object the factory hands them.

Each engine builds its connectors with ``create_ec_connectors`` /
``create_kv_connectors``: one shared object per engine, passed to both halves.
Two engines built from the *same* config object therefore get two servers and
two sets of holds (before, a module registry keyed by ``id(config)`` made them
share one), and what one engine's scheduler half holds is served from that
engine's worker half's KV cache, over a real socket.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from ec_frontend.config import ECTransferConfig, KVTransferConfig
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.factory import (
    create_ec_connector,
    create_ec_connectors,
    create_kv_connectors,
)
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.kv_pull import PullLoad
from ec_frontend.connectors.kv_side_channel import KVSideChannelConnector
from ec_frontend.connectors.kv_transfer_params import parse_remote_prefill

PROMPT = list(range(100, 117))  # 17 tokens: 3 blocks of 8


def finished(rid: str) -> SimpleNamespace:
    """What a KV connector reads of a prefill request that finished normally."""
    return SimpleNamespace(
        request_id=rid, kv_transfer_params={"do_remote_decode": True},
        status=SimpleNamespace(finish_reason="length"), output_token_ids=[9],
        num_computed_tokens=len(PROMPT), num_prompt_tokens=len(PROMPT),
        prompt_token_ids=PROMPT, mrope_position_delta=0,
    )  # fmt: skip


def caches() -> list[torch.Tensor]:
    return [torch.randn(2, 6, 8, 2, 4) for _ in range(2)]


@pytest.fixture
def kv_config() -> KVTransferConfig:
    return KVTransferConfig("KVSideChannelConnector", "kv_both", {"port": 0, "timeout_s": 5.0})


def test_two_engines_from_one_config_share_nothing(kv_config: KVTransferConfig) -> None:
    engines = [create_kv_connectors(kv_config) for _ in range(2)]
    try:
        for sched, worker in engines:
            assert sched.role is KVConnectorRole.SCHEDULER and worker.role is KVConnectorRole.WORKER
            assert sched.state is worker.state
        (a, _), (b, _) = engines
        assert a.state is not b.state
        assert a.state.server is not None and b.state.server is not None
        assert a.state.server.port != b.state.server.port
        assert a.state.engine_id != b.state.engine_id
        # A hold made by one engine's scheduler half is not seen by the other engine.
        a.save_kv(caches())
        delay, params = a.request_finished(finished("r1"), [1, 2, 3])
        assert delay and params is not None
        assert (a.num_requests_held, b.num_requests_held) == (1, 0)
        assert params["remote_port"] == a.state.server.port
    finally:
        for sched, _ in engines:
            sched.close()


def test_held_kv_is_served_from_the_worker_halfs_cache(kv_config: KVTransferConfig) -> None:
    """Scheduler half holds, worker half binds the cache, the server (another thread)
    sends it: one engine's state, reached through the object both halves were given."""
    prefill_sched, prefill_worker = create_kv_connectors(kv_config)
    decode = KVSideChannelConnector(
        KVTransferConfig("KVSideChannelConnector", "kv_consumer", {"timeout_s": 5.0}),
        KVConnectorRole.WORKER,
    )
    try:
        src = caches()
        prefill_worker.save_kv(src)
        request = finished("r2")
        _, params = prefill_sched.request_finished(request, [4, 1, 2])
        assert params is not None
        remote = parse_remote_prefill(params, request)
        assert not isinstance(remote, str), remote
        dst = caches()
        data = decode.transfer(PullLoad("d2", [0, 3, 5], remote), dst)
        decode.land(PullLoad("d2", [0, 3, 5], remote), data, dst)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, [0, 3, 5]], s[:, [4, 1, 2]])
        # The server thread frees the hold once it has sent (the client may see the bytes
        # first); the worker half then reports the request done.
        deadline = time.monotonic() + 10
        while prefill_sched.num_requests_held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefill_sched.num_requests_held == 0
        sent, _ = prefill_worker.get_finished(set())
        assert sent == {"r2"}
        assert prefill_sched.num_tokens_sent == len(PROMPT)
    finally:
        prefill_sched.close()


def test_ec_side_channel_halves_share_one_store_per_engine() -> None:
    config = ECTransferConfig("ECSideChannelConnector", "ec_both", {"port": 0})
    (s1, w1), (s2, w2) = create_ec_connectors(config), create_ec_connectors(config)
    alone = create_ec_connector(config, ECConnectorRole.WORKER)
    try:
        stores = [c.store for c in (s1, w1, s2, w2, alone)]
        assert stores[0] is stores[1] and stores[2] is stores[3]
        assert len({id(s) for s in stores}) == 3
        assert s1.staging is w1.staging and s1.staging is not s2.staging
        ports = {s.server.port for s in stores if s is not None}
        assert len(ports) == 3
        # What the worker half saves, the scheduler half of the same engine offers.
        out = torch.ones(3, 4)
        w1.save_caches({"ab" * 16: out}, "ab" * 16)
        assert w1.num_items_held() == 1 and s1.num_items_held() == 1
        assert s2.num_items_held() == 0 and alone.num_items_held() == 0
    finally:
        for c in (s1, s2, alone):
            c.close()


def test_a_connector_without_shared_state_gets_plain_halves(tmp_path: Any) -> None:
    config = ECTransferConfig(
        "ECSharedStorageConnector", "ec_both", {"shared_storage_path": str(tmp_path)}
    )
    sched, worker = create_ec_connectors(config)
    assert (sched.role, worker.role) == (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER)
    assert sched is not worker
