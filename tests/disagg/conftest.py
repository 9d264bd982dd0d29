"""Real ``ec-frontend serve`` / ``ec-frontend proxy`` processes on loopback.

:func:`serve` and :func:`proxy` start one subcommand each as a ``Proc`` of
``tests/helpers/processes.py``, which runs it on a free port and waits for
``/health``. Deployments are built from these in module fixtures, so the model loads once
per instance per test module.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from ..helpers.processes import Proc

MODEL_NAME = "tiny"


def serve(
    model_dir: Path,
    name: str,
    *,
    ec: dict[str, Any] | None = None,
    kv: dict[str, Any] | None = None,
    extra: Sequence[str] = (),
) -> Proc:
    args = ["--model", str(model_dir), "--device", "cpu", "--max-model-len", "1024",
            "--served-model-name", MODEL_NAME, *extra]  # fmt: skip
    if ec is not None:
        args += ["--ec-transfer-config", json.dumps(ec)]
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    return Proc("serve", args, name)


def proxy(
    name: str,
    *,
    encode: Sequence[str] = (),
    prefill: Sequence[str] = (),
    decode: Sequence[str],
    extra: Sequence[str] = (),
) -> Proc:
    args: list[str] = []
    if encode:
        args += ["--encode", *encode]
    if prefill:
        args += ["--prefill", *prefill]
    args += ["--decode", *decode, *extra]
    return Proc("proxy", args, name)


def side_channel_ec(role: str, **extra: Any) -> dict[str, Any]:
    return {"ec_connector": "ECSideChannelConnector", "ec_role": role,
            "ec_connector_extra_config": {"port": 0, **extra}}  # fmt: skip


def shared_storage_ec(role: str, path: Path) -> dict[str, Any]:
    return {"ec_connector": "ECSharedStorageConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(path)}}  # fmt: skip


def side_channel_kv(role: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KVSideChannelConnector", "kv_role": role,
            "kv_connector_extra_config": {"port": 0, **extra}}  # fmt: skip


def png_data_url(size: int, color: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    img = Image.new("RGB", (size, size), color)
    for x in range(0, size, 7):
        img.putpixel((x, (x * 3) % size), (255 - color[0], color[1] // 2, 90))
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def messages(text: str, *urls: str) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [image_part(u) for u in urls]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]
