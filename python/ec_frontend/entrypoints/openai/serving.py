"""From a parsed request to engine requests and back: the endpoint-independent core.

:class:`Serving` turns a :class:`~ec_frontend._core.ParsedRequest` into one
:class:`Job` per engine request (``n`` per prompt), runs them on the engine and
accumulates each one's deltas into a :class:`Choice`. The endpoint modules only
format. Invariants:

* every engine request that did not finish is aborted when its consumer goes
  away (client disconnect, drain, error), so the engine frees what it held;
* engine request ids are unique among the requests in flight, whatever the
  client sent as ``X-Request-Id``;
* problems caused by the request (too long a prompt, an undecodable image)
  raise :class:`~ec_frontend.entrypoints.http.errors.APIError` 400 before the
  engine sees anything; the resource bounds of :mod:`~ec_frontend.entrypoints.openai.limits`
  are checked before any input is decoded or tokenized;
* input processing runs in a bounded pool (429 with ``Retry-After`` when full),
  and the engine requests in flight are bounded (429): a request reserves its
  whole fan-out before it awaits anything, so concurrent arrivals are counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from ec_frontend._core import ParsedRequest
from ec_frontend.config import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from ec_frontend.connectors.ec_item_params import ec_items_problem
from ec_frontend.connectors.kv_transfer_params import stamp_hold_client
from ec_frontend.entrypoints.http.errors import APIError
from ec_frontend.entrypoints.openai.jobs import Choice, Job, Timing, new_id
from ec_frontend.entrypoints.openai.limits import (
    ProcessingPool,
    ResourceLimits,
    check_fanout,
    check_media,
    check_prompt_text,
    text_too_long,
    too_busy,
)
from ec_frontend.entrypoints.openai.sampling import (
    MAX_LOGPROBS,
    bad_words_token_ids,
    build_sampling_params,
)
from ec_frontend.entrypoints.openai.structured import StructuredCompiler
from ec_frontend.media import MediaError, MediaFetcher, resolve_items
from ec_frontend.metrics import ServerMetrics
from ec_frontend.vllm_metrics import VLLMRequestMetrics

if TYPE_CHECKING:
    from ec_frontend.engine.client import EngineClient, OutputStream

T = TypeVar("T")

#: Seconds an aborted engine request id stays reserved.
_ABORTED_ID_HOLD_S = 5.0


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """What the serving core needs to know about the deployment."""

    model_names: tuple[str, ...]
    max_model_len: int
    #: Run input processing (tokenizer, image processor) in a worker thread.
    offload_processing: bool = True
    vocab_size: int | None = None
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    #: ``--enable-auto-tool-choice``: ``tool_choice: auto`` parses tool calls out of
    #: the output with ``tool_call_parser``.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    #: A request's grammar: seconds to validate it, bytes it may have.
    grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    grammar_max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    #: Enters the content key of a fetched media item (as the parser's ``model_id``).
    model_id: str = ""
    #: ``--max-logprobs``.
    max_logprobs: int = MAX_LOGPROBS


#: The request field that an input error with this code is about.
_PARAM_OF_CODE = {"invalid_processor_kwargs": "mm_processor_kwargs", "invalid_features": "features"}


class Serving:
    """Runs parsed requests on an engine; shared by all endpoints."""

    def __init__(
        self,
        engine: EngineClient[Any],
        config: ServingConfig,
        metrics: ServerMetrics,
        media_fetcher: MediaFetcher | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        #: The same requests under vLLM's metric names (rendered with ``metrics``).
        self.vllm_metrics = VLLMRequestMetrics(config.model_names[0], config.max_model_len)
        metrics.extra.append(self.vllm_metrics)
        #: Fetches URL media items; ``None``: they are refused.
        self.media_fetcher = media_fetcher
        self._active: set[str] = set()
        #: Engine-request slots reserved by requests being prepared (:meth:`reserve`).
        self._reserved = 0
        self._background: set[asyncio.Task[None]] = set()
        self.structured = StructuredCompiler(
            engine,
            config.vocab_size,
            max_bytes=config.grammar_max_bytes,
            compile_timeout_s=config.grammar_compile_timeout_s,
        )
        if config.offload_processing:
            # A model-backed server: the grammar library and its view of the
            # vocabulary are loaded now, not by the first constrained request (seconds
            # of imports and Python that would hold up every stream's chunks).
            self.structured.prepare()
        limits = config.limits
        #: The bounded pool for client-sized work: input processing (unless
        #: ``offload_processing`` is off, the mock engine's cheap inputs) and the utility
        #: routes' tokenizer work, which always leaves the event loop (:meth:`offload`).
        #: Its threads start on first use.
        self.pool = ProcessingPool(limits.processing_workers, limits.max_processing_queue)

    # ---------------------------------------------------------------- checks

    def check_model(self, model: str | None) -> str:
        """The served name to report; 404 for a model this server does not serve."""
        if model is None or model == "":
            return self.config.model_names[0]
        if model not in self.config.model_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return model

    def _check_media(self, parsed: ParsedRequest) -> None:
        problem = ec_items_problem(parsed.ec_transfer_params, self.config.limits.max_media_items)
        if problem is not None:
            raise APIError(400, problem, param="ec_transfer_params", code="invalid_value")
        for item in parsed.media:
            if item.image_grid_thw is not None or item.video_grid_thw is not None:
                self._check_reference(item)

    async def resolve_media(self, parsed: ParsedRequest) -> Any:
        """The request's media items, URL items fetched (``media/``) and then held to the
        same limits as inline ones (:func:`check_media`); 400 naming the item when one
        cannot be had. The caller has checked the inline items' limits."""
        media = parsed.media
        if all(item.url is None for item in media):
            return media
        if self.media_fetcher is None:
            item = next(item for item in media if item.url is not None)
            raise APIError(
                400,
                "media URLs are not fetched by this server; send the image inline as a "
                "base64 data: URL",
                param=item.param,
                code="unsupported_media_url",
            )
        try:
            resolved = await resolve_items(
                self.media_fetcher,
                media,
                model_id=self.config.model_id,
                processor_kwargs=parsed.mm_processor_kwargs,
                cache_salt=parsed.cache_salt,
                video_options=(parsed.media_io_kwargs or {}).get("video"),
            )
        except MediaError as exc:
            raise APIError(400, exc.message, param=exc.param, code=exc.code) from None
        check_media(resolved, self.config.limits)
        return resolved

    def _check_reference(self, item: Any) -> None:
        """An ``image_embeds`` / ``video_embeds`` reference needs its encoder output from
        an EC connector, or (a decode instance) the prompt's KV from a KV connector."""
        config = getattr(self.engine, "config", None)
        loaders = (getattr(config, "ec_transfer", None), getattr(config, "kv_transfer", None))
        if not any(c is not None and c.is_consumer for c in loaders):
            raise APIError(
                400,
                f"an {item.kind}_embeds reference needs its encoder output from an EC connector "
                "(or its prompt's KV from a KV connector), and this server has neither "
                "(--ec-transfer-config / --kv-transfer-config with a consumer role)",
                param=item.param,
                code="unsupported_media_reference",
            )

    # ------------------------------------------------------------ processing

    def check_input_limits(self, parsed: ParsedRequest) -> int:
        """The request's own resource bounds (fan-out, prompt text, token count, image
        headers), checked before anything is decoded or tokenized; the number of
        engine requests it becomes."""
        limits = self.config.limits
        count = check_fanout(parsed, limits)
        check_prompt_text(parsed, limits, self.config.max_model_len)
        self._check_token_count(parsed)
        check_media(parsed.media, limits)
        return count

    def check_text_chars(self, size: int, param: str) -> None:
        """A text of ``size`` characters that is about to be tokenized (``/tokenize``)."""
        limit = self.config.limits.prompt_chars(self.config.max_model_len)
        if size > limit:
            raise text_too_long(size, limit, param)

    def engine_requests(self) -> int:
        """Engine requests counted against ``--max-engine-requests``: those in flight
        (and aborted ids still reserved) plus the slots that admitted requests have
        reserved and not yet turned into jobs."""
        return len(self._active) + self._reserved

    def reserve(self, parsed: ParsedRequest) -> int:
        """:meth:`check_input_limits`, then reserve room for the request's whole
        fan-out (429 when there is none); the number reserved.

        Check and reservation happen without an await in between, so requests that
        arrive together cannot all pass the check before any of them is counted. The
        caller gives the slots back with :meth:`unreserve` on every path, once its jobs'
        ids are counted in ``_active`` (or it failed)."""
        limits = self.config.limits
        count = self.check_input_limits(parsed)
        held = self.engine_requests()
        if held + count > limits.max_engine_requests:
            raise too_busy(
                f"the server has {held} engine requests in flight or admitted; this request "
                f"needs {count} more and at most {limits.max_engine_requests} are allowed "
                "(--max-engine-requests)",
                "too_many_engine_requests",
            )
        self._reserved += count
        return count

    def unreserve(self, count: int) -> None:
        """Give back slots of :meth:`reserve`."""
        self._reserved -= count

    def _check_token_count(self, parsed: ParsedRequest) -> None:
        limit = self.config.max_model_len
        if parsed.truncate_prompt_tokens is not None:
            return  # checked after truncation
        if parsed.endpoint == "generate":
            lists: list[tuple[str, Any]] = [("token_ids", parsed.token_ids or [])]
        elif parsed.endpoint == "completions":
            prompts = parsed.prompts or []
            lists = [("prompt" if len(prompts) == 1 else f"prompt[{i}]", p)
                     for i, p in enumerate(prompts) if not isinstance(p, str)]  # fmt: skip
        else:
            return
        for param, ids in lists:
            if len(ids) >= limit:
                raise APIError(
                    400,
                    f"the prompt has {len(ids)} tokens; this model's maximum context "
                    f"length is {limit} tokens",
                    param=param,
                    code="context_length_exceeded",
                )

    async def run_processing(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the bounded processing pool (inline when
        ``offload_processing`` is off)."""
        if self.config.offload_processing:
            return await self.pool.run(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the bounded processing pool, whatever
        ``offload_processing`` says: for work whose cost the client chooses (a
        tokenizer over a client's list), which must never run on the event loop.
        429 when the pool is full."""
        return await self.pool.run(fn, *args, **kwargs)

    async def _process(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self.run_processing(fn, *args, **kwargs)
        except APIError:
            raise
        except MemoryError as exc:
            raise APIError(
                413,
                "the request's inputs need more memory than this server can give them",
                code="input_too_large",
            ) from exc
        except (ValueError, OSError, IndexError) as exc:
            code = getattr(exc, "code", None)
            code = code if isinstance(code, str) else "invalid_input"
            raise APIError(
                400,
                f"could not process the request inputs: {exc}",
                param=getattr(exc, "param", None) or _PARAM_OF_CODE.get(code),
                code=code,
            ) from exc

    async def process_chat(
        self, parsed: ParsedRequest, tools: Any = None, media: Any = None
    ) -> Any:
        """A chat or responses request's model inputs, on the bounded processing pool.

        The caller has checked the request's limits (:meth:`check_limits`).
        ``tools`` (a :class:`~ec_frontend.entrypoints.openai.tool_parsers.ToolPlan`) are
        rendered by the chat template; ``media`` are the request's items as
        :meth:`resolve_media` gave them (default: as parsed).
        """
        extra = {"tools": tools.template_tools()} if tools is not None else {}
        return await self._process(
            self.engine.processor.process_chat,
            parsed.messages,
            parsed.media if media is None else media,
            add_generation_prompt=parsed.add_generation_prompt,
            chat_template_kwargs=parsed.chat_template_kwargs,
            mm_processor_kwargs=parsed.mm_processor_kwargs,
            media_io_kwargs=parsed.media_io_kwargs,
            **extra,
            **continuation(parsed),
        )

    async def _structured(self, parsed: ParsedRequest) -> tuple[Any, Any]:
        """The request's compiled grammar and tool plan (400 when invalid)."""
        structured = parsed.structured
        if structured is None:
            return None, None
        auto = self.config.enable_auto_tool_choice and self.config.tool_call_parser is not None
        if parsed.endpoint == "responses":
            structured = {**structured, "endpoint": "responses"}
        return await self.run_processing(self.structured.compile, structured, auto_tools=auto)

    async def make_jobs(
        self, parsed: ParsedRequest, base_id: str, client: str = "unknown"
    ) -> list[Job]:
        """Process inputs and build one :class:`Job` per engine request. ``client`` (the
        caller's address) names who holds the KV of a ``do_remote_decode`` request."""
        self._check_media(parsed)
        reserved = self.reserve(parsed)
        try:
            return await self._make_jobs(parsed, base_id, client)
        finally:
            # The jobs' ids are in ``_active`` now (no await since), or there are none.
            self.unreserve(reserved)

    async def _make_jobs(self, parsed: ParsedRequest, base_id: str, client: str) -> list[Job]:
        processor = self.engine.processor
        endpoint = parsed.endpoint
        media = await self.resolve_media(parsed)
        grammar, tools = await self._structured(parsed)
        prompts: list[tuple[Any, str, str | None]] = []
        if endpoint in ("chat", "responses"):
            prompts.append((await self.process_chat(parsed, tools, media), "messages", None))
        elif endpoint == "completions":
            for i, prompt in enumerate(parsed.prompts or []):
                inputs = await self._process(processor.process_prompt, prompt)
                if isinstance(prompt, str):
                    text: str | None = prompt
                elif parsed.echo:
                    text = processor.tokenizer.decode(prompt)
                else:
                    text = None
                param = "prompt" if len(parsed.prompts or []) == 1 else f"prompt[{i}]"
                prompts.append((inputs, param, text))
        else:
            self._check_token_ids(parsed.token_ids or [], "token_ids")
            inputs = await self._process(
                processor.process_generate, parsed.token_ids or [], parsed.features
            )
            prompts.append((inputs, "token_ids", None))
        if parsed.truncate_prompt_tokens is not None:
            prompts = [await self._truncate(parsed, *prompt) for prompt in prompts]
        sampling = parsed.sampling
        extra = sampling.get("extra_args")
        if isinstance(extra, dict) and "kv_transfer_params" in extra:
            # The hold's client is the server's word, never the body's.
            kv = stamp_hold_client(extra["kv_transfer_params"], client)
            sampling["extra_args"] = {**extra, "kv_transfer_params": kv}
        bad_words = self._bad_words(sampling.get("bad_words"))
        n = parsed.n
        for inputs, param, _ in prompts:
            self._check_length(len(inputs.prompt_token_ids), sampling.get("max_tokens"), param)
            inputs.cache_salt = parsed.cache_salt
        jobs: list[Job] = []
        single = n * len(prompts) == 1
        try:
            for p, (inputs, _, text) in enumerate(prompts):
                for i in range(n):
                    params = build_sampling_params(
                        sampling,
                        choice=i,
                        vocab_size=self.config.vocab_size,
                        bad_words=bad_words,
                        max_logprobs=self.config.max_logprobs,
                    )
                    params.structured_outputs = grammar
                    rid = self._unique_id(base_id if single else f"{base_id}-{p * n + i}")
                    jobs.append(
                        Job(p * n + i, p, rid, inputs, params, text, tools=tools, group=base_id)
                    )
        except BaseException:
            self.release(jobs)  # a later choice's invalid params: the earlier ids go back
            raise
        return jobs

    def _bad_words(self, words: list[str] | None) -> list[list[int]] | None:
        if not words:
            return None
        return bad_words_token_ids(self.engine.processor.tokenizer, words)

    async def _truncate(
        self, parsed: ParsedRequest, inputs: Any, param: str, text: str | None
    ) -> tuple[Any, str, str | None]:
        """vLLM's ``truncate_prompt_tokens``: at most that many prompt tokens (``-1``:
        the context less one token for the output), the first ones kept with
        ``truncation_side`` right (the tokenizer's default side), the last with left.
        A prompt with images is never cut (400)."""
        keep = parsed.truncate_prompt_tokens
        limit = self.config.max_model_len
        if keep is None:
            return inputs, param, text
        if keep > limit:
            raise APIError(
                400,
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len "
                f"= {limit}. Please request a smaller truncation size.",
                param="truncate_prompt_tokens",
                code="invalid_value",
            )
        if keep < 0:
            keep = limit - 1
        ids = list(inputs.prompt_token_ids)
        if len(ids) <= keep:
            return inputs, param, text
        if inputs.mm_features:
            raise APIError(
                400,
                "truncate_prompt_tokens would cut a prompt that has images; this server "
                "truncates text-only prompts",
                param="truncate_prompt_tokens",
                code="invalid_value",
            )
        processor = self.engine.processor
        side = parsed.truncation_side or getattr(processor.tokenizer, "truncation_side", "right")
        kept = ids[-keep:] if side == "left" and keep else ids[:keep]
        inputs = await self._process(processor.process_prompt, kept)
        if text is not None:
            text = processor.tokenizer.decode(kept)
        return inputs, param, text

    def shutdown(self) -> None:
        """Stop the input-processing threads."""
        self.pool.shutdown()

    def active_ids(self) -> list[str]:
        """Engine request ids in flight (the drain aborts these on timeout)."""
        return list(self._active)

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort every engine request of the client requests named (exactly: ``team``
        is not ``team-7``), on any API server of the engine (the engine applies it)."""
        await self.engine.abort_groups(request_ids)

    def release(self, jobs: list[Job]) -> None:
        """Forget the ids of ``jobs`` that never reached the engine (the others are
        forgotten when they end; see :meth:`_end`)."""
        for j in jobs:
            if not j.started:
                self._active.discard(j.request_id)

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab = self.config.vocab_size
        if vocab is None:
            return
        for i, t in enumerate(token_ids):
            if t < 0 or t >= vocab:
                raise APIError(
                    400,
                    f"token id {t} is outside the vocabulary (0 to {vocab - 1})",
                    param=f"{param}[{i}]",
                    code="invalid_value",
                )

    def _check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> None:
        limit = self.config.max_model_len
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
        if prompt_len >= limit:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; this model's maximum context "
                f"length is {limit} tokens",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise APIError(
                400,
                f"max_tokens ({max_tokens}) plus the prompt ({prompt_len} tokens) exceeds "
                f"this model's maximum context length of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def _unique_id(self, rid: str) -> str:
        while rid in self._active or self.engine.holds_request(rid):
            rid = f"{rid}-{new_id()[:8]}"
        self._active.add(rid)
        return rid

    # --------------------------------------------------------------- running

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cleanup(self, agen: Any, request_id: str) -> None:
        try:
            await agen.aclose()
            await self.engine.abort(request_id)
        finally:
            loop = asyncio.get_running_loop()
            loop.call_later(_ABORTED_ID_HOLD_S, self._active.discard, request_id)

    def _start(self, job: Job) -> OutputStream:
        job.started = True
        return self.engine.add_request(job.request_id, job.inputs, job.params, group=job.group)

    @staticmethod
    def _timing(job: Job, started: float) -> Timing:
        """The bookkeeping of ``job``, just handed to the engine (arrived at ``started``)."""
        max_tokens = getattr(job.params, "max_tokens", None)
        return Timing(
            started,
            handed_off=time.perf_counter(),
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        )

    def _observe(self, timing: Timing, out: Any) -> bool:
        """Record latency metrics for one delta; True when it finishes the request."""
        tokens = out.token_ids
        vm = self.vllm_metrics
        if out.prompt_token_ids is not None and not timing.prompt_tokens:
            timing.prompt_tokens = len(out.prompt_token_ids)
        if tokens:
            now = time.perf_counter()
            m = self.metrics
            if timing.last == 0.0:
                m.ttft.observe(now - timing.started)
                vm.ttft.observe(now - timing.started)
                timing.first = now
            else:
                gap = (now - timing.last) / len(tokens)
                for _ in tokens:
                    m.itl.observe(gap)
                    vm.itl.observe(gap)
            timing.last = now
            timing.generated += len(tokens)
        if out.finished:
            timing.finished = True
            now = time.perf_counter()
            self.metrics.e2e.observe(now - timing.started)
            vm.finished(
                arrived=timing.started,
                handed_off=timing.handed_off,
                first_token=timing.first or now,
                last_token=timing.last or now,
                prompt_tokens=timing.prompt_tokens,
                generated=timing.generated,
                finish_reason=out.finish_reason,
                max_tokens=timing.max_tokens,
            )
            return True
        return False

    def _end(self, job: Job, agen: Any, timing: Timing) -> None:
        """After a job's loop: forget its id, or abort it unless it finished (never awaits).

        An aborted id stays reserved for ``_ABORTED_ID_HOLD_S`` so that a new request
        reusing it cannot meet the engine's late bookkeeping of the old one.
        """
        if timing.finished:
            self._active.discard(job.request_id)
            return
        self.metrics.aborted.inc()
        self._spawn(self._cleanup(agen, job.request_id))

    async def _run(self, job: Job, choice: Choice, started: float) -> None:
        agen = self._start(job)
        timing = self._timing(job, started)
        try:
            async for out in agen:
                choice.add(out)
                if self._observe(timing, out):
                    return
        finally:
            self._end(job, agen, timing)

    async def collect(self, jobs: list[Job], started: float) -> list[Choice]:
        """Run all jobs to completion; the choices in index order.

        Cancelling the caller aborts every job that has not finished.
        """
        choices = [self._choice(j) for j in jobs]
        try:
            if len(jobs) == 1:
                await self._run(jobs[0], choices[0], started)
            else:
                tasks = [
                    asyncio.ensure_future(self._run(j, c, started))
                    for j, c in zip(jobs, choices, strict=True)
                ]
                try:
                    await asyncio.gather(*tasks)
                finally:
                    for t in tasks:
                        t.cancel()
        finally:
            self.release(jobs)
        return choices

    def stream(self, jobs: list[Job], started: float, interval: int = 1) -> DeltaStream:
        """``(choice, delta)`` as deltas arrive from any job; ``choice`` already holds it.

        With ``interval > 1`` (vLLM's ``stream_interval``) a job's deltas are merged
        until they hold ``interval`` tokens; its first delta with tokens and its
        finishing one go out at once. Closing the iterator early aborts every job
        that has not finished.
        """
        ready = _Ready()
        deltas = self._stream(jobs, started, ready)
        if interval > 1:
            # A delta that is there may be held back to merge with one that is not:
            # such a stream never says that its next pair is ready.
            return DeltaStream(_coalesce(deltas, interval), _Ready())
        return DeltaStream(deltas, ready)

    async def _stream(
        self, jobs: list[Job], started: float, ready: _Ready
    ) -> AsyncIterator[tuple[Choice, Any]]:
        choices = [self._choice(j) for j in jobs]
        if len(jobs) == 1:
            job, choice = jobs[0], choices[0]
            agen = self._start(job)
            ready.check = getattr(agen, "ready", None)
            timing = self._timing(job, started)
            try:
                async for out in agen:
                    choice.add(out)
                    done = self._observe(timing, out)
                    yield choice, out
                    if done:
                        return
            finally:
                self._end(job, agen, timing)
                self.release(jobs)
            return
        queue: asyncio.Queue[tuple[int, Any] | None] = asyncio.Queue()
        ready.check = lambda: not queue.empty()

        async def pump(k: int) -> None:
            job = jobs[k]
            agen = self._start(job)
            timing = self._timing(job, started)
            try:
                async for out in agen:
                    queue.put_nowait((k, out))
                    if self._observe(timing, out):
                        return
            except Exception as exc:
                queue.put_nowait((k, exc))
            finally:
                self._end(job, agen, timing)
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(k)) for k in range(len(jobs))]
        try:
            remaining = len(jobs)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                k, out = item
                if isinstance(out, BaseException):
                    raise out
                choices[k].add(out)
                yield choices[k], out
        finally:
            for t in tasks:
                t.cancel()
            self.release(jobs)

    @staticmethod
    def _choice(job: Job) -> Choice:
        return Choice(
            job.index,
            job.prompt_index,
            job.request_id,
            job.inputs.prompt_token_ids,
            job.prompt_text,
            tools=job.tools,
        )


class _Ready:
    """Whether a stream's next delta has already arrived: ``check`` is set by the
    stream once it knows its source (``None``: it cannot tell, so never)."""

    __slots__ = ("check",)

    def __init__(self) -> None:
        self.check: Callable[[], bool] | None = None


class DeltaStream:
    """The ``(choice, delta)`` pairs of :meth:`Serving.stream`, and :attr:`ready`:
    whether the next pair is already there, so that a writer can gather every event
    of an engine step (and any backlog) into one write instead of one per event."""

    __slots__ = ("_deltas", "_ready")

    def __init__(self, deltas: AsyncIterator[tuple[Choice, Any]], ready: _Ready) -> None:
        self._deltas = deltas
        self._ready = ready

    def __aiter__(self) -> DeltaStream:
        return self

    def __anext__(self) -> Awaitable[tuple[Choice, Any]]:
        return self._deltas.__anext__()

    async def aclose(self) -> None:
        await self._deltas.aclose()  # type: ignore[attr-defined]

    @property
    def ready(self) -> bool:
        """True when the next pair comes without waiting (a writer that skips pairs
        without events asks again after each)."""
        check = self._ready.check
        return check is not None and check()


async def _coalesce(
    deltas: AsyncIterator[tuple[Choice, Any]], interval: int
) -> AsyncIterator[tuple[Choice, Any]]:
    """Merge each choice's deltas as vLLM's ``stream_interval`` does."""
    pending: dict[int, Any] = {}
    sent: set[int] = set()
    try:
        async for choice, out in deltas:
            key = choice.index
            held = pending.pop(key, None)
            if held is not None:
                held.add(out)
                out = held
            first = key not in sent and bool(out.token_ids)
            if out.finished or first or len(out.token_ids) >= interval:
                if out.token_ids:
                    sent.add(key)
                yield choice, out
            else:
                pending[key] = held if held is not None else _copy(out)
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]


def _copy(out: Any) -> Any:
    """A delta that later deltas can be merged into without touching the engine's."""
    return replace(
        out,
        token_ids=list(out.token_ids),
        logprobs=None if out.logprobs is None else list(out.logprobs),
    )


def continuation(parsed: ParsedRequest) -> dict[str, Any]:
    """The chat processor's keyword for vLLM's ``continue_final_message`` (none when
    unset, so a processor without the option still serves every other request)."""
    return {"continue_final_message": True} if parsed.continue_final_message else {}
