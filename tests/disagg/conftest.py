"""Real ``ec-frontend serve`` / ``ec-frontend proxy`` processes on loopback.

A :class:`Proc` runs one subcommand on a free port and waits for ``/health``.
Deployments are built from these in module fixtures, so the model loads once
per instance per test module.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from ec_frontend.metrics import parse_text
from PIL import Image

STARTUP_TIMEOUT_S = 180.0
MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """One ``ec-frontend`` process (``serve`` or ``proxy``); its log goes to a temp file."""

    def __init__(self, command: str, args: Sequence[str], name: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ec_frontend.entrypoints.cli", command]
        cmd += ["--port", str(self.port), "--log-level", "warning", *args]
        fd, self.logpath = tempfile.mkstemp(prefix=f"ec-{name}-", suffix=".log")
        self.logfile = os.fdopen(fd, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.logfile, stderr=subprocess.STDOUT)

    def wait_ready(self) -> Proc:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"{self.name} did not become healthy in time:\n{self.log()}")

    def log(self) -> str:
        return Path(self.logpath).read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        return parse_text(httpx.get(self.url + "/metrics", timeout=10.0).text)

    def metric(self, name: str) -> float:
        return self.metrics().get("ec_frontend_" + name, 0.0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.logfile.close()
        os.unlink(self.logpath)
        return int(self.proc.returncode)


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


def start_all(procs: Sequence[Proc]) -> list[Proc]:
    """Wait for processes started together (they load in parallel)."""
    try:
        for p in procs:
            p.wait_ready()
    except Exception:
        for p in procs:
            p.kill()
        raise
    return list(procs)


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
