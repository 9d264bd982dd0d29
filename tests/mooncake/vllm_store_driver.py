"""Runs in vLLM's venv: vLLM 0.33's Mooncake Store embedding client, unmodified.

Usage: ``python vllm_store_driver.py WORKDIR``. ``WORKDIR/request.json`` names the
Mooncake config file (vLLM reads it from ``$MOONCAKE_CONFIG_PATH``), the namespace
settings, the item to read (put by ec-frontend: its id, shape, and a file with the
expected tensor) and the item to write (its id and a file with the tensor). The
namespace, the key, the value's header and the I/O are all vLLM's code:
``build_embedding_namespace``, ``make_embedding_key``,
``create_mooncake_embedding_store_client`` (``load_tensors``, ``put_tensor``).
Writes ``WORKDIR/result.json``, then waits for ``WORKDIR/done`` before it closes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    TensorSpec,
    build_embedding_namespace,
    make_embedding_key,
)
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client import (
    create_mooncake_embedding_store_client,
)


def main() -> None:
    work = Path(sys.argv[1])
    req = json.loads((work / "request.json").read_text())
    os.environ["MOONCAKE_CONFIG_PATH"] = req["mooncake_config"]
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            model=req["model"], revision=None, multimodal_config=None, dtype=torch.float32
        ),
        ec_transfer_config=SimpleNamespace(ec_connector_extra_config=req["extra"]),
    )
    namespace = build_embedding_namespace(config)
    client = create_mooncake_embedding_store_client(read_buffer_bytes=16 << 20)
    read = req["read"]
    key = make_embedding_key(namespace, read["id"])
    expected = torch.load(read["tensor"])
    spec = TensorSpec(tuple(expected.shape), str(expected.dtype), expected.nbytes)
    exists = client.batch_exists([key])[0]
    loaded = client.load_tensors({key: spec}, "cpu")
    write = req["write"]
    tensor = torch.load(write["tensor"])
    write_key = make_embedding_key(namespace, write["id"])
    client.put_tensor(write_key, tensor)
    result = {
        "namespace": namespace,
        "read_key": key,
        "exists": exists,
        "read_equal": key in loaded and torch.equal(loaded[key], expected),
        "write_key": write_key,
        "write_exists": client.exists(write_key),
    }
    (work / "result.tmp").write_text(json.dumps(result))
    os.replace(work / "result.tmp", work / "result.json")
    # The item put here may sit in this client's own segment, which leaves the store
    # with the client: stay until the other side has read it (``WORKDIR/done``).
    deadline = time.monotonic() + 120
    while not (work / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    client.close()


if __name__ == "__main__":
    main()
