"""The README's serving examples work as written.

The README's own command (the ``ec-frontend`` console script, no flags but the
port) serves the built-in model; each curl example of the "Serving" section and
its openai example then run against it, with only the port rewritten.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import ServerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def serving_blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Serving", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


CURLS = [cmd.strip() for cmd in serving_blocks("bash")[1].split("\n\n") if cmd.strip()]
EXPECTED = {
    "/v1/models": '"ec-frontend/qwen2-vl-tiny"',
    "/v1/chat/completions": '"object":"chat.completion"',
    "/v1/completions": "data: [DONE]",
    "/inference/v1/generate": '"kv_transfer_params"',
    "/metrics": 'ec_frontend_requests_total{endpoint="/v1/models",status="200"}',
}


@pytest.fixture(scope="module")
def readme_server() -> Iterator[ServerProcess]:
    script = Path(sys.executable).parent / "ec-frontend"
    server = ServerProcess([], program=[str(script)])
    yield server
    assert server.stop() == 0


def test_readme_has_the_examples() -> None:
    assert [next(p for p in EXPECTED if p in c) for c in CURLS] == list(EXPECTED)
    assert "OpenAI(" in serving_blocks("python")[0]


@pytest.mark.parametrize("index", range(len(EXPECTED)))
def test_curl_example(readme_server: ServerProcess, index: int) -> None:
    assert shutil.which("curl") is not None, "the README's examples need curl"
    cmd = CURLS[index].replace("127.0.0.1:8000", f"127.0.0.1:{readme_server.port}")
    out = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    path = next(p for p in EXPECTED if p in cmd)
    assert EXPECTED[path] in out.stdout, out.stdout
    assert '"error"' not in out.stdout


def test_openai_example(readme_server: ServerProcess) -> None:
    code = serving_blocks("python")[0].replace("127.0.0.1:8000", f"127.0.0.1:{readme_server.port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") >= 4
