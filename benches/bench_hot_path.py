"""The API server's hot path with the engine in its own process: code before vs after.

Streamed text chat (``--max-tokens`` tokens each, ``ignore_eos``, usage chunk on)
against ``ec-frontend serve --mock-engine`` at concurrency ``--concurrency``,
driven by :mod:`bench_engine_proc`'s light client (httptools + orjson). Three
servers, once each per round, in turn, so that background load hits all alike:

* ``before``: the tree at ``--baseline`` (a directory holding a ``python/``
  package tree, e.g. ``git archive main python | tar -x -C DIR``), engine process;
* ``after``: this tree, engine process (the default mode);
* ``inprocess``: this tree, ``--engine-mode inprocess``.

Reported per server, medians over rounds: output tokens/s, and CPU of the API
process per streamed output token (``/proc``; the engine process apart). Ratios:
after / before (tok/s; CPU per token before / after) and engine process /
in-process (tok/s), the issue's 0.9x goal. Writes
``benches/results/bench_hot_path.json``.

Run: ``.venv/bin/python benches/bench_hot_path.py --baseline DIR [--rounds 5]``.
``--profile SECONDS`` instead samples the ``after`` server's API and engine
processes with py-spy under the same load and prints their top frames.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine_proc import Server, run_level, write_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results" / "bench_hot_path.json"


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree / "python")}


def servers(baseline: Path | None) -> dict[str, tuple[list[str], dict[str, str]]]:
    out = {}
    if baseline is not None:
        out["before"] = (["--mock-engine"], _env(baseline))
    out["after"] = (["--mock-engine"], _env(ROOT))
    out["inprocess"] = (["--mock-engine", "--engine-mode", "inprocess"], _env(ROOT))
    return out


def measure(server: Server, opts: argparse.Namespace, seed: int) -> dict[str, Any]:
    c = opts.concurrency
    asyncio.run(run_level(server, 4, 8, 8, 10_000, False))  # warm-up
    row = asyncio.run(run_level(server, c, opts.requests, opts.max_tokens, seed, False))
    tokens = row["output_tokens"]
    row["api_cpu_us_per_token"] = round(
        row["frontend_cpu_ms_per_request"] * row["requests"] / tokens * 1e3, 2
    )
    row["engine_cpu_us_per_token"] = round(
        row["engine_cpu_ms_per_request"] * row["requests"] / tokens * 1e3, 2
    )
    return row


def profile(opts: argparse.Namespace) -> None:
    """py-spy both processes of the ``after`` server under load; top frames of each."""
    args, env = servers(None)["after"]
    server = Server(args, env)
    try:
        spy = Path(sys.executable).with_name("py-spy")
        targets = {"api": server.proc.pid, "engine": server.engine_pids[0]}
        outs = {name: RESULTS.with_name(f"bench_hot_path_profile_{name}.txt") for name in targets}
        recs = []
        for name, pid in targets.items():
            cmd = [str(spy), "record", "--pid", str(pid), "--format", "raw", "--nonblocking"]
            cmd += ["--duration", str(opts.profile), "--output", str(outs[name])]
            recs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        level = (opts.concurrency, opts.requests, opts.max_tokens, 1, False)
        while any(r.poll() is None for r in recs):
            asyncio.run(run_level(server, *level))
        for name, out in outs.items():
            print(f"== {name} process")
            print_top(out)
    finally:
        server.stop()


def print_top(raw: Path, limit: int = 30) -> None:
    """Self and total sample shares of the frames in py-spy's collapsed stacks."""
    self_n: dict[str, int] = {}
    total_n: dict[str, int] = {}
    samples = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue  # a frame name with a line break in it: not a stack line
        n = int(count)
        samples += n
        frames = stack.split(";")
        for f in set(frames):
            total_n[f] = total_n.get(f, 0) + n
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
    print(f"{samples} samples")
    for title, table in (("self", self_n), ("total", total_n)):
        print(f"-- top frames by {title} samples")
        for f, n in sorted(table.items(), key=lambda kv: -kv[1])[:limit]:
            print(f"{100 * n / samples:5.1f}%  {f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="a tree with the code before (python/)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--profile", type=int, help="py-spy the after server for this many s")
    ap.add_argument("--out", type=Path, default=RESULTS)
    opts = ap.parse_args()
    if opts.profile:
        profile(opts)
        return
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(opts.rounds):
        for name, (args, env) in servers(opts.baseline).items():
            server = Server(args, env)
            try:
                row = measure(server, opts, seed=1000 * r)
            finally:
                server.stop()
            runs.setdefault(name, []).append(row)
            print(f"round {r} {name:9s} {row['output_tok_s']:9.1f} tok/s  API CPU "
                  f"{row['api_cpu_us_per_token']:6.2f} us/token  engine "
                  f"{row['engine_cpu_us_per_token']:6.2f} us/token  client "
                  f"{row['client_cpu_ms_per_request']:.2f} ms/req", flush=True)  # fmt: skip
    med = {
        name: {
            key: statistics.median(row[key] for row in rows)
            for key in ("output_tok_s", "api_cpu_us_per_token", "engine_cpu_us_per_token")
        }
        for name, rows in runs.items()
    }
    ratios: dict[str, float] = {}
    if "before" in med:
        ratios["tok_s_after_over_before"] = (
            med["after"]["output_tok_s"] / med["before"]["output_tok_s"]
        )
        ratios["api_cpu_per_token_before_over_after"] = (
            med["before"]["api_cpu_us_per_token"] / med["after"]["api_cpu_us_per_token"]
        )
        ratios["before_engine_process_over_inprocess_tok_s"] = (
            med["before"]["output_tok_s"] / med["inprocess"]["output_tok_s"]
        )
    ratios["engine_process_over_inprocess_tok_s"] = (
        med["after"]["output_tok_s"] / med["inprocess"]["output_tok_s"]
    )
    ratios = {k: round(v, 3) for k, v in ratios.items()}
    write_report(opts.out, med, ratios, runs)


if __name__ == "__main__":
    main()
