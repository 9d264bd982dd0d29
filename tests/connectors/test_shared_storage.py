"""ECSharedStorageConnector on real files: round trip, misses, concurrency, containment,
capacity."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.config import ConfigError, ECTransferConfig
from ec_frontend.connectors.base import (
    ECConnectorMetadata,
    ECConnectorRole,
    ECLoadSpec,
)
from ec_frontend.connectors.example_storage import ECExampleConnector
from ec_frontend.connectors.factory import create_ec_connector, ec_connector_names
from ec_frontend.connectors.noop import NoOpECConnector
from ec_frontend.connectors.shared_storage import ECSharedStorageConnector


def h(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def connector(
    path: Path, role: str, *, worker: bool = True, **extra: Any
) -> ECSharedStorageConnector:
    config = ECTransferConfig(
        "ECSharedStorageConnector", role, {"shared_storage_path": str(path), **extra}
    )
    side = ECConnectorRole.WORKER if worker else ECConnectorRole.SCHEDULER
    conn = create_ec_connector(config, side)
    assert isinstance(conn, ECSharedStorageConnector)
    return conn


def load(conn: ECSharedStorageConnector, specs: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}
    meta = ECConnectorMetadata([ECLoadSpec(mm_hash, n, "r") for mm_hash, n in specs])
    with conn.bound(meta):
        conn.start_load_caches(cache)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_producer_writes_consumer_loads_identical(tmp_path: Path, dtype: torch.dtype) -> None:
    producer = connector(tmp_path, "ec_producer")
    consumer = connector(tmp_path, "ec_consumer")
    scheduler_side = connector(tmp_path, "ec_consumer", worker=False)
    tensors = {h(f"img{i}"): torch.randn(4 + i, 16).to(dtype) for i in range(3)}
    for mm_hash in tensors:
        assert not scheduler_side.has_cache_item(mm_hash)
        producer.save_caches(tensors, mm_hash)
        assert scheduler_side.has_cache_item(mm_hash)
    loaded = load(consumer, [(k, v.shape[0]) for k, v in tensors.items()])
    assert loaded.keys() == tensors.keys()
    for k, v in tensors.items():
        assert loaded[k].dtype == dtype
        assert torch.equal(loaded[k], v)
    assert producer.stats.items_saved == 3
    assert consumer.stats.items_loaded == 3 and consumer.stats.load_failures == 0
    assert sorted(os.listdir(tmp_path)) == sorted(f"{k}.safetensors" for k in tensors)


@pytest.mark.parametrize(
    "damage",
    ["truncate", "garbage", "empty", "wrong_rows", "wrong_key", "missing"],
)
def test_bad_file_is_a_counted_miss(tmp_path: Path, damage: str) -> None:
    producer = connector(tmp_path, "ec_producer")
    consumer = connector(tmp_path, "ec_consumer")
    mm_hash = h("img")
    producer.save_caches({mm_hash: torch.randn(8, 16)}, mm_hash)
    path = tmp_path / f"{mm_hash}.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "wrong_rows":
        producer.save_caches({mm_hash: torch.randn(5, 16)}, mm_hash)
    elif damage == "wrong_key":
        from safetensors.torch import save_file

        save_file({"other": torch.randn(8, 16)}, str(path))
    else:
        path.unlink()
    assert load(consumer, [(mm_hash, 8)]) == {}
    assert consumer.stats.load_failures == 1
    assert consumer.stats.items_loaded == 0


def test_concurrent_writers_of_one_hash(tmp_path: Path) -> None:
    mm_hash = h("shared")
    value = torch.randn(64, 32)
    writers = [connector(tmp_path, "ec_producer") for _ in range(8)]
    consumer = connector(tmp_path, "ec_consumer")
    start = threading.Barrier(len(writers) + 1)
    errors: list[BaseException] = []
    loads: list[dict[str, torch.Tensor]] = []

    def write(conn: ECSharedStorageConnector) -> None:
        try:
            start.wait()
            for _ in range(10):
                conn.save_caches({mm_hash: value}, mm_hash)
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        start.wait()
        for _ in range(30):
            loads.append(load(consumer, [(mm_hash, 64)]))

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # A reader sees the whole tensor or (before the first rename) nothing, never a torn file.
    assert consumer.stats.load_failures + consumer.stats.items_loaded == 30
    for got in loads:
        if got:
            assert torch.equal(got[mm_hash], value)
    assert os.listdir(tmp_path) == [f"{mm_hash}.safetensors"]  # no temp files left
    assert torch.equal(load(consumer, [(mm_hash, 64)])[mm_hash], value)


@pytest.mark.slow
def test_concurrent_writer_processes(tmp_path: Path) -> None:
    mm_hash = h("proc")
    script = (
        "import sys, torch\n"
        "from ec_frontend.connectors.base import ECConnectorRole\n"
        "from ec_frontend.connectors.factory import create_ec_connector\n"
        "from ec_frontend.config import ECTransferConfig\n"
        "cfg = ECTransferConfig('ECSharedStorageConnector', 'ec_producer',"
        " {'shared_storage_path': sys.argv[1]})\n"
        "conn = create_ec_connector(cfg, ECConnectorRole.WORKER)\n"
        "t = torch.arange(4096, dtype=torch.float32).reshape(128, 32)\n"
        "for _ in range(20):\n"
        "    conn.save_caches({sys.argv[2]: t}, sys.argv[2])\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path), mm_hash]) for _ in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    got = load(connector(tmp_path, "ec_consumer"), [(mm_hash, 128)])
    assert torch.equal(got[mm_hash], torch.arange(4096, dtype=torch.float32).reshape(128, 32))
    assert os.listdir(tmp_path) == [f"{mm_hash}.safetensors"]


@pytest.mark.parametrize(
    "bad",
    [
        "../escape",
        "/etc/passwd",
        "ABCDEF",
        "ab/cd",
        "ab\x00cd",
        "",
        "g" * 8,
        "a" * 129,
        "..",
        "ab.",
    ],
)
def test_invalid_hashes_never_touch_the_filesystem(tmp_path: Path, bad: str) -> None:
    inner = tmp_path / "store"
    producer = connector(inner, "ec_producer")
    scheduler_side = connector(inner, "ec_consumer", worker=False)
    consumer = connector(inner, "ec_consumer")
    assert not scheduler_side.has_cache_item(bad)
    with pytest.raises(ValueError, match="invalid mm_hash"):
        producer.save_caches({bad: torch.zeros(1, 4)}, bad)
    assert load(consumer, [(bad, 1)]) == {}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["store"]


def test_existence_check_has_no_side_effects(tmp_path: Path) -> None:
    missing_dir = tmp_path / "not-created"
    consumer = connector(missing_dir, "ec_consumer", worker=False)
    assert not consumer.has_cache_item(h("x"))
    assert not missing_dir.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "num_saves", "want_left"),
    [
        ({"max_items": 3}, 6, 3),
        ({"max_items": 1}, 4, 1),
        ({"max_bytes": 3 * 1200}, 6, 3),  # each file ~1.1 KB
        ({"max_items": 10, "max_bytes": 2 * 1200}, 5, 2),
    ],
)
def test_capacity_bound_evicts_oldest(
    tmp_path: Path, extra: dict[str, int], num_saves: int, want_left: int
) -> None:
    producer = connector(tmp_path, "ec_producer", **extra)
    hashes = [h(f"img{i}") for i in range(num_saves)]
    for i, mm_hash in enumerate(hashes):
        producer.save_caches({mm_hash: torch.randn(16, 16)}, mm_hash)
        os.utime(tmp_path / f"{mm_hash}.safetensors", ns=(i * 10**9, i * 10**9))
    producer.save_caches({hashes[-1]: torch.randn(16, 16)}, hashes[-1])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(f"{x}.safetensors" for x in hashes[-want_left:])
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    if "max_bytes" in extra:
        assert total <= extra["max_bytes"]


def test_request_finished_names_stored_items(tmp_path: Path, h_engine: Any) -> None:
    producer = connector(tmp_path, "ec_producer")
    sched_side = connector(tmp_path, "ec_producer", worker=False)
    request = h_engine.fake_request("r", 20, images=[("a", 0, 4), ("b", 10, 4)])
    a, b = (f.mm_hash for f in request.mm_features)
    producer.save_caches({a: torch.randn(4, 8)}, a)
    assert sched_side.request_finished(request) == (
        False,
        {
            a: {
                "num_tokens": 4,
                "modality": "image",
                "item_indices": [0],
                "metadata": {"image_grid_thw": [1, 2, 8]},
            }
        },
    )
    consumer = connector(tmp_path, "ec_consumer", worker=False)
    assert consumer.request_finished(request) == (False, None)
    assert b not in os.listdir(tmp_path)


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"ec_connector": "ECSharedStorageConnector", "ec_role": "ec_producer"},
         "shared_storage_path"),
        ({"ec_connector": "Nope", "ec_role": "ec_producer"}, "unknown EC connector"),
        ({"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
          "ec_connector_extra_config": {"shared_storage_path": "/tmp/x", "max_items": 0}},
         "max_items"),
    ],
)  # fmt: skip
def test_factory_errors(config: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        create_ec_connector(ECTransferConfig.from_json(config), ECConnectorRole.WORKER)


def test_factory_example_and_noop(tmp_path: Path) -> None:
    assert {"ECSharedStorageConnector", "ECExampleConnector", "NoOpECConnector"} <= set(
        ec_connector_names()
    )
    example = create_ec_connector(
        ECTransferConfig("ECExampleConnector", "ec_both", {"shared_storage_path": str(tmp_path)}),
        ECConnectorRole.SCHEDULER,
    )
    assert type(example) is ECExampleConnector
    assert example.is_producer and example.is_consumer
    noop = create_ec_connector(ECTransferConfig("NoOpECConnector", "ec_consumer"),
                               ECConnectorRole.WORKER)  # fmt: skip
    assert isinstance(noop, NoOpECConnector)


@pytest.mark.slow
def test_factory_imports_connectors_lazily() -> None:
    code = (
        "import sys\n"
        "import ec_frontend.connectors.factory\n"
        "import ec_frontend.engine.core\n"
        "assert 'ec_frontend.connectors.shared_storage' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
