"""The connector base: bound metadata is cleared on every exit; no-op connectors."""

from __future__ import annotations

import pytest
from ec_frontend.connectors.base import ECConnectorMetadata, ECConnectorRole, ECLoadSpec
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.noop import NoOpECConnector, NoOpKVConnector


@pytest.mark.parametrize("fail", [False, True])
def test_bound_always_clears(fail: bool) -> None:
    conn = NoOpECConnector(None, ECConnectorRole.WORKER)
    meta = ECConnectorMetadata([ECLoadSpec("ab", 1, "r")])
    with pytest.raises(RuntimeError) if fail else _null(), conn.bound(meta):
        assert conn.metadata is meta
        if fail:
            raise RuntimeError("step failed")
    with pytest.raises(RuntimeError, match="not bound"):
        _ = conn.metadata


def test_noop_connectors_do_nothing() -> None:
    ec = NoOpECConnector(None, ECConnectorRole.SCHEDULER)
    assert not ec.has_cache_item("ab")
    assert not ec.is_producer and not ec.is_consumer
    assert ec.get_finished(set()) == (None, None)
    kv = NoOpKVConnector(None, KVConnectorRole.SCHEDULER)
    assert kv.get_finished({"x"}) == (None, None)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
