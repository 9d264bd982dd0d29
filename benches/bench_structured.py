"""Constrained decoding: mask time per step, and what a constrained request costs the others.

Part 1, the library (``docs/structured_outputs.md``): a batch of 8 and of 32 requests,
each with its own JSON schema, decodes step by step over a 151,936-token vocabulary
(Qwen2's size): each step computes every row's token bitmask, then each row takes a
random allowed token and its matcher advances. Reported: the batch's mask time per
step (median and p99) and the compile time of a schema (first and cached). The
vocabulary is synthetic (no tokenizer can be downloaded here): the 256 byte tokens
plus word pieces drawn like a BPE vocabulary's (letters with and without a leading
space or capital, digit runs, punctuation and JSON-ish pieces such as ``":`` or
``"},``). llguidance (the engine's library) is measured with its parallel executor
as the engine calls it; xgrammar with its ``BatchGrammarMatcher`` when it can be
imported (``PYTHONPATH`` to an install of ``xgrammar`` and ``apache-tvm-ffi``; it is
not a dependency).

Part 2, the engine: 15 unconstrained requests (greedy, ``ignore_eos``) on the
built-in model with a 16th request in the same batch, constrained to a JSON object
or free, greedy or sampled (a sampled neighbour puts the whole batch on the
sampler's non-greedy path, which is not the constraint's cost: each pair differs
by the constraint alone). Reported: the 15 requests' generated tokens per second
of wall time (median of rounds, arms alternating) and the ratios (median over
rounds of the ratio within a round).

Part 3, the sampler alone (what the engine numbers hide on a busy host): one step of
16 greedy rows over random logits with 0, 1 or 16 rows constrained to a JSON object,
on the built-in model's vocabulary and on the 151,936-token one.

Writes ``benches/results/bench_structured.json``.

Run: ``.venv/bin/python benches/bench_structured.py [--steps 48] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import string
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import llguidance
import torch
from ec_frontend.engine.async_engine import AsyncEngine
from ec_frontend.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from ec_frontend.engine.sampler import Sampler, SamplingRow
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.structured_output import (
    JSON_OPTIONS,
    BitmaskFiller,
    CompiledGrammar,
    GrammarCompiler,
    bitmask_width,
    unpack_bitmask,
)
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
VOCAB = 151_936
EOS = VOCAB - 1

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,3}$"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        },
        "required": ["name", "age", "email", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "invoice": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "lines": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "item": {"type": "string", "maxLength": 24},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "price": {"type": "number", "minimum": 0, "maximum": 10000},
                    },
                    "required": ["item", "qty", "price"],
                    "additionalProperties": False,
                },
                "maxItems": 8,
            },
            "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
        },
        "required": ["invoice", "lines", "currency"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "caption": {"type": "string"},
            "objects": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "label": {"type": "string"},
                        "box": {
                            "type": "array",
                            "items": {"type": "integer", "minimum": 0, "maximum": 4096},
                            "minItems": 4,
                            "maxItems": 4,
                        },
                        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                    },
                    "required": ["label", "box"],
                },
            },
        },
        "required": ["caption", "objects"],
    },
    {"type": "object"},
]


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    """Byte tokens, then BPE-like pieces until ``size`` (the last one is EOS)."""
    rng = random.Random(seed)
    tokens = [bytes([i]) for i in range(256)]
    seen = set(tokens)
    punct = ['":', '",', '"},', '{"', '"}', "],", "[{", "}}", ", ", ": ", ".\n", "\n\n", "://"]
    while len(tokens) < size - 1:
        roll = rng.random()
        if roll < 0.75:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
            form = rng.random()
            if form < 0.5:
                word = " " + word
            elif form < 0.6:
                word = word.capitalize()
            elif form < 0.65:
                word = " " + word.capitalize()
        elif roll < 0.85:
            word = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 3)))
        elif roll < 0.95:
            word = rng.choice(punct) + "".join(
                rng.choice(string.ascii_lowercase) for _ in range(rng.randint(0, 4))
            )
        else:
            word = "".join(rng.choice(string.punctuation + " ") for _ in range(rng.randint(2, 4)))
        piece = word.encode()
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
    tokens.append(b"<|endoftext|>")
    return tokens


class _ByteTokenizer:
    """What llguidance's ``TokenizerWrapper`` asks of a tokenizer: the token bytes and
    a tokenize function (bytes -> byte tokens: exact, if not the shortest)."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens = tokens
        self.eos_token_id = len(tokens) - 1
        self.bos_token_id = None
        self.special_token_ids = [self.eos_token_id]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def _pick(mask: torch.Tensor, vocab: int, gen: torch.Generator) -> list[int]:
    allowed = unpack_bitmask(mask, vocab).float()
    return torch.multinomial(allowed, 1, generator=gen).flatten().tolist()


def bench_llguidance(tokens: list[bytes], batch: int, steps: int) -> dict[str, Any]:
    tok = LLTokenizer(TokenizerWrapper(_ByteTokenizer(tokens)), n_vocab=len(tokens))
    t0 = time.perf_counter()
    grammars = [
        LLMatcher.grammar_from_json_schema(SCHEMAS[i % len(SCHEMAS)], defaults=JSON_OPTIONS)
        for i in range(len(SCHEMAS))
    ]
    for g in grammars:
        if LLMatcher.validate_grammar(g, tok):
            raise RuntimeError("schema rejected")
    compile_s = (time.perf_counter() - t0) / len(grammars)
    matchers = [LLMatcher(tok, grammars[i % len(grammars)]) for i in range(batch)]
    executor = llguidance.LLExecutor()
    mask = torch.empty((batch, bitmask_width(len(tokens))), dtype=torch.int32)
    gen = torch.Generator().manual_seed(batch)
    times: list[float] = []
    for _ in range(steps):
        work = [(m, i) for i, m in enumerate(matchers)]
        t = time.perf_counter()
        executor.unsafe_compute_mask_ptr(work, mask.data_ptr(), mask.shape[1] * 4, batch)
        times.append(time.perf_counter() - t)
        for m, token in zip(matchers, _pick(mask, len(tokens), gen), strict=True):
            if token == EOS or m.is_stopped():
                m.reset()
            elif not m.consume_token(token):
                raise RuntimeError(m.get_error())
    return _summary(times, compile_s)


def bench_xgrammar(tokens: list[bytes], batch: int, steps: int) -> dict[str, Any] | None:
    try:
        import xgrammar as xgr  # type: ignore[import-not-found]
    except ImportError:
        return None
    # RAW vocabularies are text: a byte token above 127 stands in as its Latin-1 letter.
    vocab = [t.decode("latin-1") if len(t) == 1 else t.decode() for t in tokens]
    info = xgr.TokenizerInfo(
        vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[EOS]
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = [compiler.compile_json_schema(s, any_whitespace=False) for s in SCHEMAS]
    compile_s = (time.perf_counter() - t0) / len(compiled)
    matchers = [xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(batch)]
    batcher = xgr.BatchGrammarMatcher()
    mask = xgr.allocate_token_bitmask(batch, len(vocab))
    gen = torch.Generator().manual_seed(batch)
    times: list[float] = []
    for _ in range(steps):
        t = time.perf_counter()
        batcher.batch_fill_next_token_bitmask(matchers, mask)
        times.append(time.perf_counter() - t)
        for m, token in zip(matchers, _pick(mask, len(vocab), gen), strict=True):
            if token == EOS or m.is_terminated():
                m.reset()
            elif not m.accept_token(token):
                raise RuntimeError("xgrammar refused a token of its own mask")
    return _summary(times, compile_s)


def _summary(times: list[float], compile_s: float) -> dict[str, Any]:
    ordered = sorted(times)
    return {
        "mask_ms_median": 1000 * statistics.median(ordered),
        "mask_ms_p99": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "mask_ms_mean": 1000 * statistics.fmean(ordered),
        "compile_ms_per_schema": 1000 * compile_s,
        "steps": len(times),
    }


async def engine_round(
    engine: AsyncEngine,
    inputs: Any,
    side: tuple[Any, float] | None,
    n: int,
    max_tokens: int,
    tag: str,
) -> float:
    """Unconstrained tokens/s of ``n`` greedy requests; ``side`` adds one more request
    beside them for the whole round: ``(grammar or None, temperature)``."""
    tokens = 0
    done = asyncio.Event()

    async def free(i: int) -> None:
        nonlocal tokens
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for out in engine.add_request(f"{tag}-{i}", inputs, params):
            tokens += len(out.token_ids)

    async def beside(grammar: Any, temperature: float) -> None:
        params = SamplingParams(
            max_tokens=4 * max_tokens, temperature=temperature, seed=1, ignore_eos=grammar is None
        )
        params.structured_outputs = grammar
        agen = engine.add_request(f"{tag}-side", inputs, params)
        try:
            async for out in agen:
                if out.finished or done.is_set():
                    break
        finally:
            await agen.aclose()
            await engine.abort(f"{tag}-side")

    task = asyncio.ensure_future(beside(*side)) if side is not None else None
    await asyncio.sleep(0)
    start = time.perf_counter()
    await asyncio.gather(*(free(i) for i in range(n)))
    seconds = time.perf_counter() - start
    done.set()
    if task is not None:
        await task
    if tokens != n * max_tokens:
        raise RuntimeError(f"generated {tokens} tokens")
    return tokens / seconds


def sampler_step_ms(
    grammar: CompiledGrammar, vocab: int, constrained: int, steps: int
) -> dict[str, float]:
    """Median times of one sampling step for 16 greedy rows over random logits,
    ``constrained`` of them under ``grammar``: ``exposed`` (bitmask started, then the
    sampler waits for it: no forward to hide it behind) and ``overlapped`` (the
    bitmask ready before the sampler runs, as when the forward takes longer)."""
    params = SamplingParams(temperature=0.0, max_tokens=None)
    gen = torch.Generator().manual_seed(0)
    filler = BitmaskFiller()
    eos = set(grammar.tokenizer.eos_tokens)
    outputs: list[list[int]] = [[] for _ in range(16)]
    states = [grammar.new_state() if i < constrained else None for i in range(16)]
    sampler = Sampler()
    times: dict[str, list[float]] = {"exposed": [], "overlapped": []}
    try:
        for step in range(steps):
            mode = "exposed" if step % 2 == 0 else "overlapped"
            logits = torch.randn(16, vocab, generator=gen)
            rows = [SamplingRow(params, None, [1], outputs[i], (), states[i]) for i in range(16)]
            t = time.perf_counter()
            future = filler.start(states, outputs, vocab)
            if mode == "overlapped" and isinstance(future, Future):
                future.result()
                t = time.perf_counter()
            tokens, _ = sampler(logits, rows, future)
            times[mode].append(time.perf_counter() - t)
            for i in range(constrained):
                state = states[i]
                if tokens[i] in eos or (state is not None and state.is_finished()):
                    states[i], outputs[i] = grammar.new_state(), []
                else:
                    outputs[i].append(tokens[i])
    finally:
        filler.shutdown()
    return {mode: 1000 * statistics.median(v) for mode, v in times.items()}


def bench_sampler(tokens: list[bytes], builtin: GrammarCompiler, steps: int) -> dict[str, Any]:
    """The sampler's step with 0, 1 and 16 constrained rows out of 16, on the built-in
    vocabulary and on the 151,936-token one (any JSON object)."""
    big = LLTokenizer(TokenizerWrapper(_ByteTokenizer(tokens)), n_vocab=len(tokens))
    any_object = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    grammars = {
        str(builtin.vocab_size): builtin.compile("json_object", None, "p"),
        str(len(tokens)): CompiledGrammar("json_object", any_object, big),
    }
    out: dict[str, Any] = {}
    for vocab, grammar in grammars.items():
        out[vocab] = {}
        for k in (0, 1, 16):
            ms = sampler_step_ms(grammar, int(vocab), k, steps)
            out[vocab][f"{k}_of_16"] = ms
            print(
                f"  vocab {vocab:>6}, {k:2d}/16 constrained: {ms['exposed']:7.3f} ms exposed, "
                f"{ms['overlapped']:7.3f} ms with the mask ready"
            )
    return out


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(
        model=None,
        device=args.device,
        dtype="float32",
        scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=2048),
        cache=CacheConfig(kv_cache_memory_bytes=128 << 20),
    )
    engine = AsyncEngine.from_config(config)
    processor = engine.processor
    assert processor is not None
    inputs = processor.process_chat([{"role": "user", "content": "Describe a cat as JSON."}], [])
    eos = engine.core.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    compiler = GrammarCompiler(processor.tokenizer, processor.vocab_size, eos_ids)
    grammar = compiler.compile("json_object", None, "response_format")
    t = time.perf_counter()
    compiler.compile("json", SCHEMAS[1], "p")
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(100):
        compiler.compile("json", SCHEMAS[1], "p")
    cache = {"first_ms": 1000 * first, "cached_us": 1e6 * (time.perf_counter() - t) / 100}
    # The side request: constrained or not, greedy or sampled. A sampled neighbour
    # moves the whole batch onto the sampler's non-greedy path, constraint or not.
    arms: dict[str, tuple[Any, float] | None] = {
        "beside_free_greedy": (None, 0.0),
        "beside_constrained_greedy": (grammar, 0.0),
        "beside_free_sampled": (None, 1.0),
        "beside_constrained_sampled": (grammar, 1.0),
    }
    rounds: dict[str, list[float]] = {arm: [] for arm in arms}
    try:

        async def run() -> None:
            await engine_round(engine, inputs, (grammar, 0.0), 2, 8, "warm")
            await engine_round(engine, inputs, None, 2, 8, "warm-free")
            names = list(arms)
            for r in range(args.rounds):
                for arm in names if r % 2 == 0 else names[::-1]:
                    tps = await engine_round(
                        engine, inputs, arms[arm], 15, args.max_tokens, f"r{r}{arm}"
                    )
                    rounds[arm].append(tps)
                    print(f"  round {r} {arm:25s} {tps:8.1f} unconstrained tok/s")

        asyncio.run(run())
    finally:
        engine.shutdown()
    print("sampler: one step of 16 greedy rows (bitmask, masks, argmax)")
    sampler_steps = bench_sampler(args.tokens, compiler, args.sampler_steps)
    median = {k: statistics.median(v) for k, v in rounds.items()}

    def paired(arm: str, base: str) -> float:
        """Median over rounds of the arm's ratio to its base in the same round (the
        host's load drifts between rounds more than within one)."""
        return statistics.median(a / b for a, b in zip(rounds[arm], rounds[base], strict=True))

    return {
        "unconstrained_requests": 15,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "unconstrained_tok_s": median,
        "rounds_tok_s": rounds,
        "ratio_constrained_vs_free_greedy": paired(
            "beside_constrained_greedy", "beside_free_greedy"
        ),
        "ratio_constrained_vs_free_sampled": paired(
            "beside_constrained_sampled", "beside_free_sampled"
        ),
        "compile_cache_builtin_tokenizer": cache,
        "sampler_step": sampler_steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=48, help="decode steps per mask measurement")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sampler-steps", type=int, default=300)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--skip-mask", action="store_true", help="skip part 1 (the library)")
    ap.add_argument("--output", type=Path, default=RESULTS / "bench_structured.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    print(f"building a {VOCAB}-token synthetic vocabulary ...")
    tokens = synthetic_vocab(VOCAB)
    args.tokens = tokens
    masks: dict[str, dict[str, Any]] = {}
    for batch in () if args.skip_mask else (int(b) for b in args.batches.split(",")):
        for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            result = fn(tokens, batch, args.steps)
            if result is None:
                print(f"  {name}: not importable, skipped")
                continue
            masks.setdefault(name, {})[str(batch)] = result
            print(
                f"  {name:10s} batch {batch:2d}: mask {result['mask_ms_median']:7.2f} ms/step "
                f"median, {result['mask_ms_p99']:7.2f} p99; compile "
                f"{result['compile_ms_per_schema']:7.1f} ms/schema"
            )
    print("engine: 15 unconstrained requests, alone and beside one constrained request")
    engine = bench_engine(args)
    tps = engine["unconstrained_tok_s"]
    print(
        f"  unconstrained tok/s (median), the 16th request greedy: free "
        f"{tps['beside_free_greedy']:.1f}, constrained {tps['beside_constrained_greedy']:.1f} "
        f"({engine['ratio_constrained_vs_free_greedy']:.3f}x); sampled: free "
        f"{tps['beside_free_sampled']:.1f}, constrained {tps['beside_constrained_sampled']:.1f} "
        f"({engine['ratio_constrained_vs_free_sampled']:.3f}x)"
    )
    result = {
        "benchmark": "bench_structured",
        "vocab_size": VOCAB,
        "schemas": len(SCHEMAS),
        "mask": masks,
        "engine": engine,
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "llguidance": llguidance.__version__,
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
