"""Files of vLLM's ``ECExampleConnector`` and ours are interchangeable, both ways.

vLLM 0.33's connector code (``ec_example_driver.py``, run in the vLLM
environment) loads what ec-frontend's ``ECExampleConnector`` saved and saves
what ours then loads, on one shared directory; values are compared exactly.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from ec_frontend.config import ECTransferConfig
from ec_frontend.connectors.base import ECConnectorMetadata, ECConnectorRole, ECLoadSpec
from ec_frontend.connectors.factory import create_ec_connector
from safetensors.torch import load_file

from .conftest import run_vllm

pytestmark = pytest.mark.slow
DRIVER = Path(__file__).with_name("ec_example_driver.py")
DTYPES = ("float32", "bfloat16", "float16")


def h(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def values(rows: int, cols: int, dtype: str) -> torch.Tensor:
    """The same values the driver computes."""
    return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 7).to(
        getattr(torch, dtype)
    )


def test_vllm_and_ec_frontend_read_each_others_files(vllm_python: Path, tmp_path: Path) -> None:
    root = tmp_path / "ec"
    config = ECTransferConfig("ECExampleConnector", "ec_both", {"shared_storage_path": str(root)})
    ours = create_ec_connector(config, ECConnectorRole.WORKER)
    ours_sched = create_ec_connector(config, ECConnectorRole.SCHEDULER)
    written = {h(f"ours-{d}"): torch.randn(9, 24).to(getattr(torch, d)) for d in DTYPES}
    for mm_hash in written:
        ours.save_caches(written, mm_hash)
    theirs = {h(f"vllm-{d}"): (11, 32, d) for d in DTYPES}
    spec = {
        "root": str(root),
        "load": [[mm_hash, 9] for mm_hash in written],
        "save": [[mm_hash, *shape] for mm_hash, shape in theirs.items()],
        "out": str(tmp_path / "vllm_loaded.safetensors"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = run_vllm(vllm_python, [str(DRIVER), str(tmp_path / "spec.json")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    # vLLM found and loaded every file ec-frontend wrote, bit for bit.
    assert report == {"found": dict.fromkeys(written, True), "loaded": sorted(written)}
    loaded_by_vllm = load_file(spec["out"])
    for mm_hash, tensor in written.items():
        assert loaded_by_vllm[mm_hash].dtype == tensor.dtype
        assert torch.equal(loaded_by_vllm[mm_hash], tensor)

    # ec-frontend finds and loads every file vLLM wrote, bit for bit.
    cache: dict[str, torch.Tensor] = {}
    loads = [ECLoadSpec(mm_hash, rows, "r") for mm_hash, (rows, _, _) in theirs.items()]
    with ours.bound(ECConnectorMetadata(loads)):
        ours.start_load_caches(cache)
    assert ours.stats.load_failures == 0
    for mm_hash, shape in theirs.items():
        assert ours_sched.has_cache_item(mm_hash)
        assert (root / mm_hash / "encoder_cache.safetensors").is_file()
        assert torch.equal(cache[mm_hash], values(*shape))
