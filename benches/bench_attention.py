"""Attention backends on a mid-size language model: the 4-D SDPA path vs the previous
gather path, in one run, on whatever device torch picks (``--device``).

The model is :class:`~ec_frontend.model.qwen2_text.Qwen2TextModel` with random
weights (hidden 1024, 16 heads, 4 KV heads, 8 layers by default), float32 on the
CPU. Two measurements per backend, alternating backends each round, median of
the rounds:

* prefill: one fresh prompt of ``--prompt`` tokens in a single step, and the same
  prompt in chunks of ``--chunk`` tokens (continuation chunks over the cache);
* decode: ``--concurrency`` requests with ``--context``-token contexts, one
  token each per step for ``--steps`` steps (logits included); tokens per second.

Writes ``benches/results/bench_attention.json``.

Run: ``.venv/bin/python benches/bench_attention.py [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from ec_frontend.model.interface import AttentionMetadata
from ec_frontend.model.qwen2_text import Qwen2TextModel, TextModelConfig

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"
BLOCK_SIZE = 16


class Driver:
    """Block tables and step metadata for a few requests on one KV cache."""

    def __init__(self, model: Qwen2TextModel, num_blocks: int, device: torch.device) -> None:
        cfg = model.cfg
        shape = (2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        dtype = model.embed_tokens.weight.dtype
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.model, self.device = model, device
        self.free = list(range(num_blocks - 1, 0, -1))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, batch: list[tuple[int, int]]) -> torch.Tensor:
        """One forward over ``(request, new_tokens)`` entries; logits of each last token."""
        starts, seq_lens, query_lens, tables, slots = [0], [], [], [], []
        for rid, new in batch:
            cached = self.lens.get(rid, 0)
            total = cached + new
            blocks = self.tables.setdefault(rid, [])
            while len(blocks) * BLOCK_SIZE < total:
                blocks.append(self.free.pop())
            slots += [
                blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, total)
            ]
            self.lens[rid] = total
            starts.append(starts[-1] + new)
            seq_lens.append(total)
            query_lens.append(new)
            tables.append(blocks)
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            query_lens=torch.tensor(query_lens, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            block_size=BLOCK_SIZE,
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
        )
        ids = torch.randint(0, self.model.cfg.vocab_size, (starts[-1],), device=dev)
        positions = torch.cat(
            [torch.arange(s - q, s, device=dev) for s, q in zip(seq_lens, query_lens, strict=True)]
        )
        hidden = self.model(self.model.embed_tokens(ids), positions.expand(3, -1), self.kv, meta)
        last = torch.tensor(starts[1:], device=dev) - 1
        return self.model.logits(hidden[last])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_s(model: Qwen2TextModel, prompt: int, chunk: int, device: torch.device) -> float:
    driver = Driver(model, prompt // BLOCK_SIZE + 2, device)
    _sync(device)
    start = time.perf_counter()
    done = 0
    while done < prompt:
        n = min(chunk, prompt - done)
        driver.step([(0, n)])
        done += n
    _sync(device)
    return time.perf_counter() - start


def decode_tok_s(
    model: Qwen2TextModel, concurrency: int, context: int, steps: int, device: torch.device
) -> float:
    blocks = concurrency * ((context + steps) // BLOCK_SIZE + 2) + 1
    driver = Driver(model, blocks, device)
    for rid in range(concurrency):
        # Contexts of different lengths, as in a real batch.
        driver.step([(rid, context - 16 * rid)])
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        driver.step([(rid, 1) for rid in range(concurrency)])
    _sync(device)
    return concurrency * steps / (time.perf_counter() - start)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The device and shape flags of :func:`random_text_model`."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)


def random_text_model(args: argparse.Namespace) -> Qwen2TextModel:
    """A Qwen2 language model with random weights (seed 0) of the flags' shape."""
    torch.manual_seed(0)
    head_dim = args.hidden // args.heads
    quarter = head_dim // 4
    cfg = TextModelConfig(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        mrope_section=(head_dim // 2 - 2 * quarter, quarter, quarter),
        tie_word_embeddings=True,
    )
    model = Qwen2TextModel(cfg).to(device=torch.device(args.device))
    return model.to(dtype=getattr(torch, args.dtype)).eval()


def usable_backends(device: torch.device) -> tuple[str, ...]:
    """``triton`` compiles for CUDA only (on the CPU it needs Triton's interpreter).

    Imported here, not at the top: ``bench_engine`` imports this module's model
    helpers into trees older than the attention backends."""
    from ec_frontend.model.paged_attention import BACKENDS
    from ec_frontend.model.triton_decode import triton_available

    if device.type == "cuda" and triton_available():
        return BACKENDS
    return tuple(b for b in BACKENDS if b != "triton")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", type=Path, default=RESULTS / "bench_attention.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    model = random_text_model(args)
    backends = usable_backends(device)
    cases = {
        "prefill_s": lambda: prefill_s(model, args.prompt, args.prompt, device),
        "chunked_prefill_s": lambda: prefill_s(model, args.prompt, args.chunk, device),
        "decode_tok_s": lambda: decode_tok_s(
            model, args.concurrency, args.context, args.steps, device
        ),
    }
    samples: dict[str, dict[str, list[float]]] = {b: {c: [] for c in cases} for b in backends}
    with torch.inference_mode():
        for backend in backends:  # warm-up
            model.attention_backend = backend
            prefill_s(model, 256, 128, device)
            decode_tok_s(model, 2, 64, 2, device)
        for r in range(args.rounds):
            order = backends if r % 2 == 0 else backends[::-1]
            for backend in order:
                model.attention_backend = backend
                for name, run in cases.items():
                    samples[backend][name].append(run())
    median = {
        b: {c: statistics.median(v) for c, v in cases_.items()} for b, cases_ in samples.items()
    }
    new, old = median["sdpa"], median["gather"]
    ratios = {
        "prefill_speedup": old["prefill_s"] / new["prefill_s"],
        "chunked_prefill_speedup": old["chunked_prefill_s"] / new["chunked_prefill_s"],
        "decode_speedup": new["decode_tok_s"] / old["decode_tok_s"],
    }
    if "triton" in median:
        ratios["triton_decode_vs_sdpa"] = median["triton"]["decode_tok_s"] / new["decode_tok_s"]
    result: dict[str, Any] = {
        "config": {**vars(args), "output": str(args.output), "block_size": BLOCK_SIZE},
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "median": median,
        "samples": samples,
        "ratios": ratios,
    }
    for backend in backends:
        m = median[backend]
        print(
            f"{backend:7s} prefill {args.prompt} tok: {m['prefill_s']:.3f} s  "
            f"chunked ({args.chunk}): {m['chunked_prefill_s']:.3f} s  "
            f"decode x{args.concurrency}: {m['decode_tok_s']:.1f} tok/s"
        )
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
