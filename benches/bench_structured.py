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

Part 2, the engine, at batch 8 and 32 (``--batches``): ``b - 1`` unconstrained
greedy requests on the built-in model and one more beside them, constrained by a JSON
schema or free; all run ``--max-tokens`` tokens, so both arms keep ``b`` rows from
the first step to the last. The arms alternate within each round (and swap order
every other round), since the host's load drifts between rounds more than within
one. Reported per batch size: the unconstrained requests' tokens/s in each arm, the
ratio constrained/free within each round (median, quartiles, range), and the
bitmask time per step on the engine's own thread (computed inline, or waited for).

Part 3, the sampler alone on the 151,936-token vocabulary: one step of ``b`` greedy
rows over random logits with 0, 1 or ``b`` rows constrained to a JSON object, the
configurations taking turns step by step.

Writes ``benches/results/bench_structured.json``.

Run: ``.venv/bin/python benches/bench_structured.py [--steps 48] [--rounds 15]``.
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
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import llguidance
import torch
from ec_frontend.config import CacheConfig, EngineConfig, SchedulerConfig
from ec_frontend.engine.async_engine import AsyncEngine
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


#: The constrained neighbour's schema: fields with structure (a number, an enum
#: array) and then a string long enough that no output ends before ``max_tokens``,
#: so that the constrained and the free neighbour stay in the batch equally long.
SIDE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "text": {"type": "string", "minLength": 1000},
    },
    "required": ["id", "tags", "text"],
    "additionalProperties": False,
}


def _spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and range of per-round values."""
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    return {
        "median": statistics.median(ordered),
        "p25": q[0],
        "p75": q[2],
        "min": ordered[0],
        "max": ordered[-1],
    }


class MaskClock:
    """Wraps the runner's :class:`BitmaskFiller`: per step, the time the engine's own
    thread spent on the bitmask (computing it inline, or waiting for the worker)."""

    def __init__(self, filler: BitmaskFiller) -> None:
        self.filler = filler
        self.exposed: list[float] = []
        self._step = 0.0

    def start(self, states: Any, outputs: Any, vocab_size: int) -> Any:
        t = time.perf_counter()
        result = self.filler.start(states, outputs, vocab_size)
        self._step = time.perf_counter() - t
        if not isinstance(result, Future):
            if result is not None:
                self.exposed.append(self._step)
            return result
        timed: Future[torch.Tensor] = Future()

        def wait(_: Any = None) -> torch.Tensor:
            t0 = time.perf_counter()
            value = result.result()
            self.exposed.append(self._step + time.perf_counter() - t0)
            return value

        timed.result = wait  # type: ignore[method-assign,assignment]
        return timed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.filler, name)


async def engine_round(
    engine: AsyncEngine, inputs: Any, grammar: Any, n: int, max_tokens: int, tag: str
) -> tuple[float, float]:
    """Tokens per second of wall time and per second of this process's CPU time
    (all its threads) of ``n - 1`` unconstrained greedy requests (``ignore_eos``)
    beside one more, constrained by ``grammar`` or free (``None``); all ``n`` run
    ``max_tokens`` tokens, so the batch holds ``n`` rows from the first step to the
    last. CPU time is what other processes on a shared host disturb least."""
    tokens = 0

    async def run(i: int) -> None:
        nonlocal tokens
        side = i == n - 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if side:
            params.structured_outputs = grammar
        got = 0
        async for out in engine.add_request(f"{tag}-{i}", inputs, params):
            got += len(out.token_ids)
        if got != max_tokens:
            raise RuntimeError(f"request {i} generated {got} of {max_tokens} tokens")
        if not side:
            tokens += got

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(run(i) for i in range(n)))
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


#: ``--model mid-size``: the built-in tokenizer and processor with a decoder of hidden
#: 1024 and 8 layers (about 110M parameters, dummy weights), whose step costs about
#: what a real model's does relative to the grammar's per-token work.
MID_SIZE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "rope_scaling": {"mrope_section": [8, 12, 12], "type": "mrope"},  # head_dim 64
    "vision": {"depth": 2, "embed_dim": 128, "hidden_size": 1024, "num_heads": 4},
}


def engine_config(args: argparse.Namespace, tmp: Path) -> EngineConfig:
    """The built-in model, or (``--model mid-size``) :data:`MID_SIZE` with dummy weights."""
    model, load_format = None, "auto"
    if args.model == "mid-size":
        from bench_engine_proc import mid_size_checkpoint
        from ec_frontend.model.builtin import ensure_builtin_checkpoint

        model = str(mid_size_checkpoint(ensure_builtin_checkpoint(), tmp / "mid", MID_SIZE))
        load_format = "dummy"
    return EngineConfig(
        model=model,
        load_format=load_format,
        device=args.device,
        dtype="float32",
        scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=2048),
        cache=CacheConfig(kv_cache_memory_bytes=256 << 20),
    )


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    """Unconstrained tokens/s beside a constrained vs a free neighbour, at each batch
    size, in alternating rounds; per-step bitmask time on the engine's thread."""
    with tempfile.TemporaryDirectory() as tmp:
        config = engine_config(args, Path(tmp))
        return _bench_engine(args, config)


def _bench_engine(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    engine = AsyncEngine.from_config(config)
    processor = engine.processor
    assert processor is not None
    inputs = processor.process_chat([{"role": "user", "content": "Describe a cat as JSON."}], [])
    eos = engine.core.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    compiler = GrammarCompiler(processor.tokenizer, processor.vocab_size, eos_ids)
    grammar = compiler.compile("json", SIDE_SCHEMA, "response_format")
    t = time.perf_counter()
    compiler.compile("json", SCHEMAS[1], "p")
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(100):
        compiler.compile("json", SCHEMAS[1], "p")
    cache = {"first_ms": 1000 * first, "cached_us": 1e6 * (time.perf_counter() - t) / 100}
    runner = engine.core.runner
    clock = MaskClock(runner.bitmask_filler)
    runner.bitmask_filler = clock  # type: ignore[assignment]
    batches = [int(b) for b in args.batches.split(",")]
    rounds: dict[int, dict[str, list[float]]] = {
        b: {"free": [], "constrained": [], "free_cpu": [], "constrained_cpu": []} for b in batches
    }
    exposed: dict[int, list[float]] = {b: [] for b in batches}
    try:

        async def run() -> None:
            for b in batches:
                await engine_round(engine, inputs, grammar, b, 8, f"warm{b}")
                await engine_round(engine, inputs, None, b, 8, f"warm-free{b}")
            for r in range(args.rounds):
                for b in batches:
                    order = ("free", "constrained") if r % 2 == 0 else ("constrained", "free")
                    for arm in order:
                        clock.exposed = []
                        side = grammar if arm == "constrained" else None
                        wall, cpu = await engine_round(
                            engine, inputs, side, b, args.max_tokens, f"r{r}b{b}{arm}"
                        )
                        rounds[b][arm].append(wall)
                        rounds[b][f"{arm}_cpu"].append(cpu)
                        if arm == "constrained":
                            exposed[b].append(statistics.median(clock.exposed))
                    last = {k: v[-1] for k, v in rounds[b].items()}
                    print(
                        f"  round {r:2d} batch {b:2d}: free {last['free']:8.1f}, constrained "
                        f"{last['constrained']:8.1f} tok/s "
                        f"({last['constrained'] / last['free']:.3f}x; per CPU-second "
                        f"{last['constrained_cpu'] / last['free_cpu']:.3f}x), "
                        f"bitmask {1000 * exposed[b][-1]:.3f} ms/step"
                    )

        asyncio.run(run())
    finally:
        engine.shutdown()
    out: dict[str, Any] = {
        "model": args.model,
        "unconstrained_requests_per_batch": {str(b): b - 1 for b in batches},
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "vocab_size": processor.vocab_size,
        "compile_cache_builtin_tokenizer": cache,
        "batches": {},
    }
    for b in batches:
        per = rounds[b]

        def ratios(arm: str, base: str) -> list[float]:
            return [a / f for a, f in zip(per[arm], per[base], strict=True)]  # noqa: B023

        out["batches"][str(b)] = {
            "tok_s_free": _spread(per["free"]),
            "tok_s_constrained": _spread(per["constrained"]),
            "ratio_constrained_vs_free": _spread(ratios("constrained", "free")),
            "tok_per_cpu_s_free": _spread(per["free_cpu"]),
            "tok_per_cpu_s_constrained": _spread(per["constrained_cpu"]),
            "ratio_per_cpu_s_constrained_vs_free": _spread(ratios("constrained_cpu", "free_cpu")),
            "bitmask_ms_per_step_exposed": _spread([1000 * x for x in exposed[b]]),
            "rounds_tok_s": rounds[b],
        }
    return out


def bench_sampler(tokens: list[bytes], batches: list[int], rounds: int) -> dict[str, Any]:
    """One sampling step of ``b`` greedy rows over random logits on the
    151,936-token vocabulary, with 0, 1 or ``b`` rows constrained to a JSON object:
    ``exposed`` (the bitmask started, then the sampler waits for it: no forward to hide
    it) and ``overlapped`` (the bitmask ready before the sampler runs). The
    configurations take turns step by step, so host load falls on all alike."""
    big = LLTokenizer(TokenizerWrapper(_ByteTokenizer(tokens)), n_vocab=len(tokens))
    any_object = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    grammar = CompiledGrammar("json_object", any_object, big)
    vocab = len(tokens)
    params = SamplingParams(temperature=0.0, max_tokens=None)
    sampler = Sampler()
    eos = set(big.eos_tokens)
    out: dict[str, Any] = {}
    for b in batches:
        configs = sorted({0, 1, b})
        filler = BitmaskFiller()
        states = {k: [grammar.new_state() if i < k else None for i in range(b)] for k in configs}
        outputs: dict[int, list[list[int]]] = {k: [[] for _ in range(b)] for k in configs}
        times: dict[int, dict[str, list[float]]] = {
            k: {"exposed": [], "overlapped": []} for k in configs
        }
        gen = torch.Generator().manual_seed(b)
        try:
            for step in range(2 * rounds):
                mode = "exposed" if step % 2 == 0 else "overlapped"
                logits = torch.randn(b, vocab, generator=gen)
                for k in configs:
                    st, outs = states[k], outputs[k]
                    rows = [SamplingRow(params, None, [1], outs[i], (), st[i]) for i in range(b)]
                    work = logits.clone()  # the runner hands over logits it does not reuse
                    t = time.perf_counter()
                    future = filler.start(st, outs, vocab)
                    if mode == "overlapped" and isinstance(future, Future):
                        future.result()
                        t = time.perf_counter()
                    chosen, _ = sampler(work, rows, future, logits_writable=True)
                    times[k][mode].append(time.perf_counter() - t)
                    for i in range(k):
                        state = st[i]
                        if chosen[i] in eos or (state is not None and state.is_finished()):
                            st[i], outs[i] = grammar.new_state(), []
                        else:
                            outs[i].append(chosen[i])
        finally:
            filler.shutdown()
        res = {
            f"{k}_of_{b}": {m: 1000 * statistics.median(v) for m, v in times[k].items()}
            for k in configs
        }
        out[str(b)] = res
        for k in configs:
            ms = res[f"{k}_of_{b}"]
            print(
                f"  batch {b:2d}, {k:2d} constrained: {ms['exposed']:7.3f} ms exposed, "
                f"{ms['overlapped']:7.3f} ms with the mask ready"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=48, help="decode steps per mask measurement")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sampler-rounds", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--model", choices=("builtin", "mid-size"), default="builtin", help="part 2's model"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--skip-mask", action="store_true", help="skip part 1 (the library)")
    ap.add_argument("--output", type=Path, default=RESULTS / "bench_structured.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    print(f"building a {VOCAB}-token synthetic vocabulary ...")
    tokens = synthetic_vocab(VOCAB)
    masks: dict[str, dict[str, Any]] = {}
    for batch in () if args.skip_mask else batches:
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
    print("engine: b-1 unconstrained requests beside one constrained or free request")
    engine = bench_engine(args)
    for b, res in engine["batches"].items():
        r = res["ratio_constrained_vs_free"]
        c = res["ratio_per_cpu_s_constrained_vs_free"]
        m = res["bitmask_ms_per_step_exposed"]
        print(
            f"  batch {b:>2}: unconstrained tok/s free {res['tok_s_free']['median']:.1f}, "
            f"constrained {res['tok_s_constrained']['median']:.1f}; ratio {r['median']:.3f} "
            f"(p25 {r['p25']:.3f}, p75 {r['p75']:.3f}, range {r['min']:.3f}-{r['max']:.3f}); "
            f"per CPU-second {c['median']:.3f} (p25 {c['p25']:.3f}, p75 {c['p75']:.3f}); "
            f"bitmask {m['median']:.3f} ms/step on the engine thread"
        )
    print(f"sampler: one step over {VOCAB} tokens (bitmask, masks, argmax)")
    sampler_steps = bench_sampler(tokens, batches, args.sampler_rounds)
    result = {
        "benchmark": "bench_structured",
        "vocab_size": VOCAB,
        "schemas": len(SCHEMAS),
        "mask": masks,
        "engine": engine,
        "sampler_step": sampler_steps,
        "host": {
            "cpus": os.cpu_count(),
            "load_avg_1m_at_end": os.getloadavg()[0],
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
