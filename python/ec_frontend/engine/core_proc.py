"""The engine core in its own process: the process handle and the engine side.

The process is a fresh interpreter (spawned, never forked: CUDA-safe) that imports
only what the engine needs, builds an :class:`~ec_frontend.engine.core.EngineCore`
and runs a busy step loop (no asyncio) between two channels:

* **input** (``<dir>/in``, a ZMQ ROUTER): each client's DEALER sends requests,
  aborts and stop notices; the ROUTER tells clients apart by their identity.
* **output** (``<dir>/out.sock``, a Unix stream socket): each client connects,
  says ``hello`` with its identity once and is answered with the engine's facts
  (``welcome``); after every step that computed anything, each client gets one
  message with its own outputs (possibly none), the step's stats snapshot and the
  request ids that connectors keep holding after they finished.

The messages are :mod:`ec_frontend.engine.wire`'s. Request ids are a client's own:
with more than one client the engine keys its requests by ``(client, id)``.

The engine process exits when its parent dies (the parent pid is polled between
steps and while idle), so a killed server leaves no orphan behind.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import importlib
import io
import logging
import operator
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from ec_frontend.engine.groups import RequestGroups
from ec_frontend.engine.summary import engine_summary
from ec_frontend.engine.wire import (
    ABORT,
    ABORT_GROUPS,
    ADD,
    HELLO,
    OUTPUT_SOCKET,
    PROTOCOL_VERSION,
    SHUTDOWN,
    STOP,
    WELCOME,
    Codec,
    EngineOutput,
    EngineOutputs,
    FrameReader,
    _torch,
    pack_output,
    stream_frame,
    unpack_fields,
)
from ec_frontend.errors import StartupError

if TYPE_CHECKING:
    from llguidance import LLTokenizer

    from ec_frontend.config import EngineConfig
    from ec_frontend.engine.core import EngineCore
    from ec_frontend.engine.mock import MockEngineConfig
    from ec_frontend.engine.outputs import RequestOutput
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.engine.stats import EngineStats
    from ec_frontend.engine.structured_output import CompiledGrammar
    from ec_frontend.model.processor import InputProcessor

logger = logging.getLogger(__name__)

#: Longest idle wait between parent checks and input polls (milliseconds).
_IDLE_POLL_MS = 100
#: Pause between steps that only poll connectors (delayed frees, remote KV).
_TRANSFER_POLL_MS = 2
#: How long a client waits for the engine's welcome.
WELCOME_TIMEOUT_S = 30.0
#: Environment variable naming the module whose ``build_core(spec)`` builds the core.
_STARTUP_EXIT = 2

# ---- the process handle --------------------------------------------------------


@dataclass(slots=True)
class EngineSpec:
    """What the engine process needs to build its core (pickled to the child)."""

    config: EngineConfig | MockEngineConfig
    #: Torch threads on the CPU (``None``: torch's default).
    cpu_threads: int | None = None
    #: ``"real"``: the checkpoint ``config.model``; ``"mock"``: the mock model.
    kind: str = "real"
    log_level: int = logging.WARNING
    sys_path: list[str] = field(default_factory=lambda: list(sys.path))


class EngineProcess:
    """The handle of one engine process: start it, learn its address, stop it."""

    def __init__(self, proc: subprocess.Popen[bytes], directory: str, ready_fd: int) -> None:
        self.proc = proc
        self.directory = directory
        self._ready_fd = ready_fd
        self.info: dict[str, Any] = {}
        #: Whether the process was given its spec (:meth:`send`).
        self.was_sent = False

    @property
    def address(self) -> str:
        """The ``ipc://`` prefix of the engine's channels (``<address>/in``, ZMQ, and
        ``<address>/out.sock``, a Unix stream socket)."""
        return f"ipc://{self.directory}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def spawn(cls, kind: str = "real", num_clients: int = 1) -> EngineProcess:
        """Start the interpreter before its spec is known: it imports what building a
        ``kind`` core needs (torch, transformers, the model code) while the caller does
        its own startup, then waits for :meth:`send`. A process that is never sent a
        spec exits quietly when its stdin closes (:meth:`kill`, or the caller's exit)."""
        directory = tempfile.mkdtemp(prefix="ec-engine-")
        read_fd, write_fd = os.pipe()
        code = "from ec_frontend.engine.core_proc import main; main()"
        args = [sys.executable, "-c", code, str(write_fd), directory, str(num_clients), kind]
        try:
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            os.close(write_fd)
        return cls(proc, directory, read_fd)

    def send(self, spec: EngineSpec) -> EngineProcess:
        """Give a :meth:`spawn`-ed process its spec; :meth:`wait_ready` waits for its
        model to load. On failure the process is killed."""
        try:
            blob = _dumps(spec)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            self.kill()
            raise StartupError(f"the engine config cannot be sent to its process: {exc}") from None
        self.was_sent = True
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(blob)
            self.proc.stdin.close()
        except OSError as exc:
            self.kill()
            raise StartupError(f"the engine process could not be given its config: {exc}") from None
        return self

    @classmethod
    def launch(cls, spec: EngineSpec, num_clients: int = 1) -> EngineProcess:
        """Start the process for ``spec``; :meth:`wait_ready` waits for its model to load."""
        return cls.spawn(spec.kind, num_clients).send(spec)

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """The engine's facts once its core is built; :class:`StartupError` with the
        child's one-line message if it failed (the child then exits with code 2)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: list[bytes] = []
        with os.fdopen(self._ready_fd, "rb", closefd=True) as pipe:
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    self.kill()
                    raise StartupError("the engine process did not start in time")
                chunk = pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        blob = b"".join(chunks)
        if not blob:
            code = self.proc.wait()
            self._cleanup()
            raise StartupError(f"the engine process exited with code {code} while starting")
        status, payload = msgspec.msgpack.decode(blob)
        if status != "ready":
            self.proc.wait()
            self._cleanup()
            raise StartupError(str(payload))
        info: dict[str, Any] = payload
        self.info = info
        return info

    @classmethod
    def start(
        cls, spec: EngineSpec, num_clients: int = 1, timeout: float | None = None
    ) -> EngineProcess:
        handle = cls.launch(spec, num_clients)
        handle.wait_ready(timeout)
        return handle

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout: float = 5.0, grace: float = 0.0) -> int | None:
        """Wait ``grace`` seconds for the process to exit on its own (it was asked to),
        then SIGTERM, then SIGKILL after ``timeout``; the exit code."""
        if grace > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._cleanup()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5.0)
        self._cleanup()

    def _cleanup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _dumps(obj: object) -> bytes:
    """Pickle with read-only mappings (frozen configs hold them) as plain dicts inside."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    table = copyreg.dispatch_table.copy()
    table[types.MappingProxyType] = _reduce_mappingproxy
    pickler.dispatch_table = table
    pickler.dump(obj)
    return buf.getvalue()


def _reduce_mappingproxy(m: types.MappingProxyType[Any, Any]) -> tuple[Any, ...]:
    return _mappingproxy, (dict(m),)


def _mappingproxy(d: dict[Any, Any]) -> types.MappingProxyType[Any, Any]:
    """Rebuilds a read-only mapping (the class itself cannot be pickled by name)."""
    return types.MappingProxyType(d)


# ---- the engine process ---------------------------------------------------------


def _import_ahead(kind: str) -> None:
    """Import the modules that building a ``kind`` core needs, before its spec arrives.
    A failure here is left for the build to report with its own message."""
    names = ["ec_frontend.engine.mock"]
    if kind == "real":
        names = ["ec_frontend.engine.builder", "ec_frontend.model.loader"]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            return


def main() -> None:
    """Entry of the engine process: ``<ready fd> <socket dir> <clients> [<kind>]``,
    spec on stdin (an empty stdin: nobody needs this process; it exits 0)."""
    ready_fd, directory, num_clients = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    parent = os.getppid()
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains first, then stops us
    spec: EngineSpec | None = None
    try:
        if len(sys.argv) > 4:
            _import_ahead(sys.argv[4])
        blob = sys.stdin.buffer.read()
        if not blob:
            shutil.rmtree(directory, ignore_errors=True)
            os._exit(0)
        spec = pickle.loads(blob)
        assert spec is not None
        for entry in spec.sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        from ec_frontend.logs import configure

        configure(spec.log_level)
        served = _Served.build(spec)
        server = EngineServer(served, directory, num_clients, parent)
    except BaseException as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        _report(ready_fd, ("error", message))
        os._exit(_STARTUP_EXIT)
    _report(ready_fd, ("ready", server.info))
    try:
        server.run()
    except SystemExit:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.close()
        # The socket directory, here too: a server killed outright never removes it.
        shutil.rmtree(directory, ignore_errors=True)
        logging.shutdown()
    # Nothing else is left to clean up that the kernel does not: skip the interpreter's
    # teardown (seconds of a loaded host, counted in the server's drain).
    os._exit(0)


def _raise_exit(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(0)


def _report(fd: int, message: object) -> None:
    with os.fdopen(fd, "wb", closefd=True) as pipe:
        pipe.write(msgspec.msgpack.encode(message))


@dataclass(slots=True)
class _Served:
    """A built core and what the process needs beside it."""

    core: EngineCore
    spec: EngineSpec
    processor_loader: Callable[[], InputProcessor] | None = None
    _grammar_tokenizer: LLTokenizer | None = None
    _grammars: dict[tuple[str, str], CompiledGrammar] = field(default_factory=dict)
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(cls, spec: EngineSpec) -> _Served:
        if spec.kind == "mock":
            from ec_frontend.engine.mock import MockEngineConfig, build_mock_core

            if not isinstance(spec.config, MockEngineConfig):
                raise TypeError(f"a mock engine takes a MockEngineConfig, not {spec.config!r}")
            return cls(build_mock_core(spec.config), spec)
        from ec_frontend.config import EngineConfig
        from ec_frontend.engine.builder import build_core, load_plugins

        config = spec.config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"a model engine takes an EngineConfig, not {config!r}")
        load_plugins()
        torch = _torch()
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu" and spec.cpu_threads is not None:
            torch.set_num_threads(spec.cpu_threads)
        core, loader = build_core(config)
        served = cls(core, spec, loader)
        if not core.encoder_only:
            # The library's view of the vocabulary is built by Python code that holds
            # the GIL (seconds for a large vocabulary): here, before the engine is
            # ready, rather than beside the steps of running requests.
            served.grammar_tokenizer()
        return served

    def grammar(self, kind: str, text: str) -> CompiledGrammar:
        """The engine's compiled grammar for a frontend-validated one (cached). Nothing
        is built here, on the step loop: the grammar's matcher, and the tokenizer the
        first time, are built on a compile thread while the request waits aside."""
        key = (kind, text)
        hit = self._grammars.get(key)
        if hit is not None:
            return hit
        from ec_frontend.engine.structured_output import CompiledGrammar

        compiled = CompiledGrammar(kind, text, self.grammar_tokenizer)
        if len(self._grammars) >= 256:
            self._grammars.pop(next(iter(self._grammars)))
        self._grammars[key] = compiled
        return compiled

    def grammar_tokenizer(self) -> LLTokenizer:
        """The tokenizer grammars run over, loaded once (on a compile thread)."""
        with self._tokenizer_lock:
            if self._grammar_tokenizer is None:
                from ec_frontend.engine.structured_output import GrammarCompiler

                if self.processor_loader is None:
                    raise ValueError("this engine has no tokenizer to constrain the output")
                processor = self.processor_loader()
                eos = self.core.eos_token_id
                eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
                self._grammar_tokenizer = GrammarCompiler(
                    processor.tokenizer, processor.vocab_size, eos_ids
                ).tokenizer
            return self._grammar_tokenizer


class EngineServer:
    """The step loop between the sockets (runs in the engine process's main thread)."""

    def __init__(self, served: _Served, directory: str, num_clients: int, parent: int) -> None:
        self.served = served
        self.core = served.core
        self.parent = parent
        self.num_clients = num_clients
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.ROUTER)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.setsockopt(zmq.RCVHWM, 0)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.bind(f"ipc://{directory}/in")
        self.output = OutputChannel(os.path.join(directory, OUTPUT_SOCKET))
        self.codec = Codec()
        self.clients: list[bytes] = []
        #: engine request id -> (client identity, the client's id)
        self.owners: dict[str, tuple[bytes, str]] = {}
        #: (client identity, client's id) -> engine request id
        self.ids: dict[tuple[bytes, str], str] = {}
        #: finished requests a connector still holds (engine ids)
        self.held: set[str] = set()
        self._held_owner: dict[str, tuple[bytes, str]] = {}
        #: the client requests (groups) of the requests in flight, over all clients
        self.groups: RequestGroups[tuple[bytes, str]] = RequestGroups()
        self.running = True
        self.info: dict[str, Any] = {
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "eos_token_id": _plain(self.core.eos_token_id),
            "stats": _stats_values(self.core.stats()),
            "summary": engine_summary(self.core),
        }

    def close(self) -> None:
        self.input.close(0)
        self.output.close()
        self.ctx.term()

    # ---- loop -----------------------------------------------------------------

    def run(self) -> None:
        core = self.core
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        output = self.output
        output.poller = poller
        output.watch(output.listener, zmq.POLLIN)
        wait_ms = _IDLE_POLL_MS
        while self.running:
            events = dict(poller.poll(wait_ms))
            if len(events) > (self.input in events):
                for identity in output.handle(events):
                    self._greet(identity)
            if self.input in events:
                self._drain_input()
            if os.getppid() != self.parent:
                logger.warning("the server process is gone: the engine exits")
                return
            if not self.running:
                return
            if not core.has_work():
                wait_ms = _IDLE_POLL_MS
                continue
            outputs = core.step()
            self._send(outputs)
            wait_ms = 0
            if not outputs and core.last_num_scheduled == 0:
                wait_ms = _TRANSFER_POLL_MS

    def _greet(self, identity: bytes) -> None:
        if identity not in self.clients:
            self.clients.append(identity)
        info = {**self.info, "stats": _stats_values(self.core.stats())}
        self.output.send(identity, self.codec.encode_header((WELCOME, info)))

    def _drain_input(self) -> None:
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            try:
                message = self.codec.decode(frames[1:])
            except (msgspec.DecodeError, ValueError, TypeError) as exc:
                logger.error("undecodable message from a client: %s", exc)
                continue
            kind = message[0]
            if kind == ADD:
                self._add(identity, message)
            elif kind == ABORT:
                ids = [self.ids[(identity, r)] for r in message[1] if (identity, r) in self.ids]
                if ids:
                    self.core.abort(ids)
            elif kind == ABORT_GROUPS:
                # Any client's requests: the API servers of a group serve one principal
                # (their shared API key), and an abort may land on any of them.
                owners = self.groups.members(g for g in message[1] if isinstance(g, str))
                ids = [self.ids[o] for o in owners if o in self.ids]
                if ids:
                    self.core.abort(ids)
            elif kind == STOP:
                engine_id = self.ids.get((identity, message[1]))
                if engine_id is not None:
                    self.core.stop(engine_id, message[2])
            elif kind == SHUTDOWN and self.num_clients == 1:
                # Several clients (``--api-server-count``): the process's owner stops
                # it once every client is done; one client leaving stops nothing.
                self.running = False
                return

    def _engine_id(self, identity: bytes, request_id: str) -> str:
        if self.num_clients == 1:
            return request_id
        return f"{identity.decode(errors='replace')}:{request_id}"

    def _add(self, identity: bytes, message: list[Any]) -> None:
        _, request_id, inputs, params, *rest = message
        group = rest[0] if rest and isinstance(rest[0], str) else None
        engine_id = self._engine_id(identity, request_id)
        if engine_id in self.owners or engine_id in self.held:
            self._fail(identity, request_id, f"request id {request_id!r} is already in use")
            return
        owner = (identity, request_id)
        try:
            built_inputs = self._inputs(inputs)
            built_params = self._params(params)
            self.owners[engine_id] = owner
            self.ids[owner] = engine_id
            self.groups.add(group, owner)
            self.core.add_request(engine_id, built_inputs, built_params)
        except Exception as exc:
            self.owners.pop(engine_id, None)
            self.ids.pop(owner, None)
            self.groups.discard(owner)
            self._fail(identity, request_id, f"request could not be added: {exc}")

    def _fail(self, identity: bytes, request_id: str, error: str) -> None:
        """A request that never reached the core ends at once with ``error``."""
        item = EngineOutput(request_id, [], "error", error=error)
        message = EngineOutputs([item], _stats_values(self.core.stats()))
        self.output.send(identity, self.codec.encode_header(message))

    def _inputs(self, data: dict[str, Any]) -> Any:
        """``ProcessedInputs``, or what a mock core builds in their place (duck-typed)."""
        builder = getattr(self.core, "build_inputs", None)
        if builder is not None:
            return builder(data)
        from ec_frontend.model.processor import MultiModalFeature, ProcessedInputs, VideoPatches

        def feature(packed: dict[str, Any]) -> MultiModalFeature:
            fields = unpack_fields(packed)
            whole = fields.get("video_patch_of")
            if isinstance(whole, dict):
                fields["video_patch_of"] = VideoPatches(**unpack_fields(whole))
            return MultiModalFeature(**fields)

        kwargs = unpack_fields(data)
        kwargs["mm_features"] = [feature(f) for f in kwargs.get("mm_features") or []]
        return ProcessedInputs(**kwargs)

    def _params(self, data: dict[str, Any]) -> SamplingParams:
        from ec_frontend.engine.sampling_params import SamplingParams

        kwargs = unpack_fields(data)
        grammar = kwargs.pop("structured_outputs", None)
        params = SamplingParams(**kwargs)
        if grammar is not None:
            params.structured_outputs = self.served.grammar(grammar[0], grammar[1])
        return params

    # ---- outputs ----------------------------------------------------------------

    def _send(self, outputs: list[RequestOutput]) -> None:
        """One message per client: its outputs, the stats, connector-held changes."""
        core = self.core
        scheduled = core.last_num_scheduled
        if not outputs and scheduled == 0 and not self.held:
            return
        per_client: dict[bytes, list[EngineOutput]] = {c: [] for c in self.clients}
        held_added: dict[bytes, list[str]] = {}
        held_released: dict[bytes, list[str]] = {}
        requests = core.scheduler.requests
        for out in outputs:
            owner = self.owners.get(out.request_id)
            if owner is None:
                continue
            identity, client_id = owner
            if out.finished:
                del self.owners[out.request_id]
                self.ids.pop(owner, None)
                self.groups.discard(owner)
                if out.request_id in requests:
                    self.held.add(out.request_id)
                    held_added.setdefault(identity, []).append(client_id)
                    self._held_owner[out.request_id] = owner
            per_client.setdefault(identity, []).append(pack_output(out, client_id))
        if self.held:
            for engine_id in [r for r in self.held if r not in requests]:
                self.held.discard(engine_id)
                identity, client_id = self._held_owner.pop(engine_id)
                held_released.setdefault(identity, []).append(client_id)
        if not outputs and scheduled == 0 and not held_released:
            return
        stats = _stats_values(core.stats())
        for identity, items in per_client.items():
            message = EngineOutputs(
                items, stats, held_added.get(identity), held_released.get(identity)
            )
            self.output.send(identity, self.codec.encode_header(message))


class _Connection:
    """One client's output connection: its socket, what waits to be sent, and
    (until its ``hello``) what it has sent."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.identity: bytes | None = None
        self.outbox = bytearray()
        self.reader = FrameReader()


class OutputChannel:
    """The engine's output side: a Unix stream socket that clients connect to, one
    connection each, told apart by the identity of their ``hello``. :meth:`send`
    never blocks: what the kernel does not take now is kept and sent as the socket
    drains (the step loop's poller watches it). A client that hangs up is dropped;
    what was meant for it is discarded."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.poller: zmq.Poller | None = None
        self._by_fd: dict[int, _Connection] = {}
        self._by_identity: dict[bytes, _Connection] = {}
        self._codec = Codec()

    def watch(self, sock: socket.socket, flags: int) -> None:
        if self.poller is not None:
            self.poller.register(sock, flags)

    def handle(self, events: dict[Any, int]) -> list[bytes]:
        """Serve the poller's events on this channel's sockets; the identities of
        clients that said ``hello`` now."""
        greeted: list[bytes] = []
        listener = self.listener.fileno()
        for fd, flags in events.items():
            # The poller reports a native socket by its descriptor.
            if fd == listener:
                self._accept()
                continue
            conn = self._by_fd.get(fd) if isinstance(fd, int) else None
            if conn is None:
                continue
            if flags & zmq.POLLOUT:
                self._flush(conn)
            if flags & (zmq.POLLIN | zmq.POLLERR):
                identity = self._read(conn)
                if identity is not None:
                    greeted.append(identity)
        return greeted

    def send(self, identity: bytes, header: bytes) -> None:
        conn = self._by_identity.get(identity)
        if conn is None:
            return
        data = stream_frame(header)
        if conn.outbox:
            conn.outbox += data
            return
        try:
            sent = conn.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(conn)
            return
        if sent < len(data):
            conn.outbox += data[sent:]
            self._modify(conn, zmq.POLLIN | zmq.POLLOUT)

    def close(self) -> None:
        for conn in list(self._by_fd.values()):
            conn.sock.close()
        self._by_fd.clear()
        self._by_identity.clear()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            conn = _Connection(sock)
            self._by_fd[sock.fileno()] = conn
            self.watch(sock, zmq.POLLIN)

    def _read(self, conn: _Connection) -> bytes | None:
        """Read what the client sent: its ``hello`` (the identity returned), or the
        end of the connection."""
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return None
        if conn.identity is not None:
            return None
        try:
            frames = conn.reader.feed(data)
            if not frames:
                return None
            kind, identity = self._codec.decode([frames[0]])
            if kind != HELLO or not isinstance(identity, bytes):
                raise ValueError(f"unexpected first message {kind!r}")
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            logger.error("a client's output connection opened badly: %s", exc)
            self._drop(conn)
            return None
        old = self._by_identity.get(identity)
        if old is not None:
            self._drop(old)
        conn.identity = identity
        self._by_identity[identity] = conn
        return identity

    def _flush(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        del conn.outbox[:sent]
        if not conn.outbox:
            self._modify(conn, zmq.POLLIN)

    def _modify(self, conn: _Connection, flags: int) -> None:
        if self.poller is not None:
            self.poller.modify(conn.sock, flags)

    def _drop(self, conn: _Connection) -> None:
        if self._by_fd.pop(conn.sock.fileno(), None) is None:
            return
        if conn.identity is not None and self._by_identity.get(conn.identity) is conn:
            del self._by_identity[conn.identity]
        if self.poller is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.poller.unregister(conn.sock)
        conn.sock.close()


def _stats_values(stats: EngineStats) -> list[int | float]:
    """The snapshot's field values in field order (every step: no per-call reflection)."""
    global _stats_getter
    if _stats_getter is None:
        _stats_getter = operator.attrgetter(*(f.name for f in dataclasses.fields(stats)))
    return list(_stats_getter(stats))


_stats_getter: Callable[[EngineStats], tuple[int | float, ...]] | None = None


def _plain(value: object) -> object:
    if isinstance(value, tuple | list | frozenset | set):
        return list(value)
    return value
