"""MPEngineClient: the server's engine when the core runs in its own process.

It has the interface the server uses of :class:`~ec_frontend.engine.async_engine.AsyncEngine`
(``add_request`` -> :class:`RequestStream`, ``abort``, ``abort_groups`` (applied by
the engine to every client's requests), ``stats``, ``holds_request``,
``is_running``, ``shutdown``, ``processor``, ``config``, ``eos_token_id``) and
talks to the engine process of :mod:`ec_frontend.engine.core_proc` over ZMQ.

The frontend side keeps what is per-token text work: detokenization (the
tokenizers library's ``DecodeStream``, one Rust call per token, for a fast
tokenizer; :class:`IncrementalDetokenizer` otherwise) and stop strings. A stop
string tells the core to finish the request as stopped; the stream's last delta
waits for the core's final output, which carries the transfer params.

Requests are sent from the event loop's thread; one I/O thread receives the
engine's messages, turns them into :class:`RequestOutput` deltas and posts them to
the streams' loops (one wake-up per loop for all the messages already there:
one engine message per step with this client's outputs of the step). It also
watches the engine process (a pidfd): when the process is gone, every open stream
ends with an error, :attr:`is_running` turns false and the death callbacks run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
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
    _Sink,
)
from ec_frontend.engine.core_proc import WELCOME_TIMEOUT_S, EngineProcess, EngineSpec
from ec_frontend.engine.detokenizer import IncrementalDetokenizer, text_token_ids
from ec_frontend.engine.outputs import RequestOutput
from ec_frontend.engine.stats import EngineStats
from ec_frontend.engine.wire import (
    ABORT,
    ABORT_GROUPS,
    ADD,
    HELLO,
    SHUTDOWN,
    STOP,
    WELCOME,
    Codec,
    EngineOutput,
    outputs_decoder,
    pack_dataclass,
    pack_params,
)
from ec_frontend.errors import StartupError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ec_frontend.config import EngineConfig
    from ec_frontend.engine.mock import MockEngineConfig, MockInputs, MockProcessor
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.model.processor import InputProcessor, ProcessedInputs

logger = logging.getLogger(__name__)

#: How often the I/O thread looks at the engine process when nothing arrives (s).
_WATCH_S = 0.2
#: Most engine messages the I/O thread decodes before it hands their outputs over.
_DRAIN_MESSAGES = 64
#: Prompt tokens given to the streaming decoder as left context.
_PROMPT_CONTEXT = 5

__all__ = ["EngineDeadError", "MPEngineClient", "StartupError", "StreamDetokenizer"]


class StreamDetokenizer(IncrementalDetokenizer):
    """Incremental text with ``tokenizers.decoders.DecodeStream``: one native call per
    token. Stop strings and the hold-back of a possible stop prefix are the base
    class's. Tokens that end inside a multi-byte character wait for the next one;
    when the request ends with them, they are decoded as they are."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__(tokenizer, prompt_token_ids, params)
        self._backend = tokenizer.backend_tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        self._pending: list[int] = []

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str | None:
        step = self._stream.step
        backend = self._backend
        for token in new_token_ids:
            if self._stopped:
                return None
            self._num_output += 1
            piece = step(backend, token)
            if piece is None:
                self._pending.append(token)
                continue
            self._pending.clear()
            if piece:
                stop = self._append(piece)
                if stop is not None:
                    return stop
        if finished and not self._stopped and self._pending:
            rest = self._decode(self._pending)
            self._pending.clear()
            return self._append(rest)
        return None

    def _append(self, piece: str) -> str | None:
        checked = len(self.text)
        self.text += piece
        stop = self._find_stop(checked)
        if stop is not None:
            self._stopped = True
        return stop


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
) -> IncrementalDetokenizer:
    """The streaming detokenizer for a fast Hugging Face tokenizer, else the window one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend).__module__.startswith("tokenizers"):
        return StreamDetokenizer(tokenizer, prompt_token_ids, params)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)


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
        self._output = self._socket(identity, f"{address}/out")
        self._codec = Codec()
        self._out_codec = Codec()
        self._out_decoder = outputs_decoder()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._requests: dict[str, _ClientRequest] = {}
        self._held: set[str] = set()
        self._death_callbacks: list[Callable[[str], None]] = []
        self._closing = False
        self._dead: str | None = None
        try:
            info = self._handshake()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.info = info
        self.pid: int = int(info["pid"])
        eos = info.get("eos_token_id")
        self.eos_token_id: int | list[int] | None = eos
        self._stats_values: list[Any] = info["stats"]
        self._stats: EngineStats | None = None
        self._pidfd = _pidfd(self.pid)
        self._thread = threading.Thread(target=self._run, name="ec-engine-client", daemon=True)
        self._thread.start()

    def _socket(self, identity: bytes, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        return sock

    def _handshake(self) -> dict[str, Any]:
        self._output.send(HELLO)
        deadline = time.monotonic() + WELCOME_TIMEOUT_S
        while not self._output.poll(100):
            gone = self.process is not None and not self.process.is_alive()
            if gone or time.monotonic() > deadline:
                raise StartupError("the engine process did not answer")
        kind, info = self._out_codec.decode(self._output.recv_multipart(copy=False))
        if kind != WELCOME:
            raise StartupError(f"unexpected first message from the engine: {kind!r}")
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
        stats = self._stats
        if stats is None:
            stats = self._stats = EngineStats(*self._stats_values)
        return stats

    def holds_request(self, request_id: str) -> bool:
        """In flight here, or finished and still held by a connector in the engine."""
        return request_id in self._requests or request_id in self._held

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._closing and self._thread.is_alive()

    def add_death_callback(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from the I/O thread) if the engine process dies."""
        self._death_callbacks.append(callback)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (when this client started it) and the I/O thread;
        unfinished requests end with an error output."""
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
        self._ctx.destroy(linger=0)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    # ---- sending ------------------------------------------------------------------

    def _send(self, message: object) -> None:
        with self._send_lock:
            frames = self._codec.encode(message)
            self._input.send_multipart(frames, copy=False)

    # ---- the I/O thread -------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        if self._pidfd is not None:
            poller.register(self._pidfd, zmq.POLLIN)
        reason = "the engine is shut down"
        try:
            while not self._closing:
                events = dict(poller.poll(int(_WATCH_S * 1000)))
                if self._output in events:
                    self._drain()
                if (self._pidfd is not None and self._pidfd in events) or not self._alive():
                    if not self._closing:
                        reason = self._death_reason()
                    break
        except Exception as exc:
            if not self._closing:
                logger.exception("engine client stopped")
                reason = f"the engine connection failed: {exc}"
        self._end(reason, unexpected=not self._closing)

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

    def _drain(self) -> None:
        """The messages already received (up to :data:`_DRAIN_MESSAGES`); then one
        hand-off per loop for all of them: a backlog of steps wakes each loop once,
        and its streams find every delta there (one write per connection)."""
        batches: dict[asyncio.AbstractEventLoop, _Deliveries] = {}
        try:
            self._receive(batches)
        finally:
            for loop, deliveries in batches.items():
                _post(loop, deliveries)

    def _receive(self, batches: dict[asyncio.AbstractEventLoop, _Deliveries]) -> None:
        decode = self._out_decoder.decode
        recv = self._output.recv_multipart
        for _ in range(_DRAIN_MESSAGES):
            try:
                frames = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = decode(frames[0].buffer)
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
