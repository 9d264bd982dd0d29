"""Real ``ec-frontend serve`` / ``ec-frontend proxy`` processes on loopback.

:func:`serve` and :func:`proxy` start one subcommand each as a ``Proc`` of
``tests/helpers/processes.py``, which runs it on a free port and waits for
``/health``. Deployments are built from these in module fixtures, so the model loads once
per instance per test module.

Every instance and proxy gets the transfer secret :data:`SECRET` (through
``$EC_FRONTEND_TRANSFER_SECRET``) unless started with ``secret=None``: the
suite runs with signed transfer params, and ``test_epd_unsigned.py`` runs the
main flows without a secret (the consumers name their peers with
``--transfer-peers``: with neither, an instance ignores every transfer param).
A test that changes params on purpose re-signs them with :func:`resign` (it
plays the trusted producer).
"""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from ec_frontend.config import TRANSFER_SECRET_ENV
from ec_frontend.connectors.transfer_trust import SIGNATURE_KEY, signed
from PIL import Image

from ..helpers.processes import Proc

MODEL_NAME = "tiny"
SECRET = "disagg-suite-transfer-secret-0123"


def _env(secret: str | None) -> dict[str, str]:
    return {TRANSFER_SECRET_ENV: secret or ""}


def resign(kind: str, key: str, entry: dict[str, Any], secret: str = SECRET) -> dict[str, Any]:
    """``entry`` signed afresh with the suite's secret (after a test changed it)."""
    body = {k: v for k, v in entry.items() if k != SIGNATURE_KEY}
    return signed(secret.encode(), kind, key, body, 60.0)


def resign_ec(params: dict[str, Any], secret: str = SECRET, **change: Any) -> dict[str, Any]:
    """EC params with ``change`` applied to every entry, signed afresh."""
    return {h: resign("ec", h, {**e, **change}, secret) for h, e in params.items()}


def serve(
    model_dir: Path,
    name: str,
    *,
    ec: dict[str, Any] | None = None,
    kv: dict[str, Any] | None = None,
    extra: Sequence[str] = (),
    secret: str | None = SECRET,
) -> Proc:
    args = ["--model", str(model_dir), "--device", "cpu", "--max-model-len", "1024",
            "--served-model-name", MODEL_NAME, *extra]  # fmt: skip
    if ec is not None:
        args += ["--ec-transfer-config", json.dumps(ec)]
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    return Proc("serve", args, name, env=_env(secret))


def proxy(
    name: str,
    *,
    encode: Sequence[str] = (),
    prefill: Sequence[str] = (),
    decode: Sequence[str],
    extra: Sequence[str] = (),
    secret: str | None = SECRET,
) -> Proc:
    args: list[str] = []
    if encode:
        args += ["--encode", *encode]
    if prefill:
        args += ["--prefill", *prefill]
    args += ["--decode", *decode, *extra]
    return Proc("proxy", args, name, env=_env(secret))


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


class RelayEncoder:
    """An encoder as a proxy sees it, in front of a real one: each request is passed to
    ``real`` (an ``ec-frontend serve`` URL) and a 200 answer's ``ec_transfer_params``
    go through ``change`` first (a test plays what happened to the items meanwhile: the
    encoder died, the store evicted them)."""

    def __init__(self, real: str, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                r = httpx.post(real + self.path, content=body, timeout=60,
                               headers={"content-type": "application/json"})  # fmt: skip
                data = r.json()
                if r.status_code == 200 and data.get("ec_transfer_params"):
                    data["ec_transfer_params"] = change(data["ec_transfer_params"])
                out = json.dumps(data).encode()
                self.send_response(r.status_code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
