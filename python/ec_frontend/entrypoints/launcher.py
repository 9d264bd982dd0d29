"""Build the engine and the app from :class:`ServeOptions`, run uvicorn, drain on SIGTERM.

Drain (first SIGTERM or SIGINT): the server keeps its socket open but answers
503 to every new request (``/metrics`` excepted) and lets the generation
requests in flight finish. Shortly before ``drain_timeout_s`` it aborts the
engine requests still running (they end their responses), then closes the
connections of requests still open (a client still sending its body sees its
connection closed; the server counts a 499), stops uvicorn and the engine and
returns 0: within ``drain_timeout_s`` whatever clients do (a timeout under a
second may overrun by the half second aborted requests get to finish). A
second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from ec_frontend import logs
from ec_frontend.config import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_GRAMMAR_BYTES,
    TRANSFER_SECRET_ENV,
)
from ec_frontend.engine.core_proc import EngineProcess
from ec_frontend.engine.summary import engine_summary, summary_lines
from ec_frontend.entrypoints.http.cli_args import FrontendSettings
from ec_frontend.entrypoints.http.protocol import HttpLimits, connection_cap, uvicorn_http_settings
from ec_frontend.entrypoints.http.stats_log import StatsLog
from ec_frontend.entrypoints.openai.limits import ResourceLimits
from ec_frontend.entrypoints.openai.sampling import MAX_LOGPROBS
from ec_frontend.entrypoints.openai.server import App, ServerConfig, build_app
from ec_frontend.errors import StartupError

if TYPE_CHECKING:
    from ec_frontend.engine.client import EngineClient
from ec_frontend.media import MediaFetchConfig

log = logging.getLogger("ec_frontend.server")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Everything ``ec-frontend serve`` was asked for."""

    model: str | None = None
    #: With a Hugging Face id: the branch, tag or commit (``--revision``).
    revision: str | None = None
    #: Seeds the engine's random state at startup (``--seed``).
    seed: int = 0
    max_logprobs: int = MAX_LOGPROBS
    #: A Jinja chat template in place of the checkpoint's (``--chat-template``).
    chat_template: str | None = None
    #: CORS, root path, TLS and uvicorn's log level.
    frontend: FrontendSettings = field(default_factory=FrontendSettings)
    #: The periodic stats line (``--disable-log-stats`` turns it off).
    log_stats: bool = True
    #: Log request bodies (``--enable-log-requests``), up to ``max_log_len`` characters.
    log_requests: bool = False
    max_log_len: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    #: KV cache sizing (see ``engine.config.CacheConfig``).
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    block_size: int = 16
    encoder_cache_size: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    device: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    attention_backend: str = "auto"
    cpu_threads: int | None = None
    ec_transfer_config: str | None = None
    kv_transfer_config: str | None = None
    transfer_secret: str | None = None
    transfer_secret_file: str | None = None
    transfer_peers: str | None = None
    max_body_bytes: int = 64 * 1024 * 1024
    log_level: str = "info"
    mock_engine: bool = False
    mock_token_latency_s: float = 0.0
    #: ``multiprocess``: the engine core in its own process (``engine/core_proc.py``);
    #: ``inprocess``: in a thread of the server process.
    engine_mode: str = "multiprocess"
    access_log: bool = True
    drain_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    #: ``max_connections`` 0: derived from the open-file limit (:func:`connection_cap`).
    http: HttpLimits = field(default_factory=lambda: HttpLimits(max_connections=0))
    #: ``None``: derived from the engine's ``max_num_seqs`` (:func:`engine_request_limit`).
    max_engine_requests: int | None = None
    public_metrics: bool = False
    public_docs: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    #: Structured outputs' budget: seconds to validate (server) or build (engine) one
    #: grammar, and bytes of one compiled grammar.
    structured_outputs_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    structured_outputs_max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    #: API server (frontend) processes sharing the listening socket
    #: (``entrypoints/api_servers.py``); 1 serves from this process.
    api_server_count: int = 1
    #: Media by URL (``docs/security.md``, "Media by URL"); ``None``: URLs are refused.
    media: MediaFetchConfig | None = field(default_factory=MediaFetchConfig)


def mock_config(opts: ServeOptions) -> Any:
    """The ``MockEngineConfig`` of ``--mock-engine`` with these options."""
    from ec_frontend.engine.mock import MockEngineConfig

    return MockEngineConfig(
        model=opts.model or "mock",
        max_model_len=opts.max_model_len or 4096,
        max_num_seqs=opts.max_num_seqs or 256,
        token_latency_s=opts.mock_token_latency_s,
    )


def build_engine(
    opts: ServeOptions, spawned: EngineProcess | None = None
) -> tuple[EngineClient[Any], str, int]:
    """``(engine, model_id, max_model_len)`` for the options; ``spawned``: the engine
    interpreter :func:`serve` started ahead for the multiprocess engine."""
    if opts.mock_engine:
        from ec_frontend.engine.mock import MockEngine, MockInputs

        cfg = mock_config(opts)
        max_len = cfg.max_model_len
        if opts.engine_mode == "multiprocess":
            from ec_frontend.engine.mp_client import MPEngineClient

            client: EngineClient[Any] = MPEngineClient.start(cfg, kind="mock", spawned=spawned)
            return client, cfg.model, max_len
        engine: EngineClient[MockInputs] = MockEngine(cfg)
        return engine, cfg.model, max_len
    from ec_frontend.engine.builder import create_engine

    return create_engine(opts, spawned)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful drain in place of its immediate shutdown."""

    def __init__(self, config: uvicorn.Config, core: App, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.core = core
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        #: The periodic stats line (``None``: ``--disable-log-stats``).
        self.stats_log: StatsLog | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        ticker = None
        if self.stats_log is not None:
            ticker = asyncio.ensure_future(self.stats_log.run())
        try:
            await super().serve(sockets)
        finally:
            if ticker is not None:
                ticker.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.core.state.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self.core.state.draining
            return
        self.core.state.draining = True
        log.info("received signal %d: draining", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _wait_idle(self, until: float) -> None:
        while self.core.metrics.in_flight > 0 and time.monotonic() < until:
            await asyncio.sleep(0.05)

    async def _drain(self) -> None:
        timeout = self.drain_timeout_s
        end = time.monotonic() + timeout
        # The last part of the timeout is kept for aborting, closing and stopping.
        reserve = min(3.0, timeout / 3)
        await self._wait_idle(end - reserve)
        if self.core.metrics.in_flight > 0:
            ids = self.core.serving.active_ids()
            log.info("drain timeout: aborting %d engine requests", len(ids))
            for rid in ids:
                await self.core.engine.abort(rid)
            if ids:  # let aborted requests send their last chunk
                await self._wait_idle(max(end - reserve / 2, time.monotonic() + 0.5))
        if self.core.metrics.in_flight > 0:
            open_ = list(self.server_state.connections)
            log.info("drain timeout: closing %d connections", len(open_))
            for conn in open_:
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.close()
            await self._wait_idle(time.monotonic() + 0.25)
        log.info("drained; shutting down")
        self.should_exit = True


EngineFactory = Callable[[ServeOptions], tuple["EngineClient[Any]", str, int]]


@dataclass
class BuiltApp:
    """What :func:`build_server_app` gives: the ASGI app (wrapped), its core, the
    engine client and the served names."""

    app: Any
    core: App
    engine: EngineClient[Any]
    names: tuple[str, ...]


def build_server_app(
    opts: ServeOptions,
    *,
    engine_factory: EngineFactory | None = None,
    wrap_app: Callable[[Any], Any] | None = None,
) -> BuiltApp:
    """The engine and the ASGI app for ``opts``, without an HTTP server; raises
    :class:`StartupError` (or ``ValueError``, ``OSError``...) when the engine cannot
    start. :func:`serve` runs it under uvicorn; ``benches/bench_http_servers.py``
    under another ASGI server."""
    spawned = None
    if engine_factory is None and opts.engine_mode == "multiprocess":
        # The engine's interpreter imports torch and the model code while this one
        # does the same for its input processing (about half the startup, measured).
        spawned = EngineProcess.spawn("mock" if opts.mock_engine else "real")
    try:
        if engine_factory is None:
            engine, model_id, max_len = build_engine(opts, spawned)
        else:
            engine, model_id, max_len = engine_factory(opts)
    finally:
        if spawned is not None and not spawned.was_sent:
            spawned.kill()
    names = opts.served_model_names or ((opts.model or model_id),)
    processor = getattr(engine, "processor", None)
    tokenizer = getattr(processor, "tokenizer", None)
    if opts.chat_template is not None and tokenizer is not None:
        tokenizer.chat_template = opts.chat_template
    seqs = engine_max_num_seqs(engine, opts)
    engine_requests = engine_request_limit(opts, seqs)
    limits = replace(opts.limits, max_engine_requests=engine_requests)
    config = ServerConfig(
        model_names=names,
        max_model_len=max_len,
        model_id=model_id,
        api_key=opts.api_key,
        max_body_bytes=opts.max_body_bytes,
        max_in_flight=max(64, 16 * seqs),
        offload_processing=not opts.mock_engine,
        vocab_size=getattr(processor, "vocab_size", None),
        drain_timeout_s=opts.drain_timeout_s,
        body_timeout_s=opts.body_timeout_s,
        limits=limits,
        public_metrics=opts.public_metrics,
        public_docs=opts.public_docs,
        enable_auto_tool_choice=opts.enable_auto_tool_choice,
        tool_call_parser=opts.tool_call_parser,
        grammar_compile_timeout_s=opts.structured_outputs_compile_timeout,
        grammar_max_bytes=opts.structured_outputs_max_grammar_bytes,
        media=opts.media,
        max_logprobs=opts.max_logprobs,
        access_log=opts.access_log,
        log_requests=opts.log_requests,
        max_log_len=opts.max_log_len,
    )
    app, core = build_app(engine, config)
    app = opts.frontend.wrap(app)
    if wrap_app is not None:
        app = wrap_app(app)
    return BuiltApp(app, core, engine, names)


def serve(
    opts: ServeOptions,
    *,
    engine_factory: EngineFactory | None = None,
    sockets: list[socket.socket] | None = None,
    wrap_app: Callable[[Any], Any] | None = None,
) -> int:
    """Run one API server until drained; the process exit code.

    With ``api_server_count`` > 1 the command line runs a group of API server
    processes instead (``entrypoints/api_servers.py``); each of them calls this
    with its engine factory, the listening socket it inherited and a wrapper
    around the app.
    """
    try:
        built = build_server_app(opts, engine_factory=engine_factory, wrap_app=wrap_app)
    except (StartupError, ValueError, OSError, RuntimeError, ImportError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    engine, core = built.engine, built.core
    http = replace(opts.http, max_connections=connection_cap(opts.http.max_connections))
    uv_level = opts.frontend.uvicorn_log_level or opts.log_level
    uv_config = uvicorn.Config(
        built.app,
        host=opts.host,
        port=opts.port,
        log_level=uv_level,
        log_config=logs.uvicorn_log_config(uv_level),
        access_log=False,
        **opts.frontend.uvicorn_kwargs(),
        loop=_pick("uvloop", "asyncio"),
        **uvicorn_http_settings(http, core.metrics.refused),
        lifespan="off",
        server_header=False,
    )
    server = DrainingServer(uv_config, core, opts.drain_timeout_s)
    if opts.log_stats:
        server.stats_log = StatsLog(engine.stats, logs.stats_interval())
    died: list[str] = []
    watch = getattr(engine, "add_death_callback", None)
    if watch is not None:
        watch(lambda reason: _engine_died(server, died, reason))
    for line in startup_summary(engine, opts, built.names):
        log.info("%s", line)
    try:
        server.run(sockets=sockets)
    finally:
        core.serving.shutdown()
        engine.shutdown()
    if not server.started or died:
        return 1
    return 0


#: Engine requests admitted per sequence slot of the engine by default: the running
#: batch and fifteen more waiting. Past that a client waits more than fifteen batches
#: for its first token, and a 429 it can retry elsewhere serves it better.
ENGINE_REQUESTS_PER_SEQ = 16
#: The smallest default ``--max-engine-requests`` (one full ``--max-fanout`` request).
MIN_ENGINE_REQUESTS = 256


def engine_max_num_seqs(engine: Any, opts: ServeOptions) -> int:
    """The engine's batch size: ``--max-num-seqs``, else what the engine was built with
    (the real engine's ``SchedulerConfig`` default of 64, the mock's 256)."""
    if opts.max_num_seqs:
        return opts.max_num_seqs
    config = getattr(engine, "config", None)
    for holder in (getattr(config, "scheduler", None), config):
        value = getattr(holder, "max_num_seqs", None)
        if isinstance(value, int) and value > 0:
            return value
    from ec_frontend.config import SchedulerConfig

    return SchedulerConfig.max_num_seqs


def engine_request_limit(opts: ServeOptions, max_num_seqs: int) -> int:
    """This API server's ``--max-engine-requests``.

    The flag, else ``ENGINE_REQUESTS_PER_SEQ`` x the engine's ``max_num_seqs`` (at least
    ``MIN_ENGINE_REQUESTS``): 1,024 for the real engine's default of 64 sequences. The
    limit is the engine's: with ``--api-server-count N`` each server admits its share
    (the limit // N, at least 1), so the group never sends the engine more.
    """
    total = opts.max_engine_requests or max(
        MIN_ENGINE_REQUESTS, ENGINE_REQUESTS_PER_SEQ * max_num_seqs
    )
    return max(1, total // max(1, opts.api_server_count))


#: After the engine died: time for the failed streams to send their error events.
_DEATH_GRACE_S = 0.25


def _engine_died(server: uvicorn.Server, died: list[str], reason: str) -> None:
    """The engine process is gone (called from the engine client's thread, after its
    requests failed): stop serving and exit non-zero, so that a supervisor restarts."""
    died.append(reason)
    log.error("%s: the server exits", reason)
    time.sleep(_DEATH_GRACE_S)
    server.should_exit = True


def startup_summary(engine: Any, opts: ServeOptions, names: tuple[str, ...]) -> list[str]:
    """The lines that say what this server ended up with (see ``docs/server.md``)."""
    info = getattr(engine, "info", None)
    summary = info.get("summary") if isinstance(info, dict) else None
    if summary is None and getattr(engine, "core", None) is not None:
        summary = engine_summary(engine.core)
    lines = summary_lines(summary) if summary else ["engine: mock (no model)"]
    secret = bool(
        opts.transfer_secret or opts.transfer_secret_file or os.environ.get(TRANSFER_SECRET_ENV)
    )
    on = {True: "on", False: "off"}
    lines.append(
        f"serving {', '.join(names)} on {opts.frontend.scheme}://{opts.host}:{opts.port}: "
        f"API key {on[opts.api_key is not None]}, transfer secret {on[secret]}, "
        f"access log {on[opts.access_log]}, stats log {on[opts.log_stats]}"
    )
    return lines


def _pick(preferred: str, fallback: str) -> str:
    try:
        __import__(preferred)
    except ImportError:
        return fallback
    return preferred


__all__ = [
    "ServeOptions",
    "StartupError",
    "build_engine",
    "serve",
]
