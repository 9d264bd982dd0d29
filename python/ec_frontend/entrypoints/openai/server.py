"""The OpenAI-compatible FastAPI app.

Bodies are read raw (bounded by ``max_body_bytes``, checked on
``Content-Length`` and again while streaming in, and by ``body_timeout_s``; a
refused body is not read further: the connection closes) and parsed by
``ec_frontend._core.parse_request``; the request's resource limits
(:mod:`~ec_frontend.entrypoints.openai.limits`) are checked before its inputs are
processed. A client gone mid-upload is a 499. Pydantic models exist only to
describe the API on ``/docs``. Responses are serialized with orjson. Every error, whatever
raised it, is rendered by :func:`~ec_frontend.entrypoints.http.errors.error_response`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from ec_frontend._core import Limits, ParsedRequest, RequestError, parse_request
from ec_frontend.config import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from ec_frontend.engine.stats import FIELD_HELP
from ec_frontend.entrypoints.http.errors import (
    APIError,
    engine_failure,
    error_body,
    error_response,
    to_api_error,
)
from ec_frontend.entrypoints.http.middleware import (
    FrontMiddleware,
    FrontState,
    valid_request_id,
)
from ec_frontend.entrypoints.openai import openapi_docs, vllm_routes
from ec_frontend.entrypoints.openai.chat_format import (
    chat_body,
    chat_stream,
    completion_body,
    completion_stream,
)
from ec_frontend.entrypoints.openai.context import DONE, RequestContext
from ec_frontend.entrypoints.openai.generate_api import generate_body, generate_stream
from ec_frontend.entrypoints.openai.jobs import Choice, Job, usage
from ec_frontend.entrypoints.openai.limits import ResourceLimits
from ec_frontend.entrypoints.openai.responses_api import response_body, response_stream
from ec_frontend.entrypoints.openai.sampling import MAX_LOGPROBS
from ec_frontend.entrypoints.openai.serving import Serving, ServingConfig
from ec_frontend.media import FetchMetrics, MediaFetchConfig, MediaFetcher
from ec_frontend.metrics import ServerMetrics, exposition, render
from ec_frontend.vllm_metrics import render_engine_stats as render_vllm_engine_stats

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from ec_frontend.engine.client import EngineClient

T = TypeVar("T")
log = logging.getLogger("ec_frontend.server")

#: Bodies above this size are parsed in a worker thread (the parser releases the GIL).
_THREAD_PARSE_BYTES = 256 * 1024
_JSON = "application/json"
#: Sent with errors after which the rest of the request body is not read.
_CLOSE = {"connection": "close"}
#: A non-stream request watches for its client's disconnect after this long.
_WATCH_AFTER_S = 0.05


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-level settings of one server."""

    model_names: tuple[str, ...]
    max_model_len: int
    model_id: str = ""
    api_key: str | None = None
    max_body_bytes: int = 64 * 1024 * 1024
    max_in_flight: int = 4096
    offload_processing: bool = True
    vocab_size: int | None = None
    drain_timeout_s: float = 30.0
    #: The whole body must arrive within this many seconds of the headers (else 408).
    body_timeout_s: float = 60.0
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    #: ``/metrics`` answers without the API key.
    public_metrics: bool = False
    #: ``/docs``, ``/redoc`` and ``/openapi.json`` answer without the API key.
    public_docs: bool = False
    #: ``--enable-auto-tool-choice`` / ``--tool-call-parser``.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    #: ``--structured-outputs-compile-timeout`` / ``--structured-outputs-max-grammar-bytes``.
    grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    grammar_max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    #: Media by URL (``--allowed-media-domains`` ...); ``None``: URL items are refused.
    media: MediaFetchConfig | None = field(default_factory=MediaFetchConfig)
    #: ``--max-logprobs``.
    max_logprobs: int = MAX_LOGPROBS
    #: One access line per request; request bodies (``--enable-log-requests``).
    access_log: bool = True
    log_requests: bool = False
    max_log_len: int | None = None


def _status_of(exc: BaseException) -> BaseException:
    if isinstance(exc, StarletteHTTPException):
        if exc.status_code == 404:
            return APIError(404, "no such route", code="route_not_found")
        if exc.status_code == 405:
            return APIError(
                405,
                "method not allowed on this route",
                code="method_not_allowed",
                headers=dict(exc.headers or {}),
            )
        return APIError(exc.status_code, str(exc.detail), code="http_error")
    if isinstance(exc, APIError | RequestError):
        return exc
    if isinstance(exc, ClientDisconnect):
        log.debug("client disconnected before its request body was read")
        return APIError(499, "client disconnected", code="client_disconnected")
    engine_mod = sys.modules.get("ec_frontend.engine.async_engine")
    if engine_mod is not None and isinstance(exc, engine_mod.EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
    log.error("unhandled error", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


def handle_error(exc: Exception) -> Response:
    """The one place where an exception becomes an HTTP error response."""
    return error_response(_status_of(exc))


class App:
    """Holds the engine, the serving core and the server state behind the routes."""

    def __init__(self, engine: EngineClient[Any], config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics()
        self.state = FrontState(
            self.metrics,
            config.api_key,
            config.max_in_flight,
            public_metrics=config.public_metrics,
            public_docs=config.public_docs,
            access_log=config.access_log,
            log_requests=config.log_requests,
            max_log_len=config.max_log_len,
        )
        limits = config.limits
        self.limits = Limits(
            max_body_bytes=config.max_body_bytes, max_media_items=limits.max_media_items
        )
        fetcher = None
        if config.media is not None and config.media.enabled:
            fetch_metrics = FetchMetrics()
            self.metrics.extra.append(fetch_metrics)
            fetcher = MediaFetcher(config.media, metrics=fetch_metrics)
        self.serving = Serving(
            engine,
            ServingConfig(
                model_names=config.model_names,
                max_model_len=config.max_model_len,
                offload_processing=config.offload_processing,
                vocab_size=config.vocab_size,
                limits=limits,
                enable_auto_tool_choice=config.enable_auto_tool_choice,
                tool_call_parser=config.tool_call_parser,
                grammar_compile_timeout_s=config.grammar_compile_timeout_s,
                grammar_max_bytes=config.grammar_max_bytes,
                model_id=config.model_id,
                max_logprobs=config.max_logprobs,
            ),
            self.metrics,
            fetcher,
        )
        processor = engine.processor
        if hasattr(processor, "configure_media"):
            processor.configure_media(
                max_image_pixels=limits.max_image_pixels,
                formats=limits.image_formats,
                max_processor_pixels=limits.max_processor_pixels,
                video_limits=limits.video,
                video_cache_bytes=limits.video_cache_bytes,
                max_item_rows=_encoder_cache_rows(engine),
            )
        self.tokenizer = getattr(processor, "tokenizer", None)
        self.created = int(time.time())

    # ---------------------------------------------------------------- input

    async def read_body(self, request: Request) -> bytes:
        ctype = request.headers.get("content-type")
        if ctype is not None:
            media = ctype.split(";", 1)[0].strip().lower()
            if media != _JSON and not media.endswith("+json"):
                raise APIError(
                    415,
                    f"Content-Type must be application/json, not {media or 'empty'}",
                    code="unsupported_media_type",
                )
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, "invalid Content-Length header", code="invalid_header")
            if int(length) > limit:
                raise APIError(
                    413,
                    f"request body of {length} bytes exceeds the limit of {limit} bytes",
                    code="request_too_large",
                    headers=_CLOSE,
                )
        chunks: list[bytes] = []
        size = 0
        timeout = self.config.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(
                            413,
                            f"request body exceeds the limit of {limit} bytes",
                            code="request_too_large",
                            headers=_CLOSE,
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                code="body_timeout",
                headers=_CLOSE,
            ) from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def parse(
        self, request: Request, endpoint: str
    ) -> tuple[RequestContext, ParsedRequest, bytes]:
        body = await self.read_body(request)
        if len(body) > _THREAD_PARSE_BYTES:
            parsed = await asyncio.to_thread(
                parse_request, endpoint, body, model_id=self.config.model_id, limits=self.limits
            )
        else:
            parsed = parse_request(
                endpoint, body, model_id=self.config.model_id, limits=self.limits
            )
        model = self.serving.check_model(parsed.model)
        ctx = RequestContext(request.scope["ec_request_id"], model, tokenizer=self.tokenizer)
        return ctx, parsed, body

    # ---------------------------------------------------------------- output

    @staticmethod
    def json(body: bytes, status: int = 200) -> Response:
        return Response(body, status_code=status, media_type=_JSON)

    def sse(self, gen: AsyncGenerator[bytes, None], jobs: list[Job]) -> EventStream:
        """A stream of ``gen``; the ids of ``jobs`` are released even if it never starts."""
        return EventStream(_guarded(gen), BackgroundTask(self._release, jobs))

    async def _release(self, jobs: list[Job]) -> None:
        # A coroutine: Starlette runs a plain function's background task on a worker
        # thread, a thread hand-off (and GIL switches) for every stream.
        self.serving.release(jobs)

    async def until_disconnect(self, request: Request, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro``; cancel it (aborting its engine requests) if the client leaves.

        The disconnect watcher starts only once the request has run for
        ``_WATCH_AFTER_S``: short requests pay for a timer, not a task.
        """
        task = asyncio.current_task()
        watch = _DisconnectWatch(request.receive, task)
        handle = asyncio.get_running_loop().call_later(_WATCH_AFTER_S, watch.arm)
        try:
            return await coro
        except asyncio.CancelledError:
            if not watch.gone or task is None:
                raise
            if hasattr(task, "uncancel"):  # Python 3.11+: undo our own cancel request
                task.uncancel()
            raise APIError(499, "client disconnected", code="client_disconnected") from None
        finally:
            handle.cancel()
            watch.disarm()

    @staticmethod
    def check_choices(choices: list[Choice]) -> None:
        for c in choices:
            if c.error is not None:
                raise engine_failure(c.error)
            if c.finish_reason == "abort":
                raise APIError(503, "the request was aborted", code="aborted")

    # --------------------------------------------------------------- routes

    async def chat(self, request: Request) -> Response:
        ctx, parsed, _ = await self.parse(request, "chat")
        jobs = await self.serving.make_jobs(parsed, ctx.request_id, _client(request))
        ids = f"chatcmpl-{ctx.request_id}"
        if parsed.stream:
            return self.sse(chat_stream(self.serving, ctx, parsed, jobs, ids), jobs)
        choices = await self.until_disconnect(request, self.serving.collect(jobs, ctx.started))
        self.check_choices(choices)
        return self.json(chat_body(ctx, choices, usage(choices), ids, parsed.return_token_ids))

    async def completions(self, request: Request) -> Response:
        ctx, parsed, _ = await self.parse(request, "completions")
        jobs = await self.serving.make_jobs(parsed, ctx.request_id, _client(request))
        ids = f"cmpl-{ctx.request_id}"
        if parsed.stream:
            return self.sse(completion_stream(self.serving, ctx, parsed, jobs, ids), jobs)
        choices = await self.until_disconnect(request, self.serving.collect(jobs, ctx.started))
        self.check_choices(choices)
        totals = usage(choices)
        body = completion_body(ctx, choices, totals, ids, parsed.echo, parsed.return_token_ids)
        return self.json(body)

    async def responses(self, request: Request) -> Response:
        ctx, parsed, _ = await self.parse(request, "responses")
        jobs = await self.serving.make_jobs(parsed, ctx.request_id, _client(request))
        resp_id = f"resp_{ctx.request_id}"
        if parsed.stream:
            return self.sse(response_stream(self.serving, ctx, parsed, jobs, resp_id), jobs)
        choices = await self.until_disconnect(request, self.serving.collect(jobs, ctx.started))
        self.check_choices(choices)
        return self.json(response_body(self.serving, ctx, parsed, choices[0], resp_id))

    async def generate(self, request: Request) -> Response:
        ctx, parsed, body = await self.parse(request, "generate")
        if parsed.n != 1:
            raise APIError(
                400,
                "n > 1 is not supported by /inference/v1/generate",
                param="sampling_params.n",
                code="invalid_value",
            )
        if parsed.output_mode == "text" and await _offloop_if_large(_detokenize_off, parsed, body):
            raise APIError(
                400,
                "output_mode='text' requires sampling_params.detokenize to be true",
                param="output_mode",
                code="invalid_value",
            )
        if parsed.request_id is not None and not valid_request_id(parsed.request_id):
            # Never echoed: it would reach logs and response bodies as sent.
            raise APIError(
                400,
                "request_id must be 1 to 256 visible ASCII characters (no spaces or "
                "control characters), as X-Request-Id",
                param="request_id",
                code="invalid_value",
            )
        rid = parsed.request_id or ctx.request_id
        jobs = await self.serving.make_jobs(parsed, rid, _client(request))
        if parsed.stream:
            return self.sse(generate_stream(self.serving, ctx, parsed, jobs, rid), jobs)
        choices = await self.until_disconnect(request, self.serving.collect(jobs, ctx.started))
        self.check_choices(choices)
        return self.json(generate_body(ctx, parsed, choices[0], rid))

    async def models(self, request: Request) -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "ec-frontend",
                "root": self.config.model_id or name,
                "parent": None,
                "max_model_len": self.config.max_model_len,
            }
            for name in self.config.model_names
        ]
        return self.json(orjson.dumps({"object": "list", "data": data}))

    async def health(self, request: Request) -> Response:
        if not self.engine.is_running:
            raise APIError(503, "the engine has stopped", code="engine_dead")
        return self.json(b'{"status":"ok"}')

    async def metrics_route(self, request: Request) -> Response:
        stats = self.engine.stats()
        text = render(self.metrics, stats, FIELD_HELP)
        text += exposition(render_vllm_engine_stats(stats, self.config.model_names[0]))
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _client(request: Request) -> str:
    """Who is asking, as far as this server can tell: the peer's address (one API key
    is one principal, so the key tells callers apart no better)."""
    peer = request.client
    return peer.host if peer is not None and peer.host else "unknown"


def _encoder_cache_rows(engine: Any) -> int | None:
    """The rows of the engine's encoder cache (``--encoder-cache-size``, resolved with
    the engine's config before it starts); ``None`` for an engine without one."""
    cache = getattr(getattr(engine, "config", None), "cache", None)
    rows = getattr(cache, "encoder_cache_size", None)
    return rows if isinstance(rows, int) else None


async def _guarded(gen: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """A stream that ends with an error event and ``[DONE]`` instead of breaking off.

    Closing it closes ``gen`` at once (and so aborts its engine requests): a generator
    closed at its ``yield`` does not close the one it was iterating.
    """
    async with aclosing(gen):
        try:
            async for chunk in gen:
                yield chunk
        except Exception as exc:
            err = to_api_error(_status_of(exc))
            yield b"data: " + error_body(err.status, err.message, err.param, err.code) + b"\n\n"
            yield DONE


async def _offloop_if_large(fn: Callable[[ParsedRequest, bytes], T], parsed: ParsedRequest,
                            body: bytes) -> T:  # fmt: skip
    """``fn(parsed, body)``, in a worker thread when ``body`` is large (its JSON is
    parsed there, which holds the thread for as long as the body takes)."""
    if len(body) > _THREAD_PARSE_BYTES:
        return await asyncio.to_thread(fn, parsed, body)
    return fn(parsed, body)


def _detokenize_off(parsed: ParsedRequest, body: bytes) -> bool:
    """Generate: ``sampling_params.detokenize: false`` (vLLM's default is true).

    The parser lists the field as unknown; only then is its value read from the body.
    """
    if "sampling_params.detokenize" not in parsed.unknown_fields:
        return False
    return orjson.loads(body).get("sampling_params", {}).get("detokenize") in (False, 0, "false")


class EventStream(Response):
    """A ``text/event-stream`` response: one ASGI body message per chunk of ``chunks``.
    A chunk that ends with ``data: [DONE]`` ends the body in the same message (one
    write for the last events and the end of the chunked body).

    A client that disconnects cancels the stream (its generator is closed, which
    aborts its engine requests), as Starlette's ``StreamingResponse`` does, with one
    plain task per stream instead of an anyio task group. ``background`` runs after
    the stream, whether it ended or was cancelled.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[bytes, None], background: BackgroundTask) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background = background
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        watch = _DisconnectWatch(receive, task)
        watch.arm()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            last = b""
            async for chunk in self.chunks:
                if chunk.endswith(DONE):
                    last = chunk
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watch.disarm()
            await send({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            if not watch.gone or task is None:
                raise
            if hasattr(task, "uncancel"):  # Python 3.11+: undo our own cancel request
                task.uncancel()
        finally:
            watch.disarm()
            await self.chunks.aclose()
            if self.background is not None:
                await self.background()


class _DisconnectWatch:
    """Cancels ``task`` when the client behind ``receive`` disconnects (once armed)."""

    __slots__ = ("gone", "receive", "task", "watcher")

    def __init__(self, receive: Receive, task: asyncio.Task[Any] | None) -> None:
        self.receive = receive
        self.task = task
        self.gone = False
        self.watcher: asyncio.Task[None] | None = None

    def arm(self) -> None:
        self.watcher = asyncio.ensure_future(self._watch())

    def disarm(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                break
        self.gone = True
        if self.task is not None:
            self.task.cancel()


async def _handle_error(request: Request, exc: Exception) -> Response:
    return handle_error(exc)


def build_app(engine: EngineClient[Any], config: ServerConfig) -> tuple[FrontMiddleware, App]:
    """The ASGI app (middleware around FastAPI) and the :class:`App` behind it."""
    core = App(engine, config)
    api = FastAPI(
        title="ec-frontend",
        summary="OpenAI-compatible serving for vision-language models (E/P/D disaggregation)",
        version="0.1.0",
        docs_url=None,
        redoc_url=None,
        exception_handlers={
            Exception: _handle_error,
            StarletteHTTPException: _handle_error,
            APIError: _handle_error,
            RequestError: _handle_error,
        },
    )
    post = [
        ("/v1/chat/completions", core.chat, "chat"),
        ("/v1/completions", core.completions, "completions"),
        ("/v1/responses", core.responses, "responses"),
        ("/inference/v1/generate", core.generate, "generate"),
    ]
    for path, handler, kind in post:
        api.add_api_route(path, handler, methods=["POST"], **openapi_docs.route_docs(kind))
    api.add_api_route(
        "/v1/models", core.models, methods=["GET"], **openapi_docs.route_docs("models")
    )
    api.add_api_route("/health", core.health, methods=["GET"], **openapi_docs.route_docs("health"))
    api.add_api_route(
        "/metrics", core.metrics_route, methods=["GET"], **openapi_docs.route_docs("metrics")
    )
    vllm_routes.register(api, core)
    openapi_docs.install(api)
    # The generation routes are also dispatched directly by the middleware (same
    # handlers, same error handler), skipping the framework's per-request layers.
    fast = {path: handler for path, handler, _ in post}
    return FrontMiddleware(api, core.state, fast, handle_error), core
