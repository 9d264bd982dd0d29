"""Engine step overhead: this tree's engine against earlier revisions, in one run.

Each variant is a source tree: ``new`` is this checkout; ``--baseline`` and
``--original`` name git revisions whose ``python/`` is extracted to a temporary
directory (with this checkout's built ``_core`` extension). Every measurement
runs in a fresh process on one variant, variants alternating each round, so all
of them see the same host in the same minutes; medians are reported.

A worker drives the whole engine (``EngineCore``: scheduler, KV cache manager,
model runner, sampler) in its own thread over a mid-size language model with
random weights (seed 0: hidden 1024, 16 heads, 4 KV heads, 8 layers, float32 on
the CPU by default), without prefix caching:

* prefill: the time to the first token of one fresh ``--prompt``-token prompt
  (one step at the default ``max_num_batched_tokens`` of 2048);
* decode: ``--concurrency`` requests with prompts of ``--context`` tokens (8 fewer
  for each next one), ``--steps`` greedy tokens each; output tokens per second
  over the steps after every request has its first token.

The model and its runner wrapper come from ``bench_attention`` and
``bench_prefix`` beside this file, imported inside each variant's tree.

Every variant must produce the same tokens (checked, reported as
``tokens_identical``). Writes ``benches/results/bench_engine.json``.

Run: ``.venv/bin/python benches/bench_engine.py --baseline REV [--original REV] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"


# ---- worker (runs inside one variant's tree) ---------------------------------


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench_attention import random_text_model
    from bench_prefix import TextModel, text_inputs
    from ec_frontend.config import CacheConfig, EngineConfig, SchedulerConfig
    from ec_frontend.engine.core import EngineCore
    from ec_frontend.engine.sampling_params import SamplingParams

    device = torch.device(args.device)
    model = TextModel(random_text_model(args), device)

    max_len = max(4096, args.prompt + 8, args.context + args.steps + 8)
    blocks = (args.concurrency + 1) * (max_len // 16 + 1) + 1
    cache_kw: dict[str, Any] = {"num_kv_blocks": blocks}
    if "enable_prefix_caching" in {f.name for f in dataclasses.fields(CacheConfig)}:
        cache_kw["enable_prefix_caching"] = False
    core = EngineCore(
        EngineConfig(
            device=args.device,
            dtype=args.dtype,
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_model_len=max_len),
            cache=CacheConfig(**cache_kw),
        ),
        model,
    )

    def run(prompts: dict[str, list[int]], max_tokens: int) -> tuple[dict[str, list[float]], Any]:
        """Token arrival times per request, and the tokens."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        for rid, ids in prompts.items():
            core.add_request(rid, text_inputs(ids), params)
        times: dict[str, list[float]] = {rid: [] for rid in prompts}
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        while core.has_work():
            for out in core.step():
                if out.error:
                    raise RuntimeError(out.error)
                now = time.perf_counter() - start
                times[out.request_id] += [now] * len(out.token_ids)
                tokens[out.request_id] += out.token_ids
        return times, tokens

    gen = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, 8000, (n,), generator=gen).tolist()

    with torch.inference_mode():
        run({"warm": prompt(64)}, 4)
        times, prefill_tokens = run({"prefill": prompt(args.prompt)}, 1)
        prefill_s = times["prefill"][0]
        prompts = {f"d{i}": prompt(args.context - 8 * i) for i in range(args.concurrency)}
        times, decode_tokens = run(prompts, args.steps)
    all_first = max(t[0] for t in times.values())
    later = [x for t in times.values() for x in t if x > all_first]
    decode_tok_s = len(later) / (max(later) - all_first)
    return {
        "prefill_s": prefill_s,
        "decode_tok_s": decode_tok_s,
        "tokens": {**prefill_tokens, **decode_tokens},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


# ---- driver --------------------------------------------------------------------


def _extract(rev: str, into: Path) -> Path:
    """``rev``'s ``python/`` tree under ``into``, with this checkout's extension."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "python"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for lib in glob.glob(str(ROOT / "python" / "ec_frontend" / "_core*.so")):
        shutil.copy(lib, into / "python" / "ec_frontend")
    return into / "python"


def _run_worker(python_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    flags = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in (
            "device",
            "dtype",
            "hidden",
            "heads",
            "kv_heads",
            "layers",
            "prompt",
            "concurrency",
            "context",
            "steps",
        )
    ]
    benches = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(python_path), str(benches)])}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", *flags],
        env=env,
        capture_output=True,
        text=True,
        cwd=str(python_path.parent),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker on {python_path} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _revision(rev: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", help="git revision of the engine before this work")
    ap.add_argument("--original", help="git revision of the engine the issue measured")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", type=Path, default=RESULTS / "bench_engine.json")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return

    revisions = {"baseline": args.baseline, "original": args.original}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        trees = {"new": ROOT / "python"}
        for name, rev in revisions.items():
            if rev:
                trees[name] = _extract(rev, Path(tmp) / name)
        names = list(trees)
        samples: dict[str, dict[str, list[float]]] = {
            n: {"prefill_s": [], "decode_tok_s": []} for n in names
        }
        tokens: dict[str, Any] = {}
        loadavg = []
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                result = _run_worker(trees[name], args)
                samples[name]["prefill_s"].append(result["prefill_s"])
                samples[name]["decode_tok_s"].append(result["decode_tok_s"])
                tokens.setdefault(name, result["tokens"])
                loadavg.append(os.getloadavg()[0])
                print(
                    f"round {r} {name:9s} prefill {result['prefill_s']:7.3f} s   "
                    f"decode x{args.concurrency} {result['decode_tok_s']:7.1f} tok/s",
                    flush=True,
                )
    median = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    ratios: dict[str, float] = {}
    for name in names[1:]:
        old, new = median[name], median["new"]
        ratios[f"prefill_speedup_vs_{name}"] = old["prefill_s"] / new["prefill_s"]
        ratios[f"decode_speedup_vs_{name}"] = new["decode_tok_s"] / old["decode_tok_s"]
    identical = all(tokens[n] == tokens["new"] for n in names)
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "worker"},
        "revisions": {n: _revision(r) for n, r in revisions.items() if r},
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_during_run": loadavg,
        },
        "median": median,
        "samples": samples,
        "ratios": ratios,
        "tokens_identical": identical,
    }
    result["config"]["output"] = str(args.output)
    for name in names:
        m = median[name]
        print(
            f"{name:9s} prefill {args.prompt} tok: {m['prefill_s']:.3f} s   "
            f"decode x{args.concurrency}: {m['decode_tok_s']:.1f} tok/s"
        )
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    print(f"tokens identical across variants: {identical}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
