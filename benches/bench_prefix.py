"""Multi-turn chat time to first token, with and without prefix caching, in one run.

The engine (scheduler, KV cache manager, model runner, sampler) drives a mid-size
language model with random weights (the ``bench_attention`` shape: hidden 1024,
16 heads, 4 KV heads, 8 layers, float32 on the CPU). Each round is a fresh
conversation: turn 1 is a ``--prompt``-token prompt answered with ``--answer``
tokens; turn 2 is turn 1's prompt, its answer and ``--new`` new tokens, as a chat
client sends it. The time to first token of each turn is measured from
``add_request`` to the first output that carries a token, stepping the core in
this thread. Engines with and without prefix caching alternate each round;
medians are reported with the ratio turn-2 TTFT without / with.

Writes ``benches/results/bench_prefix.json``.

Run: ``.venv/bin/python benches/bench_prefix.py [--rounds 3]`` (from the repository
root; it imports ``bench_attention`` beside it).
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
from bench_attention import add_model_args, random_text_model
from ec_frontend.config import CacheConfig, EngineConfig, SchedulerConfig
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.model.interface import AttentionMetadata, KVCacheSpec, VisionLanguageModel
from ec_frontend.model.processor import ProcessedInputs
from ec_frontend.model.qwen2_text import Qwen2TextModel

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"


class TextModel(VisionLanguageModel):
    """A random-weight language model behind the runner's interface (no vision tower)."""

    def __init__(self, lm: Qwen2TextModel, device: torch.device) -> None:
        cfg = lm.cfg
        self.lm = lm
        self.image_token_id = cfg.vocab_size - 1
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.device = device
        self.dtype = lm.embed_tokens.weight.dtype

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.lm.cfg
        return KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    def encode_images(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError("the benchmark model has no vision tower")

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm.embed_tokens(input_ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.lm(inputs_embeds, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm.logits(hidden_states).float()


def text_inputs(ids: list[int]) -> ProcessedInputs:
    positions = torch.arange(len(ids), dtype=torch.int64).expand(3, -1)
    return ProcessedInputs(ids, [], positions, 0)


def ttft(core: EngineCore, rid: str, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds to the first token, and every token of the answer."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    core.add_request(rid, text_inputs(ids), params)
    first: float | None = None
    tokens: list[int] = []
    while core.has_work():
        for out in core.step():
            if out.request_id == rid:
                tokens += out.token_ids
                if first is None and out.token_ids:
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"request {rid} produced no token")
    return first, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", type=Path, default=RESULTS / "bench_prefix.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    model = TextModel(random_text_model(args), device)
    total = args.prompt + args.answer + args.new + 1
    max_len = max(4096, total)
    blocks = 2 * (max_len // 16 + 1) + 1
    modes = {"prefix_caching": True, "no_prefix_caching": False}
    cores = {
        name: EngineCore(
            EngineConfig(
                device=args.device,
                dtype=args.dtype,
                scheduler=SchedulerConfig(
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len
                ),
                cache=CacheConfig(num_kv_blocks=blocks, enable_prefix_caching=on),
            ),
            model,
        )
        for name, on in modes.items()
    }
    samples: dict[str, dict[str, list[float]]] = {m: {"turn1_s": [], "turn2_s": []} for m in modes}
    identical = True
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for core in cores.values():  # warm-up
            ttft(core, "warm", torch.randint(0, 8000, (64,), generator=gen).tolist(), 2)
        for r in range(args.rounds):
            prompt = torch.randint(0, 8000, (args.prompt,), generator=gen).tolist()
            new = torch.randint(0, 8000, (args.new,), generator=gen).tolist()
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            answers: dict[str, list[int]] = {}
            for name in order:
                core = cores[name]
                t1, answer = ttft(core, f"r{r}t1", prompt, args.answer)
                t2, answers[name] = ttft(core, f"r{r}t2", prompt + answer + new, args.answer)
                samples[name]["turn1_s"].append(t1)
                samples[name]["turn2_s"].append(t2)
            identical &= answers["prefix_caching"] == answers["no_prefix_caching"]
    median = {m: {k: statistics.median(v) for k, v in s.items()} for m, s in samples.items()}
    on, off = median["prefix_caching"], median["no_prefix_caching"]
    stats = cores["prefix_caching"].stats()
    result: dict[str, Any] = {
        "config": {**vars(args), "output": str(args.output), "block_size": 16},
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "loadavg": os.getloadavg(),
        },
        "median": median,
        "samples": samples,
        "ratios": {
            "turn2_ttft_speedup": off["turn2_s"] / on["turn2_s"],
            "turn1_ttft_ratio": off["turn1_s"] / on["turn1_s"],
        },
        "turn2_tokens_identical": identical,
        "prefix_cache": {
            "queries": stats.prefix_cache_queries_total,
            "hits": stats.prefix_cache_hits_total,
        },
    }
    for name in modes:
        m = median[name]
        print(f"{name:18s} turn 1 TTFT {m['turn1_s']:7.3f} s   turn 2 TTFT {m['turn2_s']:7.3f} s")
    print(
        f"turn 2 TTFT without / with prefix caching: {result['ratios']['turn2_ttft_speedup']:.1f}x"
        f" (answers identical: {identical})"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
