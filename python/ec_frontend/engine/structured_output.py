"""Constrained decoding: grammars compiled once per spec, a matcher per request,
token bitmasks for the whole batch each step.

The library is llguidance (``docs/structured_outputs.md`` says why). The pieces:

* :class:`GrammarCompiler` turns a constraint (a JSON schema, ``json_object``, a
  regex, a list of choices, a Lark or GBNF grammar, a structural tag) into a validated
  :class:`CompiledGrammar`, cached by the spec's canonical JSON. The server calls it
  on its input-processing threads, never on the engine's step loop, within a
  :class:`GrammarBudget` (grammar bytes, validation seconds); an invalid spec, or
  one over the budget, raises :class:`StructuredOutputError` naming the request
  parameter.
* :meth:`CompiledGrammar.start` builds the grammar's matcher (the library's parser
  and lexer over the whole vocabulary, and its first mask: seconds for a large
  grammar) on a compile thread (:func:`compile_pool`; the library releases the GIL
  while it builds). The scheduler keeps a request aside until its grammar is built
  (:attr:`CompiledGrammar.ready`), failed (:attr:`CompiledGrammar.error`) or out of
  time, so that no step waits for a build.
* :class:`GrammarState` is one request's matcher. It is advanced lazily, from the
  request's own ``output_token_ids``, right before its next mask: a decode instance
  that received the first token from prefill, or a preempted request, catches up
  over the tokens it already has, with no hook in the scheduler.
* :class:`BitmaskFiller` computes the ``[rows, ceil(V / 32)]`` int32 bitmask of a
  step's constrained rows on a worker thread (llguidance releases the GIL), started
  before the model's forward and collected before sampling;
  :func:`apply_bitmask` sets the disallowed logits of those rows to ``-inf`` in one
  batched write.

A matcher that reaches an accepting state allows the end-of-sequence tokens; one
that has stopped (the grammar is complete) allows only those. A matcher in an error
state (a runtime limit of the library, a token it refused) records the error in its
state (:attr:`GrammarState.error`) and :func:`grammar_violations` reports the row,
as does a sampled token outside its row's mask (``min_tokens`` holding back the only
allowed token): the runner then fails the request (``finish_reason: "error"``)
without its token, so no text outside the grammar is ever emitted. Errors are
logged and reported bounded (:func:`bounded`): never the whole grammar.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from ec_frontend.config import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from ec_frontend.errors import GRAMMAR_FAILURE_PREFIX

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

#: Options of llguidance's JSON-schema compiler: compact separators, no free
#: whitespace (a model could otherwise spend its whole budget on spaces).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
#: Compiled grammars kept per compiler.
CACHE_SIZE = 512
#: Constraint kinds a request may ask for.
KINDS = frozenset({"json", "json_object", "regex", "choice", "grammar", "lark", "structural_tag"})
#: Characters of a library error kept in a log line or an error message.
ERROR_CHARS = 300


def bounded(text: str, limit: int = ERROR_CHARS) -> str:
    """``text`` on one line, without a Rust backtrace, cut to ``limit`` characters
    (a library error may quote the grammar, megabytes of it)."""
    line = " ".join(text.split("<backtrace>", 1)[0].split())
    if len(line) <= limit:
        return line
    return f"{line[:limit]}... ({len(line)} characters)"


def parser_limits() -> LLParserLimits:
    """The library's default resource limits, with errors that do not quote the
    grammar or the parser's state."""
    return LLParserLimits(verbose_errors=False)


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """What one request's grammar may cost: ``max_bytes`` of grammar text (checked at
    the API, before anything is built) and ``compile_timeout_s`` seconds to validate
    it (on the server) or build its matcher (in the engine)."""

    max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, not {self.max_bytes}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, not {self.compile_timeout_s}")


def _compile_threads() -> int:
    return max(2, min(4, (os.cpu_count() or 2) // 4))


_POOL_LOCK = threading.Lock()
_POOL: list[ThreadPoolExecutor] = []


def compile_pool() -> ThreadPoolExecutor:
    """The process's grammar compile threads (a quarter of the cores, 2 to 4),
    created on first use."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(
                ThreadPoolExecutor(_compile_threads(), thread_name_prefix="grammar-compile")
            )
        return _POOL[0]


class StructuredOutputError(ValueError):
    """A constraint the library cannot compile; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(slots=True, eq=False)
class CompiledGrammar:
    """A validated llguidance grammar and the tokenizer it runs over.

    Its first matcher (parsing the grammar, building its lexer and its first mask:
    half a millisecond for a JSON schema, seconds for tens of thousands of choices)
    is built once, by :meth:`build` (on a compile thread after :meth:`start`), and
    kept unused as a template; every request's matcher is a copy of it
    (microseconds). A grammar the library refuses keeps its :attr:`error`.
    """

    kind: str
    grammar: str
    #: The tokenizer, or a function that loads it (called by the first build, on a
    #: compile thread: the engine process loads its tokenizer on first use).
    source: LLTokenizer | Callable[[], LLTokenizer] = field(repr=False)
    _template: LLMatcher | None = field(default=None, repr=False)
    _error: str | None = field(default=None, repr=False)
    _future: Future[None] | None = field(default=None, repr=False)
    _waiters: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def new_state(self) -> GrammarState:
        return GrammarState(self)

    @property
    def tokenizer(self) -> LLTokenizer:
        source = self.source
        if isinstance(source, LLTokenizer):
            return source
        tokenizer = source()
        self.source = tokenizer
        return tokenizer

    @property
    def eos_tokens(self) -> Sequence[int]:
        """The tokenizer's end-of-sequence ids (none before it is loaded)."""
        source = self.source
        return source.eos_tokens if isinstance(source, LLTokenizer) else ()

    @property
    def ready(self) -> bool:
        """The template matcher is built: a request may be scheduled."""
        return self._template is not None

    @property
    def error(self) -> str | None:
        """Why the library refused the grammar (bounded), or ``None``."""
        return self._error

    def start(self, pool: ThreadPoolExecutor | None = None) -> None:
        """Build the template on ``pool`` (default :func:`compile_pool`) unless it is
        built or building; one more request waits for it until :meth:`release`."""
        with self._lock:
            self._waiters += 1
            if self._template is not None or self._error is not None or self._future is not None:
                return
            self._future = (pool or compile_pool()).submit(self.build)

    def release(self) -> None:
        """A waiting request gave up (timed out, aborted): with no other waiter, a
        build that has not started is dropped (a later request starts it again)."""
        with self._lock:
            self._waiters = max(0, self._waiters - 1)
            if self._waiters == 0 and self._future is not None and self._future.cancel():
                self._future = None

    def build(self) -> None:
        """Build the template matcher and its first mask (blocking; the library
        releases the GIL). A refused grammar sets :attr:`error` instead."""
        if self._template is not None or self._error is not None:
            return
        try:
            tokenizer = self.tokenizer
        except (OSError, ValueError, RuntimeError) as exc:
            with self._lock:
                self._error = bounded(f"no tokenizer to constrain the output: {exc}")
            return
        matcher = LLMatcher(tokenizer, self.grammar, log_level=0, limits=parser_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()
        error = bounded(matcher.get_error()) if matcher.is_error() else None
        with self._lock:
            if error is not None:
                self._error = error
                logger.warning("%s grammar refused by the library: %s", self.kind, error)
            else:
                self._template = matcher

    def new_matcher(self) -> LLMatcher:
        """A matcher at the start of the grammar (built here if no compile thread
        built it: callers that schedule requests wait for :attr:`ready`)."""
        if self._template is None and self._error is None:
            self.build()
        template = self._template
        if template is None:
            raise StructuredOutputError(f"grammar refused: {self._error}", "structured_outputs")
        with self._lock:
            return template.deep_copy()


class GrammarState:
    """One request's matcher, advanced over its output tokens before each mask.

    Created on the engine thread without compiling anything: the matcher is a copy
    of its grammar's template, made on the bitmask worker at the first mask.
    ``error`` says why the request left its grammar (the library's error, bounded);
    the runner then fails the request.
    """

    __slots__ = ("_matcher", "error", "grammar", "num_consumed", "since")

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._matcher: LLMatcher | None = None
        self.num_consumed = 0
        self.error: str | None = None
        #: When the request started waiting for its grammar's build (monotonic).
        self.since: float | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = bounded(message)
            logger.warning("constrained request left its grammar: %s", self.error)

    def start(self, pool: ThreadPoolExecutor | None = None) -> None:
        """Start building the grammar (see :meth:`CompiledGrammar.start`)."""
        if self.since is None:
            self.since = time.monotonic()
            self.grammar.start(pool)

    def release(self) -> None:
        """Stop waiting for the grammar's build (see :meth:`CompiledGrammar.release`)."""
        if self.since is not None:
            self.grammar.release()

    @property
    def matcher(self) -> LLMatcher:
        if self._matcher is None:
            self._matcher = self.grammar.new_matcher()
        return self._matcher

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Advance over the tokens generated since the last call."""
        if self.failed:
            return
        try:
            matcher = self.matcher
        except StructuredOutputError as exc:
            self.fail(exc.message)
            return
        n = len(output_token_ids)
        if n <= self.num_consumed:
            return
        new = list(output_token_ids[self.num_consumed : n])
        self.num_consumed = n
        if matcher.is_stopped():
            return
        if not matcher.consume_tokens(new):
            self.fail(matcher.get_error() or "a generated token is outside the grammar")

    def check(self) -> None:
        """Record the matcher's error, if the library set one (a runtime limit)."""
        matcher = self._matcher
        if matcher is not None and self.error is None and matcher.is_error():
            self.fail(matcher.get_error())

    @property
    def started(self) -> bool:
        """The matcher is built (its first mask was computed)."""
        return self._matcher is not None

    def is_finished(self) -> bool:
        """The grammar is complete: only end-of-sequence may follow."""
        return self._matcher is not None and self._matcher.is_stopped()


class GrammarCompiler:
    """Constraint specs -> :class:`CompiledGrammar`, cached; safe to call from threads.

    A grammar over ``budget.max_bytes`` is refused before the library sees it; the
    rest is validated by the library (grammar syntax and its limits; the lexer over
    the vocabulary is built by the engine) on :func:`compile_pool`, waited for at most
    ``budget.compile_timeout_s``. A choice list or ``json_object`` is not validated:
    its grammar is the library's own and has no syntax to get wrong.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        budget: GrammarBudget | None = None,
    ) -> None:
        import llguidance.hf  # imports transformers: only where a tokenizer is wrapped

        eos = sorted(set(eos_token_ids)) or None
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos
        )
        self.vocab_size = vocab_size
        self.budget = budget or GrammarBudget()
        #: Texts of the tokenizer's special tokens (a structural tag's trigger that is
        #: one is matched as that token, not as text).
        self.special_tokens = frozenset(getattr(hf_tokenizer, "all_special_tokens", ()))
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, kind: str, spec: Any, param: str) -> CompiledGrammar:
        """The grammar of a constraint; :class:`StructuredOutputError` if it is
        invalid or over the budget."""
        if kind not in KINDS:
            raise StructuredOutputError(f"unknown constraint kind {kind!r}", param)
        key = (kind, json.dumps(spec, sort_keys=True, ensure_ascii=False))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        timeout = self.budget.compile_timeout_s
        future = compile_pool().submit(self._compile, kind, spec, param)
        try:
            compiled = future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise StructuredOutputError(
                f"the {_WHAT[kind]} in '{param}' took longer than this server's limit of "
                f"{timeout:g} s to compile (--structured-outputs-compile-timeout)",
                param,
            ) from None
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, spec: Any, param: str) -> CompiledGrammar:
        grammar = self._build(kind, spec, param)
        size = len(grammar.encode())
        limit = self.budget.max_bytes
        if size > limit:
            raise StructuredOutputError(
                f"the {_WHAT[kind]} in '{param}' compiles to a grammar of {size:,} bytes, "
                f"over this server's limit of {limit:,} (--structured-outputs-max-grammar-bytes)",
                param,
            )
        if kind not in ("choice", "json_object"):
            error = LLMatcher.validate_grammar(grammar, limits=parser_limits())
            if error:
                raise StructuredOutputError(
                    f"invalid {_WHAT[kind]} in '{param}': {bounded(error)}", param
                )
        return CompiledGrammar(kind, grammar, self.tokenizer)

    def _build(self, kind: str, spec: Any, param: str) -> str:
        if kind == "structural_tag":
            return self._structural_tag(spec, param)
        try:
            if kind == "json":
                schema = json.loads(spec) if isinstance(spec, str) else spec
                if not isinstance(schema, dict | bool):
                    raise ValueError("a JSON schema must be an object or a boolean")
                # A boolean schema (``true``: anything) goes as its JSON text.
                text = schema if isinstance(schema, dict) else json.dumps(schema)
                return LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
            if kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if kind == "regex":
                return LLMatcher.grammar_from_regex(spec)
            if kind == "choice":
                return llguidance.grammar_from("choice", list(spec))  # type: ignore[arg-type]
            if kind == "grammar":
                return llguidance.grammar_from("grammar", spec)
            return LLMatcher.grammar_from_lark(spec)
        except (ValueError, TypeError, RecursionError) as exc:
            raise StructuredOutputError(
                f"invalid {_WHAT[kind]} in '{param}': {bounded(str(exc))}", param
            ) from exc

    def _structural_tag(self, spec: dict[str, Any], param: str) -> str:
        """vLLM's structural tag (``structures`` and ``triggers``, shapes checked by the
        parser) as llguidance's tag grammar: free text until a trigger, then a
        structure's ``begin``, JSON valid for its ``schema`` (compact) and its ``end``.
        Each schema is compiled alone first, so an error names its structure."""
        triggers: list[str] = list(spec["triggers"])
        tags: list[llguidance.StructTag] = []
        for i, item in enumerate(spec["structures"]):
            at = f"{param}.structures[{i}].schema"
            schema = item["schema"]
            if schema is False:
                raise StructuredOutputError(f"the schema in '{at}' admits no value", at)
            schema = {} if schema is True else schema
            error = LLMatcher.validate_grammar(
                self._build("json", schema, at), limits=parser_limits()
            )
            if error:
                raise StructuredOutputError(f"invalid JSON schema in '{at}': {bounded(error)}", at)
            trigger = next(t for t in triggers if item["begin"].startswith(t))
            tags.append(
                llguidance.StructTag(
                    trigger=trigger,
                    begin=item["begin"],
                    grammar={**schema, "x-guidance": JSON_OPTIONS},
                    end=item["end"],
                )
            )
        # A trigger written like a special token (<...>) is one only if the tokenizer
        # has it as one; otherwise every trigger is matched as text.
        tagged = [t for t in triggers if t.startswith("<") and t.endswith(">")]
        special = all(t in self.special_tokens for t in tagged)
        return llguidance.StructTag.to_grammar(tags, assume_special=special)


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
    "lark": "grammar",
    "structural_tag": "structural tag",
}


#: Fewer constrained rows than this are masked one after the other on the worker
#: thread: waking the library's thread pool costs more than it saves (its threads
#: spin for a while after each batch, taking cores from the model's forward).
PARALLEL_MIN_ROWS = 4


def _default_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


#: Below this predicted mask time (seconds) a step's bitmask is computed inline: the
#: hand-off to the worker thread (waking it, then both threads taking turns at the
#: GIL while the model runs) costs more than it can hide. Measured on a loaded
#: 2-core host, a hand-off cost the engine's thread up to a few milliseconds.
INLINE_BELOW_S = 0.001
#: Per-row mask times kept for the prediction (their median).
COST_WINDOW = 16


@dataclass(slots=True)
class _MaskJob:
    """One step's bitmask: the matchers to ask, by row, and the states whose matcher
    is still to be built (their first mask; built where the mask is computed)."""

    mask: torch.Tensor
    states: Sequence[GrammarState | None]
    work: list[tuple[LLMatcher, int]]
    fresh: list[tuple[GrammarState, int, Sequence[int]]]


def _prepare(
    states: Sequence[GrammarState | None], outputs: Sequence[Sequence[int]], vocab_size: int
) -> _MaskJob:
    """The bitmask with free rows all allowed and failed rows end-of-sequence only;
    the started matchers caught up over their new tokens (a few microseconds each)."""
    mask = torch.from_numpy(np.full((len(states), bitmask_width(vocab_size)), -1, np.int32))
    job = _MaskJob(mask, states, [], [])
    for i, state in enumerate(states):
        if state is None:
            continue
        if not state.started:
            job.fresh.append((state, i, outputs[i]))
            continue
        state.sync(outputs[i])
        if state.failed:
            _only(mask[i], state.grammar.eos_tokens)
        else:
            job.work.append((state.matcher, i))
    return job


def _compute(executor: llguidance.LLExecutor | None, job: _MaskJob) -> torch.Tensor:
    """Build and catch up the fresh matchers, then fill every row's mask (the library
    releases the GIL while it computes)."""
    mask = job.mask
    work = list(job.work)
    for state, i, output in job.fresh:
        state.sync(output)
        if state.failed:
            _only(mask[i], state.grammar.eos_tokens)
        else:
            work.append((state.matcher, i))
    if not work:
        return mask
    width = mask.shape[1] * 4
    if executor is None or len(work) < PARALLEL_MIN_ROWS:
        base = mask.data_ptr()
        for matcher, i in work:
            matcher.unsafe_compute_mask_ptr(base + i * width, width)
    else:
        executor.unsafe_compute_mask_ptr(work, mask.data_ptr(), width, mask.shape[0])
    words = mask.numpy()
    for _, i in work:
        row_state = job.states[i]
        if row_state is None:
            continue
        row_state.check()
        if not row_state.failed and not words[i].any():
            row_state.fail("the grammar allows no token")
        if row_state.failed:
            _only(mask[i], row_state.grammar.eos_tokens)
    return mask


def grammar_violations(
    states: Sequence[GrammarState | None],
    bitmask: torch.Tensor | None,
    token_ids: Sequence[int],
) -> dict[int, str]:
    """Rows whose request must end with an error instead of its sampled token: its
    matcher failed (:attr:`GrammarState.error`), or the token is outside its row of
    ``bitmask`` (another mask, ``min_tokens`` say, held back every allowed token)."""
    bad: dict[int, str] = {}
    words = bitmask.numpy() if bitmask is not None else None
    for i, state in enumerate(states):
        if state is None:
            continue
        if state.error is not None:
            bad[i] = f"{GRAMMAR_FAILURE_PREFIX}the grammar's matcher failed: {state.error}"
            continue
        token = token_ids[i]
        if words is not None and not (int(words[i, token // 32]) >> (token % 32)) & 1:
            state.fail(f"token {token} is outside the grammar")
            bad[i] = (
                f"{GRAMMAR_FAILURE_PREFIX}the output left its grammar: token {token} is "
                "outside it (another constraint of the request, such as min_tokens, "
                "excluded every token the grammar allows)"
            )
    return bad


class BitmaskFiller:
    """Fills the bitmask of a step's constrained rows, on one worker thread.

    ``start`` catches the running matchers up on the caller's thread (cheap), then
    returns a future so that the caller can run the model while the worker computes
    the masks (llguidance's parallel executor from :data:`PARALLEL_MIN_ROWS` rows on,
    its threads half the host's cores up to 8 unless ``num_threads`` says; the
    library releases the GIL). When the masks are predicted to take less than
    :data:`INLINE_BELOW_S` (the median of recent per-row times, times the rows, as
    for a small vocabulary), they are computed at once instead, on the caller's
    thread, and ``start`` returns the tensor. A step that builds a matcher (its
    first mask, which also builds its lexer) is not counted in the prediction.
    """

    def __init__(self, num_threads: int | None = None) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._num_threads = num_threads
        #: Recent seconds per constrained row, on steps that built no matcher.
        self.row_costs: deque[float] = deque(maxlen=COST_WINDOW)

    def _ensure(self) -> tuple[ThreadPoolExecutor, llguidance.LLExecutor]:
        if self._pool is None or self._executor is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            self._executor = llguidance.LLExecutor(self._num_threads or _default_threads())
        return self._pool, self._executor

    def predicted_s(self, rows: int) -> float | None:
        """The predicted mask time of ``rows`` constrained rows (``None``: unknown)."""
        if not self.row_costs:
            return None
        ordered = sorted(self.row_costs)
        return rows * ordered[len(ordered) // 2]

    def start(
        self,
        states: Sequence[GrammarState | None],
        outputs: Sequence[Sequence[int]],
        vocab_size: int,
    ) -> Future[torch.Tensor] | torch.Tensor | None:
        """The bitmask (one row per entry of ``states``), computed in the background
        or at once; ``None`` when no entry is constrained."""
        if all(s is None for s in states):
            return None
        job = _prepare(states, outputs, vocab_size)
        rows = len(job.work) + len(job.fresh)
        predicted = self.predicted_s(rows)
        if predicted is None or predicted < INLINE_BELOW_S:
            return self._timed(None, job)
        pool, executor = self._ensure()
        return pool.submit(self._timed, executor, job)

    def _timed(self, executor: llguidance.LLExecutor | None, job: _MaskJob) -> torch.Tensor:
        t = time.perf_counter()
        mask = _compute(executor, job)
        rows = len(job.work) + len(job.fresh)
        if rows and not job.fresh:
            self.row_costs.append((time.perf_counter() - t) / rows)
        return mask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def fill_bitmask(
    executor: llguidance.LLExecutor | None,
    states: Sequence[GrammarState | None],
    outputs: Sequence[Sequence[int]],
    vocab_size: int,
) -> torch.Tensor:
    """``[len(states), ceil(V / 32)]`` int32: bit ``t`` of row ``i`` set when token ``t``
    is allowed; unconstrained rows allow everything."""
    return _compute(executor, _prepare(states, outputs, vocab_size))


def _only(row: torch.Tensor, token_ids: Sequence[int]) -> None:
    row.zero_()
    for t in token_ids:
        row[t // 32] |= _bit(t % 32)


def _bit(shift: int) -> int:
    # Bit 31 of an int32 is its sign bit.
    value = 1 << shift
    return value - (1 << 32) if value >= 1 << 31 else value


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, V]`` bool (True: allowed) from ``[rows, ceil(V / 32)]`` int32."""
    device = bitmask.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], *, inplace: bool = False
) -> torch.Tensor:
    """``logits`` with the disallowed tokens of ``rows`` set to ``-inf`` (``bitmask``
    has one row per row of ``logits``). A new tensor, unless ``inplace``: then only
    the constrained rows are written, in ``logits`` itself, and the other rows cost
    nothing (a batch of 32 over a 152k vocabulary is 19 MB of logits to copy).

    On the CPU the bits are unpacked by numpy (one byte per token, no int32
    intermediate); when only some rows are constrained (the usual batch), those rows
    are masked in numpy too, whose calls cost a third of torch's on a small
    vocabulary. On an accelerator the packed words travel and are unpacked there.
    """
    vocab = logits.shape[-1]
    cpu = logits.device.type == "cpu"
    partial = len(rows) < logits.shape[0]
    if cpu and partial and logits.dtype == torch.float32 and logits.is_contiguous():
        out = logits if inplace else logits.clone()
        values = out.numpy()
        index = np.asarray(rows, dtype=np.intp)
        packed = bitmask.numpy()[index].view(np.uint8)
        bits = np.unpackbits(packed, axis=-1, count=vocab, bitorder="little").view(np.bool_)
        values[index] = np.where(bits, values[index], np.float32(-np.inf))
        return out
    index_t = torch.tensor(list(rows), dtype=torch.int64)
    packed_t = bitmask.index_select(0, index_t)
    if cpu:
        row_bits = np.unpackbits(packed_t.numpy().view(np.uint8), axis=-1, bitorder="little")
        allowed = torch.from_numpy(row_bits[:, :vocab]).view(torch.bool)
    else:
        allowed = unpack_bitmask(packed_t.to(logits.device, non_blocking=True), vocab)
    if not partial:
        if inplace:
            return logits.masked_fill_(~allowed, float("-inf"))
        blocked = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        return torch.where(allowed, logits, blocked)
    out = logits if inplace else logits.clone()
    dev_index = index_t.to(logits.device)
    out[dev_index] = out[dev_index].masked_fill(~allowed, float("-inf"))
    return out
