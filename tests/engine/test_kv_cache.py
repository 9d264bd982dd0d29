"""KV block pool: sizing from a memory budget, all-or-nothing allocation, frees."""

from __future__ import annotations

import pytest
import torch
from ec_frontend.engine.kv_cache import KVCacheManager, num_blocks_for_budget
from ec_frontend.model.interface import KVCacheSpec


@pytest.mark.parametrize(
    ("spec", "block_size", "budget", "want"),
    [
        (KVCacheSpec(2, 2, 16, torch.float32), 16, 8192 * 10, 10),
        (KVCacheSpec(2, 2, 16, torch.float32), 16, 8192 * 10 + 8191, 10),
        (KVCacheSpec(2, 2, 16, torch.bfloat16), 16, 8192 * 10, 20),
        (
            KVCacheSpec(28, 4, 128, torch.bfloat16),
            16,
            1 << 30,
            (1 << 30) // (2 * 28 * 16 * 4 * 128 * 2),
        ),
    ],
)
def test_num_blocks_for_budget(spec: KVCacheSpec, block_size: int, budget: int, want: int) -> None:
    assert num_blocks_for_budget(spec, block_size, budget) == want


def test_allocate_grow_free() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=4)  # 8 usable
    assert kv.allocate("a", 5) is not None
    assert len(kv.block_table("a")) == 2
    assert kv.allocate("a", 8) == []  # still 2 blocks
    assert len(kv.allocate("a", 9) or []) == 1
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 5
    assert 0 not in kv.block_table("a")  # the null block is never handed out
    kv.free("a")
    assert kv.num_used_blocks == 0 and kv.usage == 0.0
    kv.free("a")  # idempotent


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable
    assert kv.allocate("a", 12) is not None
    assert kv.allocate("b", 8) is None
    assert not kv.has_request("b")
    assert kv.num_free_blocks == 1
    assert kv.allocate("b", 4) is not None
    assert kv.usage == 1.0
    tables = kv.block_table("a") + kv.block_table("b")
    assert len(set(tables)) == len(tables) == 4


def test_too_small_pool_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(1, 16)
