"""MPEngineClient: the server's engine when the core runs in its own process.

It has the interface the server uses of :class:`~ec_frontend.engine.async_engine.AsyncEngine`
(``add_request`` -> :class:`RequestStream`, ``abort``, ``abort_groups`` (applied by
the engine to every client's requests), ``stats``, ``holds_request``,
``is_running``, ``shutdown``, ``processor``, ``config``, ``eos_token_id``) and
talks to the engine process of :mod:`ec_frontend.engine.core_proc` over ZMQ.

The frontend side keeps what is per-token text work: detokenization
(:func:`~ec_frontend.engine.detokenizer.make_detokenizer`) and stop strings. A stop
string tells the core to finish the request as stopped; the stream's last delta
waits for the core's final output, which carries the transfer params.

Requests are sent from the event loop's thread. The engine's messages (one per
step with this client's outputs of the step) are read on an event loop too: the
*home* loop, the one the latest request came from while no other is running
(a server has one), watches the output socket's file descriptor and turns the
messages already there into :class:`RequestOutput` deltas for its streams, with
no thread between the socket and the streams. A stream on another running loop
gets its deltas posted there, one wake-up per loop per read. A watcher thread,
asleep on a pidfd, sees the engine process go: then every open stream ends with
an error, :attr:`is_running` turns false and the death callbacks run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from ec_frontend.engine.async_engine import (
    EngineDeadError,
    RequestStream,
    _Deliveries,
    _post,
    _put_all,
    _Sink,
)
from ec_frontend.engine.core_proc import WELCOME_TIMEOUT_S, EngineProcess, EngineSpec
from ec_frontend.engine.detokenizer import (
    IncrementalDetokenizer,
    make_detokenizer,
    text_token_ids,
)
from ec_frontend.engine.outputs import RequestOutput
from ec_frontend.engine.stats import EngineStats
from ec_frontend.engine.wire import (
    ABORT,
    ABORT_GROUPS,
    ADD,
    HELLO,
    OUTPUT_SOCKET,
    SHUTDOWN,
    STOP,
    WELCOME,
    Codec,
    EngineOutput,
    FrameReader,
    outputs_decoder,
    pack_dataclass,
    pack_params,
    stream_frame,
)
from ec_frontend.errors import StartupError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ec_frontend.config import EngineConfig
    from ec_frontend.engine.mock import MockEngineConfig, MockInputs, MockProcessor
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.model.processor import InputProcessor, ProcessedInputs

logger = logging.getLogger(__name__)

#: How often the watcher looks at the engine process without a pidfd, or at a
#: shutdown (s).
_WATCH_S = 0.2
#: Most bytes of engine messages one read takes before the loop runs the streams.
_READ_BYTES = 1 << 20

__all__ = ["EngineDeadError", "MPEngineClient", "StartupError"]


@dataclass(slots=True)
class _ClientRequest:
    sink: _Sink
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    #: The last delta of a request a stop string ended, until the core confirms.
    stopped: RequestOutput | None = None


class MPEngineClient:
    """One frontend's connection to an engine process (see the module docstring)."""

    def __init__(
        self,
        address: str,
        *,
        config: EngineConfig | MockEngineConfig,
        processor: InputProcessor | MockProcessor,
        client_index: int = 0,
        process: EngineProcess | None = None,
        detokenize: bool = True,
    ) -> None:
        self.config = config
        self.processor = processor
        self.process = process
        self._detokenize = detokenize and processor is not None
        self._ctx = zmq.Context(io_threads=1)
        identity = f"client-{client_index}".encode()
        self._input = self._socket(identity, f"{address}/in")
        self._output = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._codec = Codec()
        self._out_codec = Codec()
        self._out_decoder = outputs_decoder()
        self._frames = FrameReader()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._requests: dict[str, _ClientRequest] = {}
        self._held: set[str] = set()
        self._death_callbacks: list[Callable[[str], None]] = []
        self._closing = False
        self._dead: str | None = None
        try:
            info = self._handshake(identity, address.removeprefix("ipc://"))
        except BaseException:
            self._output.close()
            self._ctx.destroy(linger=0)
            raise
        self.info = info
        self.pid: int = int(info["pid"])
        eos = info.get("eos_token_id")
        self.eos_token_id: int | list[int] | None = eos
        self._stats_values: list[Any] = info["stats"]
        self._stats: EngineStats | None = None
        self._pidfd = _pidfd(self.pid)
        self._fd = self._output.fileno()
        self._home: asyncio.AbstractEventLoop | None = None
        self._home_lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="ec-engine-watch", daemon=True)
        self._thread.start()

    def _socket(self, identity: bytes, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        return sock

    def _handshake(self, identity: bytes, directory: str) -> dict[str, Any]:
        """Connect the output channel, say hello, wait for the engine's welcome."""
        deadline = time.monotonic() + WELCOME_TIMEOUT_S
        sock = self._output
        sock.settimeout(0.1)
        path = os.path.join(directory, OUTPUT_SOCKET)
        frames: list[bytes] = []
        connected = False
        while not frames:
            gone = self.process is not None and not self.process.is_alive()
            if gone or time.monotonic() > deadline:
                raise StartupError("the engine process did not answer")
            try:
                if not connected:
                    sock.connect(path)
                    connected = True
                    sock.sendall(stream_frame(self._out_codec.encode_header((HELLO, identity))))
                data = sock.recv(65536)
            except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
                if not connected:
                    time.sleep(0.05)
                continue
            if not data:
                raise StartupError("the engine closed its output channel")
            frames = self._frames.feed(data)
        kind, info = self._out_codec.decode([frames[0]])
        if kind != WELCOME:
            raise StartupError(f"unexpected first message from the engine: {kind!r}")
        if len(frames) > 1:
            raise StartupError("the engine sent outputs before its welcome")
        sock.setblocking(False)
        welcome: dict[str, Any] = info
        return welcome

    @classmethod
    def start(
        cls,
        config: EngineConfig | MockEngineConfig,
        *,
        cpu_threads: int | None = None,
        log_level: int = logging.WARNING,
        kind: str = "real",
        processor: InputProcessor | MockProcessor | None = None,
        spawned: EngineProcess | None = None,
    ) -> MPEngineClient:
        """Start an engine process for ``config`` (or give ``spawned``, an
        :meth:`EngineProcess.spawn`-ed one, its spec) and connect to it. The
        frontend's input processor loads while the engine loads its model."""
        spec = EngineSpec(config, cpu_threads=cpu_threads, kind=kind, log_level=log_level)
        proc = EngineProcess.launch(spec) if spawned is None else spawned.send(spec)
        try:
            if processor is None:
                processor = _load_processor(config, kind)
            proc.wait_ready()
            return cls(proc.address, config=config, processor=processor, process=proc)
        except BaseException:
            proc.kill()
            raise

    # ---- the AsyncEngine interface ----------------------------------------------

    def add_request(
        self,
        request_id: str,
        inputs: ProcessedInputs | MockInputs,
        params: SamplingParams,
        group: str | None = None,
    ) -> RequestStream:
        """Submit a request; iterate the result for its deltas (from a running loop).
        ``group``: the client request it belongs to, for :meth:`abort_groups`."""
        loop = asyncio.get_running_loop()
        if loop is not self._home:
            self._adopt(loop)
        prompt = inputs.prompt_token_ids
        detok = None
        if self._detokenize and not getattr(self.config, "is_encoder_only", False):
            detok = make_detokenizer(self.processor.tokenizer, prompt, params)
        sink = _Sink(loop, asyncio.Queue())
        with self._lock:
            if self._dead is not None or self._closing:
                raise EngineDeadError(self._dead or "the engine is shut down")
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._requests[request_id] = _ClientRequest(sink, prompt, detok)
        message: tuple[object, ...] = (ADD, request_id, pack_dataclass(inputs), pack_params(params))
        self._send(message if group is None else (*message, group))
        return RequestStream(self, request_id, sink)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with ``finish_reason="abort"``."""
        self._abort_nowait(request_id)

    def _abort_nowait(self, request_id: str) -> None:
        if self._dead is None and not self._closing:
            self._send((ABORT, [request_id]))

    async def abort_groups(self, groups: Sequence[str]) -> None:
        """Abort every request of ``groups`` (exact names), whichever client of the
        engine process added it: the engine applies it, so with several API servers
        an abort reaches the request wherever it runs."""
        if groups and self._dead is None and not self._closing:
            self._send((ABORT_GROUPS, list(groups)))

    def stats(self) -> EngineStats:
        """The engine's snapshot after its latest step that computed anything."""
        self._read_idle()
        stats = self._stats
        if stats is None:
            stats = self._stats = EngineStats(*self._stats_values)
        return stats

    def holds_request(self, request_id: str) -> bool:
        """In flight here, or finished and still held by a connector in the engine."""
        self._read_idle()
        return request_id in self._requests or request_id in self._held

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._closing and self._thread.is_alive()

    def add_death_callback(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` if the engine process dies (from the watcher
        thread; from the home loop when its messages cannot be read)."""
        self._death_callbacks.append(callback)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (when this client started it), the watcher and the
        home loop's reading; unfinished requests end with an error output."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self.process is not None:
            # Only the client that started the engine stops it.
            with contextlib.suppress(zmq.ZMQError):
                self._send((SHUTDOWN,))
            self.process.terminate(timeout, grace=min(2.0, timeout))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._leave_home(timeout)
        self._output.close()
        self._ctx.destroy(linger=0)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    # ---- sending ------------------------------------------------------------------

    def _send(self, message: object) -> None:
        with self._send_lock:
            frames = self._codec.encode(message)
            self._input.send_multipart(frames, copy=False)

    # ---- the home loop: reading the engine's messages ---------------------------

    def _adopt(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on ``loop`` unless another loop still runs and
        reads them (its streams' deltas are then posted to ``loop``)."""
        with self._home_lock:
            home = self._home
            if home is loop or (home is not None and home.is_running() and not home.is_closed()):
                return
            if home is not None and not home.is_closed():
                home.remove_reader(self._fd)
            self._home = loop
            loop.add_reader(self._fd, self._on_readable)
        # The socket's descriptor signals edges: read what came before it was watched.
        loop.call_soon(self._on_readable)

    def _read_idle(self) -> None:
        """Read what has arrived here when no running loop reads it (a client used
        between event loops), so that stats and held requests stay current."""
        home = self._home
        if home is not None and home.is_running():
            return
        with self._home_lock:
            home = self._home
            if home is not None and home.is_running():
                return
            batches: dict[asyncio.AbstractEventLoop, _Deliveries] = {}
            try:
                while not self._closing and self._dead is None and self._receive(batches):
                    pass
            finally:
                for loop, deliveries in batches.items():
                    _post(loop, deliveries)

    def _leave_home(self, timeout: float) -> None:
        """Stop reading on the home loop, from its thread when it runs elsewhere."""
        with self._home_lock:
            home, self._home = self._home, None
        if home is None or home.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is home or not home.is_running():
            home.remove_reader(self._fd)
            return
        done = threading.Event()

        def remove() -> None:
            home.remove_reader(self._fd)
            done.set()

        with contextlib.suppress(RuntimeError):
            home.call_soon_threadsafe(remove)
            done.wait(min(timeout, 1.0))

    def _on_readable(self) -> None:
        """The messages already received (up to :data:`_READ_BYTES`; the reader fires
        again while more is there); this loop's streams get their deltas at once, others'
        loops one hand-off each."""
        if self._closing or self._dead is not None:
            return
        home = self._home
        batches: dict[asyncio.AbstractEventLoop, _Deliveries] = {}
        try:
            self._receive(batches)
        except Exception as exc:
            if not self._closing:
                logger.exception("engine client stopped")
                self._fail(f"the engine connection failed: {exc}")
        finally:
            for loop, deliveries in batches.items():
                if loop is home:
                    _put_all(deliveries)
                else:
                    _post(loop, deliveries)

    # ---- the watcher thread ---------------------------------------------------------

    def _watch(self) -> None:
        """Sleep until the engine process is gone (or the client shuts down)."""
        pidfd = self._pidfd
        watch = None
        if pidfd is not None:
            # poll, not select: a server's descriptors may number past FD_SETSIZE.
            watch = select.poll()
            watch.register(pidfd, select.POLLIN)
        reason = "the engine is shut down"
        try:
            while not self._closing and self._dead is None:
                if watch is not None:
                    if watch.poll(_WATCH_S * 1000) and not self._closing:
                        reason = self._death_reason()
                        break
                else:
                    time.sleep(_WATCH_S)
                if not self._closing and not self._alive():
                    reason = self._death_reason()
                    break
        except Exception as exc:
            if not self._closing:
                logger.exception("engine client stopped")
                reason = f"the engine connection failed: {exc}"
        if self._dead is None:
            self._end(reason, unexpected=not self._closing)

    def _fail(self, reason: str) -> None:
        """End the client on the home loop's read error: streams, health and the
        death callbacks, which may block, from a thread of their own."""
        with contextlib.suppress(Exception):
            self._leave_home(0.0)
        threading.Thread(target=self._end, args=(reason, True), daemon=True).start()

    def _alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        if self._pidfd is not None:
            return True
        return _pid_alive(self.pid)

    def _death_reason(self) -> str:
        code = None
        if self.process is not None:
            code = self.process.proc.poll()
        suffix = f" (exit code {code})" if code is not None else ""
        return f"the engine process {self.pid} exited{suffix}"

    def _end(self, reason: str, unexpected: bool) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
            requests, self._requests = self._requests, {}
        if unexpected:
            logger.error("%s: failing %d requests in flight", reason, len(requests))
        for request_id, state in requests.items():
            failed = RequestOutput(
                request_id=request_id, finished=True, finish_reason="error", error=reason
            )
            _post(state.sink.loop, [(state.sink.queue, failed)])
        if unexpected:
            for callback in self._death_callbacks:
                try:
                    callback(reason)
                except Exception:
                    logger.exception("engine death callback failed")

    def _receive(self, batches: dict[asyncio.AbstractEventLoop, _Deliveries]) -> bool:
        """Decode the messages that have arrived (up to :data:`_READ_BYTES`) into
        ``batches``; whether more may be waiting."""
        try:
            data = self._output.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self._closed_by_engine()
            return False
        decode = self._out_decoder.decode
        for frame in self._frames.feed(data):
            message = decode(frame)
            self._stats_values, self._stats = message.stats, None
            if message.held_added:
                self._held.update(message.held_added)
            if message.held_released:
                self._held.difference_update(message.held_released)
            for item in message.outputs:
                state = self._requests.get(item.request_id)
                if state is None:
                    continue
                out = self._output_of(state, item)
                if out is None:
                    continue
                if out.finished:
                    with self._lock:
                        self._requests.pop(out.request_id, None)
                batches.setdefault(state.sink.loop, []).append((state.sink.queue, out))
        return len(data) == _READ_BYTES

    def _closed_by_engine(self) -> None:
        """The engine ended the output channel: stop reading; the engine process's
        end (the watcher's reason) follows, else this ends the client after 1 s."""
        with contextlib.suppress(Exception):
            self._leave_home(0.0)

        def settle() -> None:
            self._thread.join(1.0)
            if not self._closing:
                self._end("the engine closed its output channel", unexpected=True)

        if not self._closing and self._dead is None:
            threading.Thread(target=settle, daemon=True).start()

    def _output_of(self, state: _ClientRequest, item: EngineOutput) -> RequestOutput | None:
        """The delta of one engine output (``None``: nothing to deliver yet)."""
        rid, token_ids, finish = item.request_id, item.token_ids, item.finish_reason
        stop_reason, lps, cached = item.stop_reason, item.logprobs, item.num_cached_tokens
        kv, ec, error = item.kv_transfer_params, item.ec_transfer_params, item.error
        finished = finish is not None
        held = state.stopped
        if held is not None:
            if not finished:
                return None
            held.num_cached_tokens = max(held.num_cached_tokens, cached)
            held.kv_transfer_params = kv if kv is not None else held.kv_transfer_params
            held.ec_transfer_params = ec if ec is not None else held.ec_transfer_params
            return held
        logprobs = lps
        text = ""
        detok = state.detokenizer
        if detok is not None:
            stop = detok.update(text_token_ids(token_ids, finish, stop_reason), finished)
            if stop is not None:
                out = RequestOutput(
                    rid, state.prompt_token_ids, token_ids, detok.take_delta(True), True,
                    "stop", stop, logprobs, cached, kv, ec, error,
                )  # fmt: skip
                if finished:
                    return out
                state.stopped = out
                self._send((STOP, rid, stop))
                return None
            text = detok.take_delta(finished)
        return RequestOutput(
            rid, state.prompt_token_ids, token_ids, text, finished, finish,
            stop_reason, logprobs, cached, kv, ec, error,
        )  # fmt: skip


def _load_processor(
    config: EngineConfig | MockEngineConfig, kind: str
) -> InputProcessor | MockProcessor:
    if kind == "mock":
        from ec_frontend.engine.mock import MockProcessor

        return MockProcessor()
    from ec_frontend.config import EngineConfig
    from ec_frontend.engine.core import EngineCore
    from ec_frontend.model.loader import load_processor

    if not isinstance(config, EngineConfig):
        raise TypeError(f"a model engine takes an EngineConfig, not {config!r}")

    path, model_id = EngineCore.checkpoint(config)
    return load_processor(path, model_id=config.model_id or model_id)


def _pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")
