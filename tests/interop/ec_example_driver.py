"""Runs in the vLLM environment: vLLM 0.33's own ``ECExampleConnector`` code on a directory.

``python ec_example_driver.py SPEC.json``; SPEC has ``root``, ``load`` (a list of
``[mm_hash, num_tokens]``), ``save`` (a list of ``[mm_hash, rows, cols, dtype]``)
and ``out`` (a safetensors file for what was loaded). The connector is vLLM's
class, constructed with a namespace holding vLLM's ``ECTransferConfig`` in
place of a full ``VllmConfig``: a ``VllmConfig`` with an EC producer refuses to
build without a multimodal model, and the connector's constructor reads only
``ec_transfer_config`` and ``model_config``. vLLM's platform detection finds
no accelerator and no CPU build on this host, so its device type is set to
``cpu`` for the load. Saves and loads then go through the class's own
``save_caches``, ``has_cache_item``, ``build_connector_meta`` and
``start_load_caches``.
"""

import json
import sys
import types

import torch
from safetensors.torch import save_file
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
from vllm.platforms import current_platform


def values(rows: int, cols: int, dtype: str) -> torch.Tensor:
    return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 7).to(
        getattr(torch, dtype)
    )


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if not current_platform.device_type:
        current_platform.device_type = "cpu"
    config = types.SimpleNamespace(
        model_config=None,
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECExampleConnector",
            ec_role="ec_both",
            ec_connector_extra_config={"shared_storage_path": spec["root"]},
        ),
    )
    connector = ECExampleConnector(config, ECConnectorRole.WORKER)
    for mm_hash, rows, cols, dtype in spec["save"]:
        connector.save_caches({mm_hash: values(rows, cols, dtype)}, mm_hash)
    found = {mm_hash: connector.has_cache_item(mm_hash) for mm_hash, _ in spec["load"]}
    for mm_hash, num_tokens in spec["load"]:
        connector._mm_datas_need_loads[mm_hash] = num_tokens
    connector.bind_connector_metadata(connector.build_connector_meta(None))
    cache: dict[str, torch.Tensor] = {}
    connector.start_load_caches(cache)
    save_file({k: v.contiguous() for k, v in cache.items()}, spec["out"])
    print(json.dumps({"found": found, "loaded": sorted(cache)}))


if __name__ == "__main__":
    main()
