"""Generation throughput with continuous batching: 8 concurrent requests vs 1.

Runs the real engine (``AsyncEngine`` on the built-in model, or ``--model``) in
this process. The same request set (half with an image, half text-only; greedy,
``ignore_eos``, ``--max-tokens`` each) is served at each concurrency level by
``level`` client tasks pulling from a shared queue. Throughput is generated
tokens per second of wall time, so prefill and vision encoding are included.
Rounds alternate the levels; the median round counts. The ratio against
concurrency 1 is measured in the same run.

Torch runs one intra-op thread by default (``--threads``): the built-in model's
matrices are too small to split, and on a busy host more threads only spin.

Writes ``benches/results/bench_batching.json`` and ``bench_batching.png``.

Run: ``.venv/bin/python benches/bench_batching.py [--requests 16] [--max-tokens 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ec_frontend.config import CacheConfig, EngineConfig, SchedulerConfig
from ec_frontend.engine.async_engine import AsyncEngine
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.model.processor import InputProcessor, ProcessedInputs
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"


@dataclass(frozen=True, slots=True)
class Media:
    data: bytes
    mm_hash: str


def image(seed: int) -> Media:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(112, 112, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    data = buf.getvalue()
    return Media(data, hashlib.blake2b(data, digest_size=16).hexdigest())


def build_inputs(processor: InputProcessor, n: int) -> list[ProcessedInputs]:
    out = []
    for i in range(n):
        content: list[dict[str, Any]] = []
        media = []
        if i % 2 == 0:
            content.append({"type": "image", "media_index": 0})
            media.append(image(i))
        content.append({"type": "text", "text": f"Request {i}: describe what you see in detail."})
        out.append(processor.process_chat([{"role": "user", "content": content}], media))
    return out


async def serve(
    engine: AsyncEngine, inputs: list[ProcessedInputs], concurrency: int, max_tokens: int, tag: str
) -> tuple[float, int]:
    """(seconds, generated tokens) to serve every input with ``concurrency`` clients."""
    queue: asyncio.Queue[tuple[int, ProcessedInputs]] = asyncio.Queue()
    for item in enumerate(inputs):
        queue.put_nowait(item)
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while not queue.empty():
            i, x = queue.get_nowait()
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for out in engine.add_request(f"{tag}-{i}", x, params):
                tokens += len(out.token_ids)
                if out.finish_reason not in (None, "length"):
                    raise RuntimeError(f"request {i} ended with {out.finish_reason}: {out.error}")

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: built-in)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch default); the tiny model gains nothing from more, "
        "and on a shared host extra threads only contend",
    )
    ap.add_argument("--output", type=Path, default=RESULTS / "bench_batching.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    if 1 not in levels or 8 not in levels:
        ap.error("--levels must include 1 and 8 (the reported ratio)")

    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        scheduler=SchedulerConfig(max_num_seqs=max(levels), max_model_len=1024),
        cache=CacheConfig(kv_cache_memory_bytes=64 << 20),
    )
    engine = AsyncEngine.from_config(config)
    assert engine.processor is not None
    inputs = build_inputs(engine.processor, args.requests)
    rounds: dict[int, list[float]] = {c: [] for c in levels}
    try:

        async def run_all() -> None:
            await serve(engine, inputs[:2], 2, 8, "warmup")
            for r in range(args.rounds):
                order = levels if r % 2 == 0 else levels[::-1]
                for c in order:
                    seconds, tokens = await serve(engine, inputs, c, args.max_tokens, f"r{r}c{c}")
                    if tokens != args.requests * args.max_tokens:
                        raise RuntimeError(f"generated {tokens} tokens")
                    rounds[c].append(tokens / seconds)
                    print(f"round {r} concurrency {c}: {tokens / seconds:8.1f} tok/s")

        asyncio.run(run_all())
        stats = engine.stats()
    finally:
        engine.shutdown()

    median = {c: statistics.median(v) for c, v in rounds.items()}
    ratio = median[8] / median[1]
    print(f"\nthroughput (median of {args.rounds} rounds, generated tokens/s):")
    for c in levels:
        print(f"  concurrency {c}: {median[c]:8.1f}  ({median[c] / median[1]:.2f}x)")
    print(f"ratio 8 vs 1: {ratio:.2f}x (goal >= 3x)")

    result = {
        "benchmark": "bench_batching",
        "model": args.model or "built-in tiny Qwen2-VL",
        "device": str(engine.core.model.device),
        "dtype": args.dtype,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "throughput_tok_s": {str(c): median[c] for c in levels},
        "rounds_tok_s": {str(c): v for c, v in rounds.items()},
        "ratio_8_vs_1": ratio,
        "engine_steps": stats.engine_steps_total,
        "lm_forward_calls": stats.lm_forward_calls_total,
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    plot(median, args.output.with_suffix(".png"))
    print(f"wrote {args.output}")


def plot(median: dict[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(median)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([str(c) for c in levels], [median[c] for c in levels], color="#4c72b0")
    for i, c in enumerate(levels):
        ax.text(i, median[c], f"{median[c] / median[1]:.1f}x", ha="center", va="bottom")
    ax.set_ylim(0, max(median.values()) * 1.15)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Continuous batching (built-in model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
