"""Interop tests: ec-frontend driven by vLLM's own code.

vLLM (pinned, see ``scripts/setup_vllm.sh``) lives in a separate virtual
environment, ``.venv-vllm`` (or ``$EC_FRONTEND_VLLM_VENV``); its code runs in
subprocesses of that environment's Python against real ``ec-frontend serve``
processes on loopback. Without that environment these tests fail (they never
skip): run ``bash scripts/setup_vllm.sh`` first.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ..helpers.processes import Proc

REPO = Path(__file__).resolve().parents[2]
VLLM_REQUIREMENT = "vllm==0.33.0"
MODEL_NAME = "tiny"


def vllm_venv() -> Path:
    return Path(os.environ.get("EC_FRONTEND_VLLM_VENV") or REPO / ".venv-vllm")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The Python of the vLLM environment; fails the test when it is not installed."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    stamp = venv / ".ec-frontend-requirement"
    installed = stamp.read_text().strip() if stamp.is_file() else None
    if not python.is_file() or installed != VLLM_REQUIREMENT:
        pytest.fail(
            f"the vLLM environment {venv} is missing or incomplete "
            f"(wanted {VLLM_REQUIREMENT}, found {installed}): run `bash scripts/setup_vllm.sh`",
            pytrace=False,
        )
    return python


def run_vllm(
    python: Path, args: Sequence[str], *, timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python args...`` in the vLLM environment, offline, output captured."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [str(python), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
        check=False,
    )


@pytest.fixture(scope="module")
def model_server(builtin_model_dir: Path) -> Iterator[Proc]:
    """``ec-frontend serve`` on the built-in model (CPU)."""
    server = Proc(
        "serve",
        ["--model", str(builtin_model_dir), "--device", "cpu", "--max-model-len", "1024",
         "--served-model-name", MODEL_NAME],
        "model server",
    )  # fmt: skip
    server.wait_ready()
    yield server
    assert server.stop() == 0
