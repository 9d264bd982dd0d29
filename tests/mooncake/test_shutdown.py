"""A server whose Mooncake master has gone still exits promptly, with its own status.

Mooncake's store library unmounts every client from its master in a C exit
handler; with the master killed that takes seconds, and with a master that keeps
its sockets open and never answers (SIGSTOP here) it never ends. The connector
closes its client only when the master answers a probe, and otherwise leaves the
process without that teardown.

The server runs its engine in-process here, so the server process itself holds
the client (the engine process of the default mode leaves the same way, and the
server would SIGKILL one that hung).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ..disagg.conftest import MODEL_NAME, messages, png_data_url, serve
from ..helpers.processes import start_all
from .conftest import Master, store_ec

pytestmark = pytest.mark.slow


def test_servers_exit_promptly_when_their_master_is_gone(builtin_model_dir: Path) -> None:
    masters = {"killed": Master(), "hung": Master()}
    servers = {
        name: serve(
            builtin_model_dir,
            f"e-{name}",
            ec=store_ec("ec_producer", m),
            extra=["--engine-mode", "inprocess"],
        )
        for name, m in masters.items()
    }
    try:
        start_all(list(servers.values()))
        body = {"model": MODEL_NAME, "max_tokens": 1,
                "messages": messages("Encode this.", png_data_url(28, (1, 2, 3)))}  # fmt: skip
        for s in servers.values():  # the encoder puts the item: its client is in use
            r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["ec_transfer_params"]
        masters["killed"].kill()
        masters["hung"].pause()
        for s in servers.values():
            s.proc.terminate()
        start = time.monotonic()
        codes = {}
        for name, s in servers.items():
            codes[name] = s.proc.wait(timeout=60)
        elapsed = time.monotonic() - start
        assert codes == {"killed": 0, "hung": 0}, {n: s.log() for n, s in servers.items()}
        # Drain and engine shutdown (about 4 s here), a probe of at most 2 s; before,
        # the hung master's server never exited.
        assert elapsed < 20, elapsed
        for s in servers.values():
            assert "leaves without unmounting" in s.output(), s.log()
    finally:
        for s in servers.values():
            s.kill()
            s.stop()
        for m in masters.values():
            m.kill()


SCRIPT = """
import sys
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.mooncake_store import MooncakeStoreECConnector
from ec_frontend.config import ECTransferConfig
import torch
config = ECTransferConfig.from_json({
    "ec_connector": "MooncakeStoreECConnector", "ec_role": "ec_producer",
    "ec_connector_extra_config": {"master_server_address": sys.argv[1],
        "metadata_server": sys.argv[2], "global_segment_size": "16MB",
        "local_buffer_size": "16MB", "timeout_s": 2.0}})
conn = MooncakeStoreECConnector(config, ECConnectorRole.WORKER)
conn.save_caches({"ab" * 16: torch.ones(3, 8)}, "ab" * 16)
assert conn.stats.items_saved == 1
print("ready", flush=True)
sys.stdin.readline()
sys.exit(3)
"""


def _start_client(script: str, master: Master) -> subprocess.Popen[bytes]:
    """A process running ``script`` against ``master``, once its client has put an item."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, master.address, master.metadata_server],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(b"ready"):
            return proc
    pytest.fail(f"the client did not start: rc {proc.wait()}")


def _stop(proc: subprocess.Popen[bytes], master: Master) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    master.kill()


@pytest.mark.parametrize("fault", ["killed", "hung", "alive"])
def test_a_process_with_a_store_client_exits_with_its_own_status(fault: str) -> None:
    master = Master()
    proc = _start_client(SCRIPT, master)
    try:
        assert proc.stdin is not None
        if fault == "killed":
            master.kill()
        elif fault == "hung":
            master.pause()
        start = time.monotonic()
        proc.stdin.close()
        assert proc.wait(timeout=30) == 3
        # A live master: the native close (about 2 s); otherwise a probe of at most 2 s.
        assert time.monotonic() - start < 10
    finally:
        _stop(proc, master)


def test_a_master_that_stops_after_the_close_probe_cannot_hang_the_exit() -> None:
    """The master answers the close's probe and then stops (here: the probe is made to
    pass against a stopped master). Mooncake's native close then waits on it holding
    the GIL; the exit watchdog ends the process after 2 + 3 x 2 s (probe, three call
    timeouts) with status 1 and every thread's traceback. Before it, the process
    stayed until the master came back."""
    after_probe = (
        "import ec_frontend.connectors.mooncake_store as store\n"
        "store.unreachable = lambda *args: None\n"
    )
    master = Master()
    proc = _start_client(SCRIPT.replace("sys.exit(3)", after_probe + "sys.exit(3)"), master)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        master.pause()
        start = time.monotonic()
        proc.stdin.close()
        code = proc.wait(timeout=40)
        elapsed = time.monotonic() - start
        out = proc.stdout.read().decode(errors="replace")
        assert code == 1, out[-3000:]
        assert 8 <= elapsed < 25, elapsed
        assert "Timeout (0:00:08)!" in out and "_close_open_stores" in out, out[-3000:]
    finally:
        _stop(proc, master)
