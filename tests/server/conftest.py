"""Real server processes on loopback for the server tests.

A :class:`ServerProcess` runs ``python -m ec_frontend.entrypoints.cli serve`` on a
free port and waits for ``/health`` (it is a ``tests/helpers/processes.py`` ``Proc``).
Fixtures share one process per module (the model loads once); each test gets
the base URL and talks HTTP to it.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from ..helpers.processes import Proc

API_KEY = "test-key"
MAX_BODY = 4_000_000
MOCK_MODEL = "mock-model"
MODEL_NAME = "tiny"


class ServerProcess(Proc):
    """One ``ec-frontend serve`` process, healthy once constructed; :meth:`stop` must give 0."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        program: list[str] | None = None,
    ) -> None:
        super().__init__("serve", args, "server", env=env, program=program)
        self.wait_ready()


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


def responses_image_input(text: str, image_url: str) -> list[dict[str, Any]]:
    """A Responses API ``input``: one user message with a text part and an image part."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": text},
                {"type": "input_image", "image_url": image_url, "detail": "auto"},
            ],
        }
    ]
