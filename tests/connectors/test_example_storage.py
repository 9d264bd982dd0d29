"""ECExampleConnector on real files: vLLM's layout, containment, capacity."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.config import ECTransferConfig
from ec_frontend.connectors.base import ECConnectorMetadata, ECConnectorRole, ECLoadSpec
from ec_frontend.connectors.example_storage import ECExampleConnector
from ec_frontend.connectors.factory import create_ec_connector
from safetensors.torch import load_file, save_file


def h(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def connector(path: Path, role: str, *, worker: bool = True, **extra: Any) -> ECExampleConnector:
    config = ECTransferConfig(
        "ECExampleConnector", role, {"shared_storage_path": str(path), **extra}
    )
    side = ECConnectorRole.WORKER if worker else ECConnectorRole.SCHEDULER
    conn = create_ec_connector(config, side)
    assert isinstance(conn, ECExampleConnector)
    return conn


def load(conn: ECExampleConnector, specs: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}
    with conn.bound(ECConnectorMetadata([ECLoadSpec(m, n, "r") for m, n in specs])):
        conn.start_load_caches(cache)
    return cache


def test_save_writes_one_directory_per_item_with_key_ec_cache(tmp_path: Path) -> None:
    producer = connector(tmp_path, "ec_producer")
    mm_hash = h("img")
    value = torch.randn(12, 8).to(torch.bfloat16)
    producer.save_caches({mm_hash: value}, mm_hash)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        mm_hash,
        f"{mm_hash}/encoder_cache.safetensors",
    ]
    stored = load_file(tmp_path / mm_hash / "encoder_cache.safetensors")
    assert list(stored) == ["ec_cache"]
    assert torch.equal(stored["ec_cache"], value)
    assert connector(tmp_path, "ec_consumer", worker=False).has_cache_item(mm_hash)


def test_reads_a_file_it_did_not_write(tmp_path: Path) -> None:
    mm_hash = h("foreign")
    (tmp_path / mm_hash).mkdir()
    value = torch.randn(5, 16)
    save_file({"ec_cache": value}, str(tmp_path / mm_hash / "encoder_cache.safetensors"))
    consumer = connector(tmp_path, "ec_consumer")
    assert connector(tmp_path, "ec_consumer", worker=False).has_cache_item(mm_hash)
    assert torch.equal(load(consumer, [(mm_hash, 5)])[mm_hash], value)
    # Wrong row count, wrong key, the flat layout of ECSharedStorageConnector: misses.
    assert load(consumer, [(mm_hash, 6)]) == {}
    other = h("flat")
    save_file({"encoder_output": value}, str(tmp_path / f"{other}.safetensors"))
    assert not connector(tmp_path, "ec_consumer", worker=False).has_cache_item(other)
    assert load(consumer, [(other, 5)]) == {}
    wrong_key = h("key")
    (tmp_path / wrong_key).mkdir()
    save_file({"encoder_output": value}, str(tmp_path / wrong_key / "encoder_cache.safetensors"))
    assert load(consumer, [(wrong_key, 5)]) == {}
    assert consumer.stats.load_failures == 3
    assert consumer.stats.items_loaded == 1


def test_symlinks_at_either_level_are_misses_and_refused_saves(tmp_path: Path) -> None:
    root, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    secret = torch.randn(3, 4)
    save_file({"ec_cache": secret}, str(outside / "encoder_cache.safetensors"))
    producer = connector(root, "ec_producer")
    consumer = connector(root, "ec_consumer")
    scheduler_side = connector(root, "ec_consumer", worker=False)
    linked_dir, linked_file = h("dir"), h("file")
    (root / linked_dir).symlink_to(outside)
    (root / linked_file).mkdir()
    (root / linked_file / "encoder_cache.safetensors").symlink_to(
        outside / "encoder_cache.safetensors"
    )
    for mm_hash in (linked_dir, linked_file):
        assert not scheduler_side.has_cache_item(mm_hash)
        assert load(consumer, [(mm_hash, 3)]) == {}
    with pytest.raises(OSError):
        producer.save_caches({linked_dir: torch.zeros(3, 4)}, linked_dir)
    assert torch.equal(load_file(outside / "encoder_cache.safetensors")["ec_cache"], secret)
    assert sorted(p.name for p in outside.iterdir()) == ["encoder_cache.safetensors"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_invalid_hash_touches_nothing(tmp_path: Path) -> None:
    producer = connector(tmp_path / "store", "ec_producer")
    for bad in ("../escape", "ABC", "", "ab/cd"):
        with pytest.raises(ValueError, match="invalid mm_hash"):
            producer.save_caches({bad: torch.zeros(1, 4)}, bad)
        assert not connector(tmp_path / "store", "ec_consumer", worker=False).has_cache_item(bad)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["store"]


def test_capacity_evicts_oldest_items_and_their_directories(tmp_path: Path) -> None:
    producer = connector(tmp_path, "ec_producer", max_items=2)
    hashes = [h(f"img{i}") for i in range(4)]
    for i, mm_hash in enumerate(hashes):
        producer.save_caches({mm_hash: torch.randn(8, 8)}, mm_hash)
        os.utime(tmp_path / mm_hash / "encoder_cache.safetensors", ns=(i * 10**9, i * 10**9))
    producer.save_caches({hashes[-1]: torch.randn(8, 8)}, hashes[-1])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(hashes[-2:])
    consumer = connector(tmp_path, "ec_consumer")
    assert set(load(consumer, [(x, 8) for x in hashes])) == set(hashes[-2:])


def test_request_finished_reports_vllm_item_fields(tmp_path: Path, h_engine: Any) -> None:
    request = h_engine.fake_request("r", 30, images=[("a", 0, 4), ("b", 10, 6), ("a", 20, 4)])
    a, b, _ = (f.mm_hash for f in request.mm_features)
    producer = connector(tmp_path, "ec_producer")
    producer.save_caches({a: torch.randn(4, 8)}, a)
    producer.save_caches({b: torch.randn(6, 8)}, b)
    done, params = connector(tmp_path, "ec_producer", worker=False).request_finished(request)
    assert not done
    assert params == {
        a: {"modality": "image", "item_indices": [0, 2], "num_tokens": 4,
            "metadata": {"image_grid_thw": [1, 2, 8]}},
        b: {"modality": "image", "item_indices": [1], "num_tokens": 6,
            "metadata": {"image_grid_thw": [1, 2, 12]}},
    }  # fmt: skip
