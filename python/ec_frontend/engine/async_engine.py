"""AsyncEngine: the asyncio face of an EngineCore that runs in a background thread.

``add_request`` returns an async iterator of :class:`RequestOutput` deltas (the
last has ``finished=True``). Commands reach the core thread through a queue;
outputs come back through ``loop.call_soon_threadsafe``. The core is touched by
its thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ec_frontend.engine.groups import RequestGroups
from ec_frontend.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ec_frontend.config import EngineConfig
    from ec_frontend.engine.core import EngineCore
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.engine.stats import EngineStats
    from ec_frontend.model.processor import InputProcessor, ProcessedInputs

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5
#: Pause between steps that only poll connectors (delayed frees, remote KV).
_POLL_WAIT_S = 0.002

#: Outputs bound for one client loop: (the stream's queue, the output).
_Deliveries = list[tuple["asyncio.Queue[RequestOutput]", RequestOutput]]


class EngineDeadError(RuntimeError):
    """The engine was shut down, or its loop stopped on an internal error."""


@dataclass(slots=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class _Aborts(Protocol):
    """What a stream needs of its engine: to abort its request without awaiting."""

    def _abort_nowait(self, request_id: str) -> None: ...


#: The core thread's commands: add ``(request_id, inputs, params)``, or abort an id.
_Command = tuple[str, "tuple[str, ProcessedInputs, SamplingParams] | str"]


class RequestStream:
    """Async iterator over one request's output deltas.

    Closing it (``aclose``) or cancelling the task that iterates it before the
    request finished aborts the request. :meth:`ready` tells a writer whether to
    wait for more before it writes what it has.
    """

    def __init__(self, engine: _Aborts, request_id: str, sink: _Sink) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = sink.queue
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        try:
            output = await self._queue.get()
        except asyncio.CancelledError:
            self._engine._abort_nowait(self.request_id)
            raise
        if output.finished:
            self._finished = True
        return output

    def ready(self) -> bool:
        """Whether the next delta has already arrived (``__anext__`` will not wait)."""
        return not self._finished and not self._queue.empty()

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine._abort_nowait(self.request_id)


class AsyncEngine:
    """Serves requests on an :class:`EngineCore` stepped by a daemon thread."""

    def __init__(self, core: EngineCore, processor: InputProcessor) -> None:
        self.core = core
        self.config: EngineConfig = core.config
        self.processor = processor
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()
        self._sinks: dict[str, _Sink] = {}
        #: the client requests of the requests in flight (under ``_lock``)
        self._groups: RequestGroups[str] = RequestGroups()
        self._stats = core.stats()
        self._stopping = False
        self._dead: str | None = None
        self._thread = threading.Thread(target=self._run, name="ec-engine-core", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        from ec_frontend.engine.core import EngineCore

        core, processor = EngineCore.from_config(config)
        return cls(core, processor)

    @property
    def eos_token_id(self) -> int | Sequence[int] | None:
        return self.core.eos_token_id

    # ---- client API ---------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        inputs: ProcessedInputs,
        params: SamplingParams,
        group: str | None = None,
    ) -> RequestStream:
        """Submit a request; iterate the result for its deltas.

        Must be called from a running event loop. Raises ``ValueError`` for an
        id already in flight and :class:`EngineDeadError` after shutdown.
        ``group``: the client request it belongs to, for :meth:`abort_groups`.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(self._dead or "the engine is shut down")
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already in flight")
            sink = _Sink(loop, asyncio.Queue())
            self._sinks[request_id] = sink
            self._groups.add(group, request_id)
        self._commands.put(("add", (request_id, inputs, params)))
        self._wakeup.set()
        return RequestStream(self, request_id, sink)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with ``finish_reason="abort"``."""
        self._abort_nowait(request_id)

    def _abort_nowait(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    async def abort_groups(self, groups: Sequence[str]) -> None:
        """Abort every request of ``groups`` (exact names; see ``engine/groups.py``)."""
        with self._lock:
            ids = self._groups.members(groups)
        for request_id in ids:
            self._abort_nowait(request_id)

    def stats(self) -> EngineStats:
        """The latest snapshot (taken by the core thread after each step)."""
        with self._lock:
            return self._stats

    def holds_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is still taken: in flight, or finished but held by a
        connector (KV or encoder outputs not yet pulled by another instance)."""
        return request_id in self._sinks or request_id in self.core.scheduler.requests

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core thread; unfinished requests end with an error output."""
        with self._lock:
            self._stopping = True
        self._wakeup.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- the core thread ----------------------------------------------------

    def _run(self) -> None:
        core = self.core
        try:
            while not self._stopping:
                self._drain_commands()
                if core.has_work():
                    outputs = core.step()
                    # Snapshot first: a client that saw an output finds it counted.
                    with self._lock:
                        self._stats = core.stats()
                    self._deliver(outputs)
                    if not outputs and core.last_num_scheduled == 0:
                        self._wakeup.wait(_POLL_WAIT_S)
                        self._wakeup.clear()
                else:
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
            reason = "the engine is shut down"
        except Exception as exc:
            logger.exception("engine loop stopped")
            reason = f"engine loop stopped: {exc}"
        with self._lock:
            self._dead = reason
            self._stats = core.stats()
            sinks, self._sinks = self._sinks, {}
            self._groups = RequestGroups()
        for request_id, sink in sinks.items():
            output = RequestOutput(
                request_id=request_id, finished=True, finish_reason="error", error=reason
            )
            _post(sink.loop, [(sink.queue, output)])

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and isinstance(payload, tuple):
                request_id, inputs, params = payload
                try:
                    self.core.add_request(request_id, inputs, params)
                except Exception as exc:
                    failed = RequestOutput(
                        request_id=request_id,
                        finished=True,
                        finish_reason="error",
                        error=f"request could not be added: {exc}",
                    )
                    self._deliver([failed])
            elif isinstance(payload, str):
                self.core.abort(payload)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Post outputs to their streams: one wake-up per client loop and step."""
        batches: dict[asyncio.AbstractEventLoop, _Deliveries] = {}
        with self._lock:
            for output in outputs:
                sink = self._sinks.get(output.request_id)
                if sink is None:
                    continue
                if output.finished:
                    del self._sinks[output.request_id]
                    self._groups.discard(output.request_id)
                batches.setdefault(sink.loop, []).append((sink.queue, output))
        for loop, items in batches.items():
            _post(loop, items)


def _post(loop: asyncio.AbstractEventLoop, items: _Deliveries) -> None:
    """Hand outputs to their streams on ``loop`` (from any thread)."""
    with contextlib.suppress(RuntimeError):
        # The client loop may already be closed; its requests are gone with it.
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: _Deliveries) -> None:
    for q, output in items:
        q.put_nowait(output)
