"""uvicorn + httptools (what ``ec-frontend serve`` runs) against granian (a Rust HTTP
server for ASGI apps) under the same app, the engine in its own process.

Both servers run ``serve --mock-engine``'s app, built by
``launcher.build_server_app``: uvicorn through ``ec-frontend serve`` itself,
granian through ``benches/granian_app.py`` (one worker, uvloop, its default
runtime threads). Streamed chat is driven by :mod:`bench_engine_proc`'s light
client at each ``--concurrency``; each round starts both servers afresh, in
alternating order, so that background load hits both alike. Reported per server
and level, medians over rounds: output tokens/s, TTFT p50 / p99, and the CPU per
output token of the HTTP side (the server's process tree less the engine
process). Ratio: granian / uvicorn tokens/s. Writes
``benches/results/bench_http_servers.json``.

Run: ``.venv/bin/python benches/bench_http_servers.py [--rounds 3]`` (granian is
pinned in ``requirements.txt`` for this benchmark; the server does not use it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine_proc import (
    Server,
    _is_engine,
    children,
    cpu_seconds,
    run_level,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results" / "bench_http_servers.json"
SERVE_ARGS = "--mock-engine --served-model-name m --log-level warning --disable-log-stats"
KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "http_cpu_us_per_token")


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


class TreeServer(Server):
    """A server whose CPU is its whole process tree: (HTTP side, engine processes)."""

    def cpu(self) -> tuple[float, float]:
        front = engine = 0.0
        for p in tree(self.proc.pid):
            with contextlib.suppress(OSError):
                if _is_engine(p):
                    engine += cpu_seconds(p)
                else:
                    front += cpu_seconds(p)
        return front, engine


def granian(port: int) -> list[str]:
    cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--no-ws"]
    cmd += ["--loop", "uvloop", "--log-level", "warning", "--port", str(port)]
    return [*cmd, "--working-dir", str(ROOT / "benches"), "granian_app:app"]


def start(name: str) -> TreeServer:
    env = {**os.environ, "EC_BENCH_SERVE_ARGS": SERVE_ARGS}
    if name == "granian":
        return TreeServer([], env, program=granian)
    return TreeServer(["--mock-engine", "--disable-log-stats"], env)


def measure(server: Server, concurrency: int, requests: int, seed: int) -> dict[str, Any]:
    asyncio.run(run_level(server, 4, 8, 8, 10_000, False))  # warm-up
    row = asyncio.run(run_level(server, concurrency, requests, 64, seed, False))
    row["http_cpu_us_per_token"] = round(
        row["frontend_cpu_ms_per_request"] * row["requests"] / row["output_tokens"] * 1e3, 2
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 256])
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--out", type=Path, default=RESULTS)
    opts = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(opts.rounds):
        order = ("uvicorn", "granian") if r % 2 == 0 else ("granian", "uvicorn")
        for name in order:
            server = start(name)
            try:
                for c in opts.concurrency:
                    row = measure(server, c, max(opts.requests, 2 * c), seed=1000 * r + c)
                    runs.setdefault(f"{name} c={c}", []).append(row)
                    print(f"round {r} {name:8s} c={c:<4d} {row['output_tok_s']:9.1f} tok/s  "
                          f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms  HTTP CPU "
                          f"{row['http_cpu_us_per_token']:6.2f} us/token", flush=True)  # fmt: skip
            finally:
                server.stop()
    med = {
        key: {k: statistics.median(row[k] for row in rows) for k in KEYS}
        for key, rows in runs.items()
    }
    ratios = {
        f"c={c}": {
            "tok_s_granian_over_uvicorn": round(
                med[f"granian c={c}"]["output_tok_s"] / med[f"uvicorn c={c}"]["output_tok_s"], 3
            ),
            "http_cpu_per_token_uvicorn_over_granian": round(
                med[f"uvicorn c={c}"]["http_cpu_us_per_token"]
                / med[f"granian c={c}"]["http_cpu_us_per_token"],
                3,
            ),
        }
        for c in opts.concurrency
    }
    write_report(opts.out, med, ratios, runs)


if __name__ == "__main__":
    main()
