"""Serving latency and throughput of ``ec-frontend serve`` on the built-in model.

Streams chat completions (text plus one 112x112 image, ``max_tokens`` tokens
with ``ignore_eos``) at each concurrency level and reports, per level, TTFT,
TPOT, ITL and end-to-end latency (p50 / p99) and output tokens/s. Starts its own
server process on loopback unless ``--url`` is given. Writes
``benches/results/serving_builtin.json`` and ``serving_builtin.png``.

Run: ``.venv/bin/python benches/bench_serving.py [--concurrency 1 8 32]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from PIL import Image
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"


@dataclass(slots=True)
class Sample:
    ttft: float
    e2e: float
    output_tokens: int
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.output_tokens - 1, 1)


def image_url(size: int = 112) -> str:
    buf = io.BytesIO()
    img = Image.new("RGB", (size, size))
    img.putdata(
        [((x * 7) % 256, (y * 5) % 256, (x + y) % 256) for y in range(size) for x in range(size)]
    )
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(max_tokens: int, i: int, img: str) -> bytes:
    content = [
        {"type": "text", "text": f"request {i}: describe the picture"},
        {"type": "image_url", "image_url": {"url": img}},
    ]
    return json.dumps(
        {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def one(client: httpx.AsyncClient, payload: bytes) -> Sample:
    start = time.perf_counter()
    first = 0.0
    last = 0.0
    itls: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", content=payload) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                now = time.perf_counter()
                if first == 0.0:
                    first = now
                else:
                    itls.append(now - last)
                last = now
    end = time.perf_counter()
    return Sample(first - start, end - start, tokens, itls)


async def level(url: str, concurrency: int, num: int, max_tokens: int, img: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    samples: list[Sample] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num):
        queue.put_nowait(i)
    bar = tqdm(total=num, desc=f"concurrency {concurrency:>2}", unit="req", leave=True)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                samples.append(await one(client, body(max_tokens, i, img)))
                bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    bar.close()

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return 1000 * values[min(len(values) - 1, int(q * len(values)))]

    ttft = [s.ttft for s in samples]
    tpot = [s.tpot for s in samples]
    itl = [x for s in samples for x in s.itls]
    e2e = [s.e2e for s in samples]
    tokens = sum(s.output_tokens for s in samples)
    return {
        "concurrency": concurrency,
        "requests": num,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": num / wall,
        **{f"ttft_{k}_ms": pct(ttft, q) for k, q in (("p50", 0.5), ("p99", 0.99))},
        **{f"tpot_{k}_ms": pct(tpot, q) for k, q in (("p50", 0.5), ("p99", 0.99))},
        **{f"itl_{k}_ms": pct(itl, q) for k, q in (("p50", 0.5), ("p99", 0.99))},
        **{f"e2e_{k}_ms": pct(e2e, q) for k, q in (("p50", 0.5), ("p99", 0.99))},
    }


def launch_server(flags: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``ec-frontend serve FLAGS`` on a free loopback port, once healthy: (process, base URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = [sys.executable, "-m", "ec_frontend.entrypoints.cli"]
    cmd = [*cli, "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    device = ["--device", args.device] if args.device else []
    return launch_server(
        ["--log-level", "warning", "--max-num-seqs", str(max(args.concurrency)), *device]
    )


def plot(levels: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, metric, title in zip(
        axes[:3], ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "E2E latency"), strict=True
    ):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, [lv[f"{metric}_{q}_ms"] for lv in levels], style, label=q)
        if metric == "tpot":
            ax.plot(xs, [lv["itl_p50_ms"] for lv in levels], "^:", label="ITL p50")
        ax.set_title(f"{title} (ms)")
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.legend()
    axes[3].plot(xs, [lv["output_tokens_per_s"] for lv in levels], "o-")
    axes[3].set_title("output tokens/s")
    axes[3].set_xlabel("concurrency")
    axes[3].set_xscale("log", base=2)
    fig.suptitle("ec-frontend serve, built-in tiny Qwen2-VL, streamed chat with one image")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-level", type=int, default=0,
                   help="requests per level (default: max(16, 2 x concurrency))")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default=None)
    p.add_argument("--url", default=None, help="benchmark a running server instead")
    args = p.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    img = image_url()
    levels = []
    try:
        for c in args.concurrency:
            num = args.requests_per_level or max(16, 2 * c)
            # Warm-up: one full wave of the same workload, so that first-seen batch shapes
            # (oneDNN builds kernels per shape on the CPU) do not count.
            asyncio.run(level(url, c, c, args.max_tokens, img))
            result = asyncio.run(level(url, c, num, args.max_tokens, img))
            levels.append(result)
            r = result
            print(
                f"c={c:>2}: TTFT p50 {r['ttft_p50_ms']:.1f} / p99 {r['ttft_p99_ms']:.1f} ms"
                f", TPOT p50 {result['tpot_p50_ms']:.2f} ms, ITL p50 {result['itl_p50_ms']:.2f}"
                f" / p99 {result['itl_p99_ms']:.2f} ms, E2E p50 {result['e2e_p50_ms']:.0f}"
                f" / p99 {result['e2e_p99_ms']:.0f} ms, {result['output_tokens_per_s']:.0f} tok/s"
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "bench_serving",
        "command": "python benches/bench_serving.py " + " ".join(sys.argv[1:]),
        "model": "built-in tiny Qwen2-VL",
        "request": f"streamed chat, text + one 112x112 PNG, max_tokens={args.max_tokens}, "
        "ignore_eos, temperature 0",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "levels": levels,
    }
    (RESULTS / "serving_builtin.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(levels, RESULTS / "serving_builtin.png")
    print("wrote benches/results/serving_builtin.json and serving_builtin.png")


if __name__ == "__main__":
    main()
