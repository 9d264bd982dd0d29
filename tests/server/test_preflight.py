"""``ec-frontend serve`` finds what would stop it before the model loads: each check
exits 2 with one line within 2 s of starting (no engine process, no weights read).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The 2 s bound is the point of these tests: they run alone (scripts/test.sh, serial phase).
pytestmark = [pytest.mark.slow, pytest.mark.serial]

SIDE_CHANNEL_ON_ALL = json.dumps(
    {
        "ec_connector": "ECSideChannelConnector",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {"host": "0.0.0.0"},
    }
)


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _checkpoint(tmp: Path, weights: bytes | None, config: str = "{}") -> Path:
    tmp.mkdir()
    (tmp / "config.json").write_text(config)
    (tmp / "tokenizer.json").write_text("{}")
    if weights is not None:
        (tmp / "model.safetensors").write_bytes(weights)
    return tmp


#: A safetensors file of no tensors: an 8-byte header length, then the header ``{}``.
EMPTY_SAFETENSORS = (2).to_bytes(8, "little") + b"{}"
Args = Callable[[Path, int], list[str]]
CASES: list[tuple[str, Args, str]] = [
    ("port", lambda t, port: ["--port", str(port)], "cannot bind 127.0.0.1:"),
    (
        "ec connector",
        lambda t, p: ["--ec-transfer-config", '{"ec_connector": "Nope", "ec_role": "ec_both"}'],
        "unknown EC connector 'Nope'",
    ),
    (
        "kv connector",
        lambda t, p: ["--kv-transfer-config", '{"kv_connector": "Nope", "kv_role": "kv_both"}'],
        "unknown KV connector 'Nope'",
    ),
    (
        "transfer config",
        lambda t, p: ["--kv-transfer-config", '{"kv_connector": "NoOpKVConnector"}'],
        "kv_role must be a non-empty string",
    ),
    ("empty secret", lambda t, p: ["--transfer-secret", ""], "--transfer-secret is empty"),
    ("short secret", lambda t, p: ["--transfer-secret", "abc"], "at least 16 bytes"),
    (
        "empty secret file",
        lambda t, p: ["--transfer-secret-file", str(_empty(t))],
        "is empty",
    ),
    (
        "secret where a role needs it",
        lambda t, p: ["--ec-transfer-config", SIDE_CHANNEL_ON_ALL],
        "listens on 0.0.0.0, beyond this host: it needs a transfer secret",
    ),
    ("no config.json", lambda t, p: ["--model", str(t)], "cannot read"),
    (
        "config.json not JSON",
        lambda t, p: ["--model", str(_checkpoint(t / "c", b"", config="{nope"))],
        "config.json cannot be read: not JSON",
    ),
    (
        "no weights",
        lambda t, p: ["--model", str(_checkpoint(t / "c", None))],
        "no *.safetensors weights",
    ),
    (
        "weights unreadable",
        lambda t, p: ["--model", str(_checkpoint(t / "c", b"\xff" * 64))],
        "is not a safetensors file",
    ),
    (
        "no image processor config",
        lambda t, p: ["--model", str(_checkpoint(t / "c", EMPTY_SAFETENSORS))],
        "has no image processor config",
    ),
    ("engine size", lambda t, p: ["--block-size", "7"], "--block-size must be one of 8, 16"),
    (
        "triton on the cpu",
        lambda t, p: ["--attention-backend", "triton"],
        "--attention-backend triton needs Triton and a CUDA device",
    ),
]


def _empty(tmp: Path) -> Path:
    path = tmp / "secret"
    path.write_text("\n")
    return path


@pytest.mark.parametrize(
    ("make_args", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_exits_2_before_the_model_loads(
    make_args: Args, message: str, tmp_path: Path, busy_port: int
) -> None:
    args = make_args(tmp_path, busy_port)
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(args),
    )
    elapsed = time.monotonic() - start
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert lines[0].startswith("ec-frontend serve: ")
    assert out.stdout == ""
    assert elapsed < 2.0, f"{elapsed:.2f} s"


def _env(args: list[str]) -> dict[str, str]:
    """This environment without a transfer secret and without Triton's interpreter."""
    unset = ("EC_FRONTEND_TRANSFER_SECRET", "TRITON_INTERPRET")
    return {k: v for k, v in os.environ.items() if k not in unset}
