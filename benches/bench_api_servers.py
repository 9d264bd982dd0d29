"""Streamed chat against ``ec-frontend serve --api-server-count N``, N side by side.

One server group per count runs at once (each with its own engine process);
rounds alternate between them and the median round counts, so background load
hits every count alike. Each round sends ``--requests`` streamed chat requests at
``--concurrency`` (one connection per concurrent stream, so the kernel spreads
them over the servers) and reports requests/s, output tokens/s and TTFT p50 /
p99, and the ratio of each count's requests/s to the first count's. Writes
``benches/results/bench_api_servers.json``.

Run: ``.venv/bin/python benches/bench_api_servers.py [--counts 1 2] [--rounds 6]
[-- --mock-engine]`` (arguments after ``--`` go to every ``serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(count: int, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--port", str(port)]
    cmd += ["--log-level", "warning", "--api-server-count", str(count), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"--api-server-count {count}: the server did not start")


async def one(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> tuple:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello there, how are you today?"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["delta"].get("content"):
                tokens += 1
                if first is None:
                    first = time.perf_counter() - started
    return first or 0.0, tokens


async def round_(url: str, model: str, concurrency: int, total: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def run() -> tuple:
            async with gate:
                return await one(client, url, model, max_tokens)

        started = time.perf_counter()
        out = await asyncio.gather(*(run() for _ in range(total)))
        wall = time.perf_counter() - started
    ttft = sorted(x[0] for x in out)
    return {
        "requests_per_s": total / wall,
        "output_tokens_per_s": sum(x[1] for x in out) / wall,
        "ttft_p50_ms": 1000 * ttft[len(ttft) // 2],
        "ttft_p99_ms": 1000 * ttft[max(0, int(len(ttft) * 0.99) - 1)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default="mock", help="the model name requests carry")
    p.add_argument("serve_args", nargs="*", help="after --: arguments of every serve")
    args = p.parse_args()
    groups = {count: start(count, args.serve_args) for count in args.counts}
    rounds: dict[int, list[dict]] = {count: [] for count in args.counts}
    try:
        for _, url in groups.values():  # warm-up
            asyncio.run(round_(url, args.model, args.concurrency, args.concurrency, 4))
        for _ in range(args.rounds):
            for count, (_, url) in groups.items():
                result = asyncio.run(
                    round_(url, args.model, args.concurrency, args.requests, args.max_tokens)
                )
                rounds[count].append(result)
    finally:
        for proc, _ in groups.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in groups.values():
            proc.wait(120)
    medians = {
        count: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for count, rs in rounds.items()
    }
    base = medians[args.counts[0]]["requests_per_s"]
    for count, med in medians.items():
        figures = ", ".join(f"{k} {v:.1f}" for k, v in med.items())
        print(f"--api-server-count {count}: {figures}, x{med['requests_per_s'] / base:.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "args": vars(args),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "medians": medians,
        "rounds": rounds,
    }
    (RESULTS / "bench_api_servers.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
