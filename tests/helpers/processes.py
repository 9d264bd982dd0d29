"""Real ``ec-frontend`` processes on loopback, shared by the server and disagg tests.

A :class:`Proc` runs one CLI subcommand (``serve`` or ``proxy``) on a free
127.0.0.1 port with its output in a temporary file. Starting and waiting are
separate, so several processes can load in parallel; :meth:`Proc.wait_ready`
polls ``/health`` until it answers 200 and raises (with the process's output)
if the process exits or does not become healthy in time.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import httpx
from ec_frontend.metrics import PREFIX, parse_text

STARTUP_TIMEOUT_S = 180.0
#: The helpers' client for requests to local processes. ``httpx.get`` builds a client,
#: and with it a TLS context, on every call: about 24 ms of CPU here, against 0.2 ms on a
#: client made once, and a start-up polls ``/health`` every 0.1 s. No keep-alive, so no
#: connection outlives the process it went to.
LOCAL = httpx.Client(timeout=10.0, limits=httpx.Limits(max_keepalive_connections=0))
LOG_TAIL_CHARS = 4000


#: Ports :func:`free_port` handed out in this process (each is handed out once).
_HANDED_OUT: set[int] = set()
_PICK = random.Random()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 by default on Linux)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_range() -> tuple[int, int]:
    """This test process's share of the ports below the kernel's ephemeral range.

    Under pytest-xdist each worker draws from its own slice (``gw0`` the first, and so
    on), so two workers never hand out the same port in the seconds before a server
    binds it; a run without workers draws from the whole range."""
    low, high = 10000, _ephemeral_low()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return low, high
    index = int(worker[2:])
    width = (high - low) // count
    return low + index * width, low + (index + 1) * width


def free_port() -> int:
    """A 127.0.0.1 port that is free now, for a server that binds it seconds later.

    It is drawn below the kernel's ephemeral range, so no port-0 listener (a side
    channel) or outgoing connection is given it meanwhile, from this worker's own slice
    of that range (:func:`_worker_range`), and it is never one this process handed out
    before: a second server given the same port would fail to bind while the first one
    answered its health checks."""
    low, high = _worker_range()
    for _ in range(200):
        port = _PICK.randrange(low, high) if high > low + 100 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free loopback port")


class Proc:
    """One ``ec-frontend`` process; :meth:`stop` sends SIGTERM and returns its exit code.

    ``program`` replaces the ``python -m ec_frontend.entrypoints.cli`` prefix (an
    installed console script, say); ``env`` is added to this process's environment.
    """

    def __init__(
        self,
        command: str,
        args: Sequence[str],
        name: str,
        *,
        env: dict[str, str] | None = None,
        program: Sequence[str] | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*(program or (sys.executable, "-m", "ec_frontend.entrypoints.cli")), command]
        cmd += ["--port", str(self.port), "--log-level", "warning", *args]
        self.logfile = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        # A process a test only killed (or that failed to start) still has its log
        # closed, once this object goes: no ResourceWarning lands in a later test.
        weakref.finalize(self, self.logfile.close)
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(
            cmd, stdout=self.logfile, stderr=subprocess.STDOUT, env=full_env
        )

    def wait_ready(self) -> Proc:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if LOCAL.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"{self.name} did not become healthy in time:\n{self.log()}")

    def output(self) -> str:
        """Everything the process printed so far."""
        self.logfile.seek(0)
        return self.logfile.read().decode(errors="replace")

    def log(self) -> str:
        """The tail of :meth:`output`, for error messages."""
        return self.output()[-LOG_TAIL_CHARS:]

    def metrics(self) -> dict[str, float]:
        return parse_text(LOCAL.get(self.url + "/metrics", timeout=10.0).text)

    def metric(self, name: str) -> float:
        """One unlabelled ``ec_frontend_<name>`` value (0 when absent)."""
        return self.metrics().get(PREFIX + name, 0.0)

    def settled_metric(self, name: str, expected: float, timeout_s: float = 5.0) -> float:
        """:meth:`metric` once it equals ``expected`` or ``timeout_s`` has passed.

        For gauges that an instance updates just after it has answered (an item is
        freed once its bytes have been sent, which the client may see first).
        """
        deadline = time.monotonic() + timeout_s
        value = self.metric(name)
        while value != expected and time.monotonic() < deadline:
            time.sleep(0.02)
            value = self.metric(name)
        return value

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 30.0, *, signalled: bool = False) -> int:
        """SIGTERM (unless ``signalled``: sent already), wait, and return the exit code
        (killing it if it hangs)."""
        if self.proc.poll() is None:
            if not signalled:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.logfile.close()
        return int(self.proc.returncode)


def stop_all(procs: Sequence[Proc], timeout: float = 30.0) -> None:
    """:meth:`Proc.stop` for processes that need no order: all are signalled first, so
    they shut down together instead of one after another."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop(timeout, signalled=True)


def start_all(procs: Sequence[Proc]) -> list[Proc]:
    """Wait for processes started together (they load in parallel); kill all if one fails."""
    try:
        for p in procs:
            p.wait_ready()
    except Exception:
        for p in procs:
            p.kill()
        raise
    return list(procs)
