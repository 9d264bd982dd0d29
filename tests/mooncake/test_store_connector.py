"""``MooncakeStoreECConnector`` against a real ``mooncake_master`` on loopback.

Two connectors with separate Store clients play the encoder and a consumer
(as two instances would); a third raw ``MooncakeDistributedStore`` client
inspects and deletes what they stored. Covers the key namespace and value
bytes, reuse by several consumers, a key removed between lookup and read, a
corrupt value, and a master that is killed or stops answering (every call
returns within the configured timeout, and the items are plain misses).
"""

from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ec_frontend.config import ConfigError, ECTransferConfig
from ec_frontend.connectors.base import ECConnectorMetadata, ECConnectorRole, ECLoadSpec
from ec_frontend.connectors.mooncake_store import (
    MooncakeStoreECConnector,
    ReadArena,
    embedding_key,
    embedding_namespace,
)

from .conftest import Master, raw_client, until

H1, H2, H3 = "ab" * 16, "cd" * 16, "ef" * 16


def connector(master: Master, role: str, **extra: Any) -> MooncakeStoreECConnector:
    extra = master.store_extra(**{"timeout_s": 2.0, **extra})
    config = ECTransferConfig.from_json(
        {
            "ec_connector": "MooncakeStoreECConnector",
            "ec_role": role,
            "ec_connector_extra_config": extra,
        }
    )
    return MooncakeStoreECConnector(config, ECConnectorRole.WORKER)


def load(c: MooncakeStoreECConnector, *specs: tuple[str, int]) -> dict[str, torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}
    meta = ECConnectorMetadata(loads=[ECLoadSpec(h, n, "r") for h, n in specs])
    with c.bound(meta):
        c.start_load_caches(cache)
    return cache


@pytest.fixture
def pair(master: Master) -> Iterator[tuple[MooncakeStoreECConnector, MooncakeStoreECConnector]]:
    yield connector(master, "ec_producer"), connector(master, "ec_consumer")


def test_put_get_in_vllm_layout(master: Master, pair: Any) -> None:
    producer, consumer = pair
    out = torch.randn(7, 24)
    assert not consumer.has_cache_item(H1)
    producer.save_caches({H1: out}, H1)
    assert producer.stats.items_saved == 1
    assert consumer.has_cache_item(H1)

    key = embedding_key(embedding_namespace(model="default"), H1)
    assert key == (
        "embedding@model:default@revision:default@encoder:encoder:default"
        f"@dtype:torch.float32@protocol:v3@id:{H1}"
    )
    raw = raw_client(master)
    value = raw.get(key)
    assert struct.unpack_from("<IIQQ", value) == (0x4D4F4F4E, 0, 7, 24)
    assert value[24:] == out.numpy().tobytes()

    for c in (consumer, connector(master, "ec_consumer")):  # any number of consumers
        got = load(c, (H1, 7))
        assert torch.equal(got[H1], out)
        assert c.stats.items_loaded == 1
    # The producer does not put an item twice.
    producer.save_caches({H1: out}, H1)
    assert producer.stats.items_saved == 1


def test_reads_land_in_the_arena_and_give_their_span_back(master: Master) -> None:
    """Values are read into the registered arena in place; a span is free again once
    the last tensor on it (views included) is gone; a value the free spans cannot hold
    is read into a tensor of its own."""
    producer = connector(master, "ec_producer")
    # Room for two 1 KiB values (and their alignment), not three.
    consumer = connector(master, "ec_consumer", store_read_buffer_bytes=2 * 1024 + 64)
    values = {h: torch.randn(8, 32) for h in (H1, H2, H3)}
    for h, v in values.items():
        producer.save_caches({h: v}, h)
    first = load(consumer, (H1, 8), (H2, 8))
    arena = consumer.store.arena
    assert arena is not None and arena.nbytes == 2 * 1024 + 64
    assert all(arena.holds(t.data_ptr()) for t in first.values())
    assert arena.free_bytes() == 64
    third = load(consumer, (H3, 8))[H3]
    assert not arena.holds(third.data_ptr())
    for h, t in (*first.items(), (H3, third)):
        assert torch.equal(t, values[h])
    view = first[H1][2:4]
    del first, third
    assert arena.free_bytes() == 64 + 1024  # H2's span is back; H1's view holds its own
    assert torch.equal(view, values[H1][2:4])
    del view
    assert arena.free_bytes() == arena.nbytes
    # The arena is used again, from its start.
    again = load(consumer, (H2, 8))[H2]
    assert again.data_ptr() == arena.base and torch.equal(again, values[H2])


def test_arena_spans_merge_in_any_order() -> None:
    arena = ReadArena(8 * 64)
    held = [arena.tensor((16,), torch.float32) for _ in range(8)]
    assert all(t is not None for t in held) and arena.tensor((1,), torch.float32) is None
    for i in (3, 1, 2, 7, 0, 5, 6, 4):
        held[i] = None
    assert arena.free_bytes() == arena.nbytes and arena._free == [(0, arena.nbytes)]
    whole = arena.tensor((8 * 16,), torch.float32)
    assert whole is not None and whole.data_ptr() == arena.base


def test_namespace_options_change_the_key(master: Master) -> None:
    producer = connector(
        master,
        "ec_producer",
        embedding_cache_prefix="team",
        embedding_model_identity="org/m",
        embedding_dtype="torch.bfloat16",
    )
    assert producer.store.key(H1) == (
        "team@embedding@model:org/m@revision:default@encoder:encoder:default"
        f"@dtype:torch.bfloat16@protocol:v3@id:{H1}"
    )
    # A float32 output is not put under bfloat16 keys.
    producer.save_caches({H1: torch.ones(2, 4)}, H1)
    assert producer.stats.items_saved == 0
    assert not producer.has_cache_item(H1)
    producer.save_caches({H1: torch.ones(2, 4, dtype=torch.bfloat16)}, H1)
    assert producer.has_cache_item(H1)


def test_missing_evicted_corrupt_and_wrong_rows_are_misses(master: Master, pair: Any) -> None:
    producer, consumer = pair
    producer.save_caches({H1: torch.ones(3, 8)}, H1)
    producer.save_caches({H2: torch.ones(3, 8)}, H2)
    assert consumer.has_cache_item(H1)
    raw = raw_client(master)
    # Evicted between lookup and read: removable once the master's lease (200 ms) ran out.
    assert until(lambda: raw.remove(producer.store.key(H1)) == 0)
    got = load(consumer, (H1, 3), (H2, 4))  # H2 has 3 rows, the request expects 4
    assert got == {}
    assert consumer.stats.load_failures == 2

    bad = ctypes.create_string_buffer(struct.pack("<IIQQ", 0xDEAD, 0, 1, 2) + bytes(8))
    assert raw.put(producer.store.key(H1), bytes(bad.raw[:32])) == 0
    assert load(consumer, (H1, 1)) == {}
    assert consumer.stats.load_failures == 3
    assert not consumer.has_cache_item("NOT-HEX")


def test_master_killed_items_are_misses_quickly(master: Master, pair: Any) -> None:
    producer, consumer = pair
    producer.save_caches({H1: torch.ones(3, 8)}, H1)
    master.kill()
    start = time.monotonic()
    assert not consumer.has_cache_item(H1)
    assert load(consumer, (H1, 3)) == {}
    producer.save_caches({H2: torch.ones(3, 8)}, H2)
    assert producer.stats.items_saved == 1
    # Five store calls, each bounded by timeout_s (2 s); a refused connection fails
    # at once, so this is a bound with room for a loaded host, not the usual time.
    assert time.monotonic() - start < 5 * 2 + 5


def test_master_that_never_answers_is_bounded_by_timeout(master: Master, pair: Any) -> None:
    producer, consumer = pair
    producer.save_caches({H1: torch.ones(3, 8)}, H1)
    master.pause()
    try:
        start = time.monotonic()
        consumer.has_cache_item(H1)  # a miss after timeout_s (2 s), or an answer before
        got = load(consumer, (H1, 3))  # refused at once while a call is stuck
        # One call waits out timeout_s (2 s); the next is refused while it is stuck.
        assert time.monotonic() - start < 2 * 2 + 6
        assert got == {} or torch.equal(got[H1], torch.ones(3, 8))
    finally:
        master.resume()


def test_unreachable_master_is_a_startup_error() -> None:
    dead = Master()
    dead.kill()
    with pytest.raises(ConfigError, match=r"master .* unreachable"):
        connector(dead, "ec_consumer", timeout_s=1.0)
    with pytest.raises(ConfigError, match="master_server_address"):
        MooncakeStoreECConnector(
            ECTransferConfig.from_json(
                {"ec_connector": "MooncakeStoreECConnector", "ec_role": "ec_consumer"}
            ),
            ECConnectorRole.WORKER,
        )


def test_items_of_another_width_after_the_first_read(pair: Any) -> None:
    """Reads after the first skip the size lookup (they assume its row width); an item
    of another width is then read through the lookup, and a wrong row count stays a miss."""
    producer, consumer = pair
    narrow, wide = torch.randn(3, 8), torch.randn(5, 24)
    producer.save_caches({H1: narrow}, H1)
    producer.save_caches({H2: wide}, H2)
    assert torch.equal(load(consumer, (H1, 3))[H1], narrow)
    assert consumer.store._width == 8
    got = load(consumer, (H2, 5), (H1, 3))
    assert torch.equal(got[H2], wide) and torch.equal(got[H1], narrow)
    assert load(consumer, (H2, 4)) == {}
    assert (consumer.stats.items_loaded, consumer.stats.load_failures) == (3, 1)
