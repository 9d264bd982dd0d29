"""``serve --api-server-count N``: N API server processes behind one listening port.

The parent process binds the port and supervises; it serves no HTTP itself.

* **Sockets**: the parent binds one listening socket per API server with
  ``SO_REUSEPORT`` on the same address (the port is fixed by the first bind,
  so ``--port 0`` works too) and hands socket *i* to server *i*; the kernel
  spreads new connections over them. Without ``SO_REUSEPORT`` every server
  accepts from one shared socket.
* **Servers**: spawned processes (``multiprocessing`` spawn start method),
  each running the ordinary server (``launcher.serve``) on its inherited
  socket, each response naming its server index in ``x-ec-frontend-server``.
  A server dies with the parent (``PR_SET_PDEATHSIG``) and runs in its own
  process group, so a terminal's Ctrl-C reaches the parent only and the
  servers get one forwarded signal each.
* **Metrics**: each server writes its counters, histograms and in-flight
  gauge to its own file in a directory the parent creates
  (``metrics.share_values``); ``/metrics`` on any server sums the files.
* **Signals**: SIGTERM or SIGINT to the parent is forwarded as SIGTERM to every
  server, which drains as a single server does (new requests 503, in-flight
  ones finish, ``--drain-timeout`` bounds it); a second signal is forwarded
  too and ends them at once. The parent exits 0 when every server exited 0.
* **Failure**: a server that exits while the group is not draining brings the
  group down: the others are told to drain and the parent exits non-zero with
  the failed server's code (2 for a startup error, 1 otherwise), so a
  supervisor restarts a whole server, never half of one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from types import FrameType
from typing import Any

from ec_frontend.entrypoints.launcher import ServeOptions, build_engine, serve
from ec_frontend.metrics import share_values

log = logging.getLogger("ec_frontend.api_servers")

#: Response header naming the API server (its index in the group) that answered.
SERVER_HEADER = b"x-ec-frontend-server"
#: Seconds the parent waits past ``--drain-timeout`` before it kills a server.
KILL_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """Listening sockets for ``count`` servers on one address (see the module docstring)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    reuse_port = hasattr(socket, "SO_REUSEPORT")
    sockets: list[socket.socket] = []
    try:
        for _ in range(count if reuse_port else 1):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(addr)
            # The first bind fixes the port (``--port 0``: an ephemeral one).
            addr = sock.getsockname()
            sock.listen(2048)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets if reuse_port else sockets * count


class ServerHeader:
    """ASGI wrapper adding ``x-ec-frontend-server: <index>`` to every response."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self.value = str(index).encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (SERVER_HEADER, self.value)]
            await send(message)

        await self.app(scope, receive, send_with_header)


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What one API server process is given (pickled into the spawned process)."""

    opts: ServeOptions
    index: int
    metrics_dir: str
    parent_pid: int


def _die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def run_api_server(spec: ServerSpec, sock: socket.socket) -> None:
    """Entry point of one API server process (the spawn target)."""
    if sys.platform.startswith("linux"):
        _die_with_parent(spec.parent_pid)
    os.setpgrp()
    logging.basicConfig(
        level=spec.opts.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[{spec.index}]: %(message)s",
    )
    share_values(spec.metrics_dir, f"api-server-{spec.index}")
    index = spec.index
    code = serve(
        spec.opts,
        engine_factory=build_engine,
        sockets=[sock],
        wrap_app=lambda app: ServerHeader(app, index),
    )
    sys.exit(code)


class ServerGroup:
    """The parent's view of the API server processes (see the module docstring)."""

    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.signals = 0
        self.failed: int | None = None

    def start(self, sockets: list[socket.socket], metrics_dir: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        for index, sock in enumerate(sockets):
            spec = ServerSpec(self.opts, index, metrics_dir, os.getpid())
            proc = ctx.Process(
                target=run_api_server,
                args=(spec, sock),
                name=f"ec-frontend-api-server-{index}",
            )
            proc.start()
            self.procs.append(proc)

    def forward(self, sig: int, frame: FrameType | None = None) -> None:
        """Signal handler: each signal becomes one SIGTERM to every live server."""
        self.signals += 1
        log.info("received signal %d: %s the API servers", sig, _verb(self.signals))
        self._signal_all(signal.SIGTERM)

    def _signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def wait(self) -> int:
        """Supervise until every server has exited; the group's exit code."""
        deadline: float | None = None
        while True:
            live = [p for p in self.procs if p.exitcode is None]
            if not live:
                break
            if self.signals and deadline is None:
                deadline = time.monotonic() + self.opts.drain_timeout_s + KILL_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                log.error("%d API servers still running after the drain: killing them", len(live))
                self._signal_all(signal.SIGKILL)
                deadline = float("inf")
            wait([p.sentinel for p in live], timeout=0.5)
            for proc in live:
                code = proc.exitcode
                if code is None or self.signals or self.failed is not None:
                    continue
                self.failed = code if code > 0 else 1
                log.error("API server %s exited with code %s: stopping the group", proc.name, code)
                self.forward(signal.SIGTERM)
        if self.failed is not None:
            return self.failed
        # A server signalled before its drain handler was installed ends by SIGTERM.
        clean = (0, -signal.SIGTERM) if self.signals else (0,)
        return 0 if all(p.exitcode in clean for p in self.procs) else 1


def _verb(count: int) -> str:
    return "draining" if count == 1 else "stopping"


def serve_group(opts: ServeOptions) -> int:
    """Run ``opts.api_server_count`` API servers on one port until they have drained."""
    count = opts.api_server_count
    if count < 1:
        log.error("cannot start: --api-server-count must be > 0, not %d", count)
        return 2
    try:
        sockets = bind_sockets(opts.host, opts.port, count)
    except OSError as exc:
        log.error("cannot bind %s:%d: %s", opts.host, opts.port, exc)
        return 1
    port = sockets[0].getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="ec-frontend-metrics-")
    group = ServerGroup(opts)
    handlers: dict[int, Callable[..., Any] | int | None] = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, group.forward)
        group.start(sockets, metrics_dir)
        for sock in set(sockets):
            sock.close()
        log.info("%d API servers on http://%s:%d", count, opts.host, port)
        return group.wait()
    finally:
        group._signal_all(signal.SIGKILL)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for sock in sockets:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


__all__ = ["SERVER_HEADER", "ServerHeader", "bind_sockets", "run_api_server", "serve_group"]
