"""Items in Mooncake Store exchanged with vLLM 0.33's own embedding store client.

ec-frontend's ``MooncakeStoreECConnector`` puts an encoder output; vLLM's
``create_mooncake_embedding_store_client`` (run unmodified in vLLM's venv by
``vllm_store_driver.py``, namespace and key from vLLM's
``build_embedding_namespace`` / ``make_embedding_key``) finds it under the same
key and reads the same tensor; vLLM's client puts another, which the connector
loads. Both sit on one real ``mooncake_master``. Without vLLM's venv the test
fails (run ``scripts/setup_vllm.sh`` and ``scripts/setup_mooncake.sh``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from ec_frontend.config import ECTransferConfig
from ec_frontend.connectors.base import ECConnectorMetadata, ECConnectorRole, ECLoadSpec
from ec_frontend.connectors.mooncake_store import MooncakeStoreECConnector

from ..interop.conftest import vllm_venv
from .conftest import Master

pytestmark = pytest.mark.slow

OURS, THEIRS = "0123abcd" * 4, "fedc9876" * 4
EXTRA = {"embedding_cache_prefix": "team", "embedding_model_identity": "org/tiny-vl"}


def test_vllm_reads_ours_and_we_read_vllms(master: Master, tmp_path: Path) -> None:
    python = vllm_venv() / "bin" / "python"
    assert python.is_file(), f"{python} is missing: run scripts/setup_vllm.sh"
    extra = master.store_extra(**EXTRA)
    ours = MooncakeStoreECConnector(
        ECTransferConfig.from_json({"ec_connector": "MooncakeStoreECConnector",
                                    "ec_role": "ec_both", "ec_connector_extra_config": extra}),
        ECConnectorRole.WORKER,
    )  # fmt: skip
    mine, theirs = torch.randn(9, 32), torch.randn(5, 32)
    ours.save_caches({OURS: mine}, OURS)
    torch.save(mine, tmp_path / "ours.pt")
    torch.save(theirs, tmp_path / "theirs.pt")
    (tmp_path / "mooncake.json").write_text(json.dumps({
        "metadata_server": master.metadata_server, "master_server_address": master.address,
        "protocol": "tcp", "device_name": "", "global_segment_size": "32MB",
        "local_buffer_size": "16MB"}))  # fmt: skip
    (tmp_path / "request.json").write_text(json.dumps({
        "mooncake_config": str(tmp_path / "mooncake.json"), "model": "unused", "extra": EXTRA,
        "read": {"id": OURS, "tensor": str(tmp_path / "ours.pt")},
        "write": {"id": THEIRS, "tensor": str(tmp_path / "theirs.pt")}}))  # fmt: skip
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    env.pop("VIRTUAL_ENV", None)
    driver = Path(__file__).with_name("vllm_store_driver.py")
    log = tmp_path / "driver.log"
    with log.open("wb") as out:
        run = subprocess.Popen([str(python), str(driver), str(tmp_path)], env=env,
                               stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "result.json").exists():
            assert run.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "vLLM's store client did not answer"
            time.sleep(0.05)
        _check_items(ours, json.loads((tmp_path / "result.json").read_text()), theirs)
    finally:
        (tmp_path / "done").touch()
        try:
            run.wait(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
    assert run.returncode == 0, log.read_text(errors="replace")[-4000:]


def _check_items(ours: MooncakeStoreECConnector, result: dict, theirs: torch.Tensor) -> None:
    """What vLLM's client saw of our item, and our read of the item it put (while its
    client, whose segment may hold that item, is still up)."""

    assert result["read_key"] == ours.store.key(OURS)
    assert result["namespace"] == (
        "team@embedding@model:org/tiny-vl@revision:default@encoder:encoder:default"
        "@dtype:torch.float32@protocol:v3"
    )
    assert result["exists"] and result["read_equal"]
    assert result["write_key"] == ours.store.key(THEIRS) and result["write_exists"]

    assert ours.has_cache_item(THEIRS)
    cache: dict[str, torch.Tensor] = {}
    with ours.bound(ECConnectorMetadata(loads=[ECLoadSpec(THEIRS, 5, "r")])):
        ours.start_load_caches(cache)
    assert torch.equal(cache[THEIRS], theirs)
