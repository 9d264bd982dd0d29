"""Real server processes on loopback for the server tests.

A :class:`ServerProcess` runs ``python -m ec_frontend.entrypoints.cli serve`` on a
free port and waits for ``/health``. Fixtures share one process per module (the
model loads once); each test gets the base URL and talks HTTP to it.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

STARTUP_TIMEOUT_S = 120.0
API_KEY = "test-key"
MAX_BODY = 4_000_000
MOCK_MODEL = "mock-model"
MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One ``ec-frontend serve`` process; stopped with SIGTERM (it must exit 0)."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        program: list[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = program or [sys.executable, "-m", "ec_frontend.entrypoints.cli"]
        cmd = [*cmd, "serve", "--port", str(self.port), "--log-level", "warning", *args]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError("server did not become healthy in time")

    def output(self) -> str:
        """Everything the server printed so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def metrics(self) -> dict[str, float]:
        from ec_frontend.metrics import parse_text

        return parse_text(httpx.get(self.url + "/metrics", timeout=5.0).text)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, and return the exit code (killing it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def mock_server() -> Iterator[ServerProcess]:
    """A mock-engine server with an API key and a 4 MB body limit."""
    server = ServerProcess(
        [
            "--mock-engine",
            "--api-key",
            API_KEY,
            "--max-body-bytes",
            str(MAX_BODY),
            "--served-model-name",
            MOCK_MODEL,
            "alias-model",
        ]
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def model_server(builtin_model_dir: Path) -> Iterator[ServerProcess]:
    """The built-in model on the CPU, with the echo connectors of ``ec_test_connectors``."""
    here = Path(__file__).parent
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH")) if p),
        "EC_FRONTEND_PLUGINS": "ec_test_connectors",
    }
    server = ServerProcess(
        [
            "--model",
            str(builtin_model_dir),
            "--device",
            "cpu",
            "--max-model-len",
            "1024",
            "--served-model-name",
            MODEL_NAME,
            "--kv-transfer-config",
            '{"kv_connector": "EchoKVConnector", "kv_role": "kv_both"}',
            "--ec-transfer-config",
            '{"ec_connector": "EchoECConnector", "ec_role": "ec_both"}',
        ],
        env=env,
    )
    yield server
    assert server.stop() == 0


def png_data_url(size: int = 56, color: tuple[int, int, int] = (200, 30, 40)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
