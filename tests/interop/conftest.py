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
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from ..helpers.processes import LOCAL, Proc, free_port

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


class VllmScript:
    """A script of vLLM's source distribution serving HTTP on a free loopback port, run
    as is by the vLLM environment's Python (``{port}`` in ``args`` is that port)."""

    def __init__(
        self,
        python: Path,
        script: Path,
        args: Sequence[str],
        health: str,
        env: dict[str, str] | None = None,
    ) -> None:
        path = vllm_venv() / script
        assert path.is_file(), f"{path} is missing: run `bash scripts/setup_vllm.sh`"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health = health
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)
        self.logfile = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        argv = [a.format(port=self.port) for a in args]
        self.proc = subprocess.Popen(
            [str(python), str(path), *argv], stdout=self.logfile, stderr=subprocess.STDOUT, env=env
        )

    def log(self) -> str:
        self.logfile.seek(0)
        return self.logfile.read().decode(errors="replace")[-6000:]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.proc.args} exited:\n{self.log()}"
            try:
                if LOCAL.get(self.url + self.health, timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.proc.args} not healthy in {timeout_s} s:\n{self.log()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.logfile.close()


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
