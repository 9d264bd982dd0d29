"""The engine process dies under a serving server, and the server dies over its engine.

Real ``ec-frontend serve`` processes (the built-in model on the CPU, the default
multiprocess engine), the real ``openai`` client, processes found and checked in
``/proc`` (no psutil).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..helpers.processes import Proc
from .conftest import ServerProcess

pytestmark = pytest.mark.slow

#: The engine-death must-show: the client learns within a second.
ERROR_WITHIN_S = 1.0


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from ``/proc/<pid>/task/*/children``)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def _engine_pid(server: ServerProcess) -> int:
    engines = [c for c in _children(server.proc.pid) if "core_proc" in _cmdline(c)]
    assert len(engines) == 1, f"expected one engine process under the server, got {engines}"
    return engines[0]


def _wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _running(pid):
            return True
        time.sleep(0.05)
    return False


def _server(builtin_model_dir: Path) -> ServerProcess:
    args = ["--model", str(builtin_model_dir), "--device", "cpu", "--max-model-len", "2048"]
    return ServerProcess([*args, "--served-model-name", "m"])


def _chat(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_killed_engine_fails_streams_within_a_second_and_the_server_exits_1(
    builtin_model_dir: Path,
) -> None:
    server = _server(builtin_model_dir)
    try:
        engine = _engine_pid(server)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        blocking: dict[str, Any] = {}

        def non_streamed() -> None:
            try:
                client.chat.completions.create(
                    model="m", messages=_chat("count"), max_tokens=1500,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
            except openai.APIStatusError as exc:
                blocking["status"] = exc.status_code
                blocking["at"] = time.monotonic()

        waiter = threading.Thread(target=non_streamed)
        stream = client.chat.completions.create(
            model="m", messages=_chat("hello"), max_tokens=1500, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        waiter.start()
        chunks = iter(stream)
        assert next(chunks).choices is not None  # the stream is running
        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        with pytest.raises(openai.APIError) as error:
            for _ in chunks:
                pass
        failed_after = time.monotonic() - killed_at
        assert "engine" in str(error.value.message)
        try:
            health = httpx.get(server.url + "/health", timeout=2.0).status_code
        except httpx.TransportError:
            health = None  # already exited
        waiter.join(30)
        assert blocking.get("status", 0) >= 500, blocking
        assert failed_after < ERROR_WITHIN_S, f"the stream failed {failed_after:.2f}s after"
        assert blocking["at"] - killed_at < ERROR_WITHIN_S
        assert health in (503, None)
        assert server.proc.wait(30) == 1
        assert not _running(engine)
    finally:
        server.stop()


def test_killed_server_takes_its_engine_along(builtin_model_dir: Path) -> None:
    server = _server(builtin_model_dir)
    try:
        engine = _engine_pid(server)
        assert _running(engine)
        # Its argv: python -c <code> <ready fd> <socket directory> <clients> <kind>.
        sockets = Path(Path(f"/proc/{engine}/cmdline").read_bytes().split(b"\0")[4].decode())
        assert sockets.name.startswith("ec-engine-") and (sockets / "in").exists()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        assert _wait_gone(engine, 10.0), "the engine process outlived its server"
        assert not sockets.exists(), "the engine left its socket directory behind"
    finally:
        server.stop()


def _engine_interpreters(tag: str) -> set[int]:
    """The engine processes on the host (found by their command line) whose environment
    carries ``EC_TEST_TAG=<tag>``: those of one server, whatever else runs beside it."""
    mark = f"EC_TEST_TAG={tag}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if "core_proc import main" not in _cmdline(pid) or not _running(pid):
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in environ:
            found.add(pid)
    return found


@pytest.mark.parametrize("bad", ["max-model-len", "no-config"])
def test_startup_error_after_the_engine_interpreter_was_spawned(
    builtin_model_dir: Path, tmp_path: Path, bad: str
) -> None:
    """The engine's interpreter starts ahead of the server's own imports; a bad flag
    or checkpoint found afterwards still gives the one-line error and exit 2, and that
    interpreter (never given its spec) is gone."""
    tag = f"engine-death-{bad}-{os.getpid()}"
    args = ["--model", str(builtin_model_dir), "--max-model-len", "99999999"]
    if bad == "no-config":
        args = ["--model", str(tmp_path)]
    proc = Proc("serve", args, "bad", env={"EC_TEST_TAG": tag})
    try:
        assert proc.proc.wait(120) == 2, proc.log()
        # A missing config.json is found by the checks before the model loads
        # (``entrypoints/preflight.py``), the bad length once the config is read.
        said = "cannot read" if bad == "no-config" else "cannot start"
        assert said in proc.log() and "Traceback" not in proc.log(), proc.log()
    finally:
        proc.stop()
    end = time.monotonic() + 10
    while time.monotonic() < end and _engine_interpreters(tag):
        time.sleep(0.05)
    assert not _engine_interpreters(tag), "a spawned engine interpreter outlived its server"
