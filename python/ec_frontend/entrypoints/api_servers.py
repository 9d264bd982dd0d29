"""``serve --api-server-count N``: N API server processes behind one listening port.

The parent process binds the port and supervises; it serves no HTTP itself.

* **Sockets**: the parent binds one listening socket per API server with
  ``SO_REUSEPORT`` on the same address (the port is fixed by the first bind,
  so ``--port 0`` works too) and hands socket *i* to server *i*; the kernel
  spreads new connections over them. Without ``SO_REUSEPORT`` every server
  accepts from one shared socket.
* **Engine**: one engine process (``engine/core_proc.py``) started by the
  parent before the servers, with one client per server; each server connects
  an ``MPEngineClient`` to it (client *i*), keeps its own input processing,
  detokenization and SSE, and reports the engine's statistics as the engine
  sent them (they are not summed). With ``--mock-engine`` the engine process
  runs the mock model. The group needs ``--engine-mode multiprocess``.
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
  supervisor restarts a whole server, never half of one. An engine process
  that dies does the same (exit 1); one that cannot start is a startup error
  (exit 2) before any server starts. Once the servers have exited the parent
  stops the engine; the engine exits by itself if the parent dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from types import FrameType
from typing import Any, NoReturn

from ec_frontend.entrypoints.launcher import (
    EngineFactory,
    ServeOptions,
    StartupError,
    mock_config,
    serve,
)
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
class SharedEngine:
    """The group's engine process, as an API server connects to it."""

    address: str
    config: Any
    kind: str
    model_id: str
    max_model_len: int

    def connect(self, index: int) -> EngineFactory:
        """The engine factory of server ``index``: a client of this engine."""

        def factory(opts: ServeOptions) -> tuple[Any, str, int]:
            from ec_frontend.engine.mp_client import MPEngineClient, _load_processor

            processor = _load_processor(self.config, self.kind)
            client = MPEngineClient(
                self.address, config=self.config, processor=processor, client_index=index
            )
            return client, self.model_id, self.max_model_len

        return factory


def start_engine(opts: ServeOptions, clients: int) -> tuple[Any, SharedEngine]:
    """Start the group's engine process (the mock model with ``--mock-engine``) and
    wait for it: ``(handle, shared)``."""
    from ec_frontend.engine.core_proc import EngineProcess, EngineSpec

    level = log.getEffectiveLevel()
    if opts.mock_engine:
        config: Any = mock_config(opts)
        spec = EngineSpec(config, kind="mock", log_level=level)
        facts = ("mock", config.model, config.max_model_len)
    else:
        from ec_frontend.engine.builder import (
            _builtin_id,
            cpu_threads,
            engine_config,
            load_plugins,
        )

        load_plugins()
        config, path = engine_config(opts)
        threads = cpu_threads(opts, builtin=config.model_id == _builtin_id())
        log.info("loading %s in the engine process for %d API servers", path, clients)
        spec = EngineSpec(config, cpu_threads=threads, log_level=level)
        facts = ("real", config.model_id, config.scheduler.max_model_len)
    handle = EngineProcess.launch(spec, num_clients=clients)
    try:
        handle.wait_ready()
    except BaseException:
        handle.kill()
        raise
    return handle, SharedEngine(handle.address, config, *facts)


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What one API server process is given (pickled into the spawned process)."""

    opts: ServeOptions
    index: int
    metrics_dir: str
    parent_pid: int
    engine: SharedEngine


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
    # One stats line for the group: the engine's counters are the same for all.
    opts = dataclasses.replace(spec.opts, log_stats=spec.opts.log_stats and index == 0)
    code = serve(
        opts,
        engine_factory=spec.engine.connect(index),
        sockets=[sock],
        wrap_app=lambda app: ServerHeader(app, index),
    )
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown, once everything is stopped.

    Tearing down torch and transformers (imported to read the model's config and
    to preprocess) takes seconds per process, which would stretch the drain.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ServerGroup:
    """The parent's view of the API server processes (see the module docstring)."""

    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self.engine: SharedEngine | None = None
        #: A pidfd of the engine process: readable once it has exited.
        self.engine_fd: int | None = None
        self.procs: list[multiprocessing.process.BaseProcess] = []
        #: Stop requests so far (signals, or a member's death): 1 drains, 2 ends at once.
        self.stops = 0
        self.failed: int | None = None

    def start(self, sockets: list[socket.socket], metrics_dir: str) -> None:
        if self.engine is None:
            raise StartupError("the API servers need the engine process first")
        ctx = multiprocessing.get_context("spawn")
        for index, sock in enumerate(sockets):
            spec = ServerSpec(self.opts, index, metrics_dir, os.getpid(), self.engine)
            proc = ctx.Process(
                target=run_api_server,
                args=(spec, sock),
                name=f"ec-frontend-api-server-{index}",
            )
            proc.start()
            self.procs.append(proc)

    def on_signal(self, sig: int, frame: FrameType | None = None) -> None:
        """Signal handler: each signal becomes one SIGTERM to every live server."""
        log.info("received signal %d: %s the API servers", sig, _verb(self.stops + 1))
        self.stop()

    def stop(self) -> None:
        """Send every live server SIGTERM (the first drains it, a second ends it)."""
        self.stops += 1
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
            if self.stops and deadline is None:
                deadline = time.monotonic() + self.opts.drain_timeout_s + KILL_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                log.error("%d API servers still running after the drain: killing them", len(live))
                self._signal_all(signal.SIGKILL)
                deadline = float("inf")
            watched: list[Any] = [p.sentinel for p in live]
            if self.engine_fd is not None:
                watched.append(self.engine_fd)
            ready = wait(watched, timeout=0.5)
            if self.engine_fd is not None and self.engine_fd in ready:
                os.close(self.engine_fd)
                self.engine_fd = None
                if not self.stops:
                    self.failed = 1
                    log.error("the engine process exited: stopping the group")
                    self.stop()
            # Every server, not only those live above: one that exited after its check
            # in the previous pass was left out of ``live`` already.
            for proc in self.procs:
                code = proc.exitcode
                if code is None or self.stops:
                    continue
                self.failed = code if code > 0 else 1
                log.error("API server %s exited with code %s: stopping the group", proc.name, code)
                self.stop()
        if self.failed is not None:
            return self.failed
        # A server signalled before its drain handler was installed ends by SIGTERM.
        clean = (0, -signal.SIGTERM) if self.stops else (0,)
        return 0 if all(p.exitcode in clean for p in self.procs) else 1


def _verb(count: int) -> str:
    return "draining" if count == 1 else "stopping"


def serve_group(opts: ServeOptions) -> NoReturn:
    """Run the group (:func:`run_group`), then exit this process with its code."""
    exit_now(run_group(opts))


def run_group(opts: ServeOptions) -> int:
    """Run ``opts.api_server_count`` API servers on one port until they have drained."""
    count = opts.api_server_count
    if count < 1:
        log.error("cannot start: --api-server-count must be > 0, not %d", count)
        return 2
    if opts.engine_mode != "multiprocess":
        log.error("cannot start: --api-server-count > 1 needs --engine-mode multiprocess")
        return 2
    try:
        sockets = bind_sockets(opts.host, opts.port, count)
    except OSError as exc:
        log.error("cannot bind %s:%d: %s", opts.host, opts.port, exc)
        return 1
    port = sockets[0].getsockname()[1]
    group = ServerGroup(opts)
    handlers = {sig: signal.signal(sig, group.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    engine_handle: Any = None
    metrics_dir = tempfile.mkdtemp(prefix="ec-frontend-metrics-")
    try:
        try:
            engine_handle, group.engine = start_engine(opts, count)
        except (StartupError, ValueError, OSError, RuntimeError, ImportError) as exc:
            log.error("cannot start: %s", exc)
            return 2
        if group.stops:  # stopped while the engine was loading
            return 0
        if hasattr(os, "pidfd_open"):
            group.engine_fd = os.pidfd_open(engine_handle.pid)
        group.start(sockets, metrics_dir)
        for sock in set(sockets):
            sock.close()
        log.info("%d API servers on http://%s:%d", count, opts.host, port)
        return group.wait()
    finally:
        group._signal_all(signal.SIGKILL)
        if engine_handle is not None:
            engine_handle.terminate()
        if group.engine_fd is not None:
            os.close(group.engine_fd)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for sock in sockets:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


__all__ = [
    "SERVER_HEADER",
    "ServerHeader",
    "bind_sockets",
    "run_api_server",
    "run_group",
    "serve_group",
]
