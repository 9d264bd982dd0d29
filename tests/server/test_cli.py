"""``ec-frontend serve`` refuses bad flags with a message and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ec_frontend.entrypoints.cli import build_parser

pytestmark = pytest.mark.slow


def test_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.mock_engine) == ("127.0.0.1", 8000, None, False)
    assert args.max_body_bytes == 64 * 1024 * 1024


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--port", "0"], 2, "--port must be > 0"),
        (["--max-body-bytes", "-5"], 2, "--max-body-bytes must be > 0"),
        (["--dtype", "int3"], 2, "invalid choice"),
        (["--kv-transfer-config", "{nope"], 2, "kv_transfer_config is not valid JSON"),
        (
            ["--ec-transfer-config", '{"ec_connector": "X", "ec_role": "boss"}'],
            2,
            "ec_role must be one of",
        ),
        (["--model", "/nonexistent/dir"], 2, "neither a checkpoint directory"),
        (["--max-fanout", "0"], 2, "--max-fanout must be > 0"),
        (["--max-image-pixels", "-1"], 2, "--max-image-pixels must be > 0"),
        (["--header-timeout", "0"], 2, "--header-timeout must be > 0"),
        (["--max-connections", "-1"], 2, "--max-connections must be >= 0"),
        (["--max-processing-queue", "-3"], 2, "--max-processing-queue must be >= 0"),
        (["--image-formats", "PNG,NOPE"], 2, "unknown decoders ['NOPE']"),
    ],
)
def test_bad_flags_exit_cleanly(flags: list[str], code: int, message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--device", "cpu", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == code
    assert message in out.stderr
    assert "Traceback" not in out.stderr
