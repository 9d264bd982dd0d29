"""Constrained decoding: grammars compiled once per spec, a matcher per request,
token bitmasks for the whole batch each step.

The library is llguidance (``docs/structured_outputs.md`` says why). The pieces:

* :class:`GrammarCompiler` turns a constraint (a JSON schema, ``json_object``, a
  regex, a list of choices, a Lark or GBNF grammar, a structural tag) into a validated
  :class:`CompiledGrammar`, cached by the spec's canonical JSON. The server calls it
  on its input-processing threads, never on the engine's step loop; an invalid
  spec raises :class:`StructuredOutputError` naming the request parameter.
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
state (a token it refused was forced in, e.g. by ``min_tokens``) allows only
end-of-sequence, so the request ends instead of emitting unconstrained text.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

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


class StructuredOutputError(ValueError):
    """A constraint the library cannot compile; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A validated llguidance grammar and the tokenizer it runs over.

    The first matcher built from it (parsing the grammar and setting up its lexer:
    about half a millisecond for a JSON schema) is kept unused as a template;
    every request's matcher is a copy of it (microseconds).
    """

    kind: str
    grammar: str
    tokenizer: LLTokenizer
    _template: list[LLMatcher] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def new_state(self) -> GrammarState:
        return GrammarState(self)

    def new_matcher(self) -> LLMatcher:
        """A matcher at the start of the grammar."""
        with self._lock:
            if not self._template:
                self._template.append(LLMatcher(self.tokenizer, self.grammar))
            return self._template[0].deep_copy()


class GrammarState:
    """One request's matcher, advanced over its output tokens before each mask.

    Created on the engine thread without compiling anything: the matcher itself is
    built on the bitmask worker at the first mask (llguidance builds its lexer
    there, with the GIL released).
    """

    __slots__ = ("_matcher", "failed", "grammar", "num_consumed")

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._matcher: LLMatcher | None = None
        self.num_consumed = 0
        self.failed = False

    @property
    def matcher(self) -> LLMatcher:
        if self._matcher is None:
            self._matcher = self.grammar.new_matcher()
        return self._matcher

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Advance over the tokens generated since the last call."""
        n = len(output_token_ids)
        if n <= self.num_consumed or self.failed:
            self.num_consumed = max(self.num_consumed, n)
            return
        matcher = self.matcher
        new = list(output_token_ids[self.num_consumed : n])
        self.num_consumed = n
        if matcher.is_stopped():
            return
        if not matcher.consume_tokens(new):
            self.failed = True
            logger.warning("constrained request left its grammar: %s", matcher.get_error())

    @property
    def started(self) -> bool:
        """The matcher is built (its first mask was computed)."""
        return self._matcher is not None

    def is_finished(self) -> bool:
        """The grammar is complete: only end-of-sequence may follow."""
        return self._matcher is not None and self._matcher.is_stopped()


class GrammarCompiler:
    """Constraint specs -> :class:`CompiledGrammar`, cached; safe to call from threads."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance.hf  # imports transformers: only where a tokenizer is wrapped

        eos = sorted(set(eos_token_ids)) or None
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos
        )
        self.vocab_size = vocab_size
        #: Texts of the tokenizer's special tokens (a structural tag's trigger that is
        #: one is matched as that token, not as text).
        self.special_tokens = frozenset(getattr(hf_tokenizer, "all_special_tokens", ()))
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, kind: str, spec: Any, param: str) -> CompiledGrammar:
        """The grammar of a constraint; :class:`StructuredOutputError` if it is invalid."""
        if kind not in KINDS:
            raise StructuredOutputError(f"unknown constraint kind {kind!r}", param)
        key = (kind, json.dumps(spec, sort_keys=True, ensure_ascii=False))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        grammar = self._build(kind, spec, param)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise StructuredOutputError(f"invalid {_WHAT[kind]} in '{param}': {error}", param)
        compiled = CompiledGrammar(kind, grammar, self.tokenizer)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

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
                f"invalid {_WHAT[kind]} in '{param}': {exc}", param
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
            error = LLMatcher.validate_grammar(self._build("json", schema, at), self.tokenizer)
            if error:
                raise StructuredOutputError(f"invalid JSON schema in '{at}': {error}", at)
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
            _only(mask[i], state.grammar.tokenizer.eos_tokens)
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
            _only(mask[i], state.grammar.tokenizer.eos_tokens)
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
    for matcher, i in work:
        if not words[i].any():
            # Nothing allowed (a matcher that failed inside the library): end.
            logger.warning("constrained request has no allowed token: %s", matcher.get_error())
            row_state = job.states[i]
            _only(mask[i], row_state.grammar.tokenizer.eos_tokens if row_state is not None else ())
    return mask


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
