"""A real ``mooncake_master`` (with its HTTP metadata server) on loopback, and configs.

:class:`Master` starts the binary that ``scripts/setup_mooncake.sh`` installs into
the venv on free ports and waits until both ports accept connections. It is always
killed: by the fixture's teardown, by :meth:`Master.kill` in a fault test, and at
interpreter exit for anything left.
"""

from __future__ import annotations

import atexit
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ..helpers.processes import free_port

MASTER_BIN = Path(sys.executable).parent / "mooncake_master"
_LIVE: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            # "tid (comm) state ...": the state follows the last ")".
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return bool(states) and all(state in ("T", "t") for state in states)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Master:
    """One ``mooncake_master --enable_http_metadata_server`` on 127.0.0.1."""

    def __init__(self, *, lease_ms: int = 200) -> None:
        if not MASTER_BIN.exists():
            raise RuntimeError(f"{MASTER_BIN} is missing: run scripts/setup_mooncake.sh")
        self.rpc_port, self.http_port = free_port(), free_port()
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by kill())
        cmd = [
            str(MASTER_BIN),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={free_port()}",
            f"--default_kv_lease_ttl={lease_ms}",
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        _LIVE.add(self.proc)
        deadline = time.monotonic() + 30
        while not (_port_open(self.rpc_port) and _port_open(self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("mooncake_master did not start")
            time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def store_extra(self, **extra: Any) -> dict[str, Any]:
        return {
            "master_server_address": self.address,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
            "global_segment_size": "64MB",
            "local_buffer_size": "16MB",
            "store_read_buffer_bytes": "16MB",
            **extra,
        }

    def pause(self) -> None:
        """The master stops answering (its sockets stay open). ``kill`` returns before
        every thread has stopped (a thread on another core can still answer a request
        or two; seen here about once in ten), so this waits until all have."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not _all_threads_stopped(self.proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError("mooncake_master did not stop")
            time.sleep(0.002)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        _LIVE.discard(self.proc)
        if not self.log.closed:
            self.log.close()


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master()
    try:
        yield m
    finally:
        m.kill()


@pytest.fixture(scope="module")
def module_master() -> Iterator[Master]:
    m = Master()
    try:
        yield m
    finally:
        m.kill()


def store_ec(role: str, master: Master, **extra: Any) -> dict[str, Any]:
    return {"ec_connector": "MooncakeStoreECConnector", "ec_role": role,
            "ec_connector_extra_config": master.store_extra(**extra)}  # fmt: skip


def mooncake_kv(role: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "MooncakeConnector", "kv_role": role,
            "kv_connector_extra_config": {"protocol": "tcp", **extra}}  # fmt: skip


def raw_client(master: Master) -> Any:
    """A plain Mooncake Store client of ``master`` (the test's own, to look into the store)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    ret = store.setup(
        "127.0.0.1", master.metadata_server, 16 << 20, 16 << 20, "tcp", "", master.address
    )
    assert ret == 0
    return store


def until(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether ``check()`` came true within ``timeout_s`` (polled)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
