"""The costliest bodies found for ``parse_request`` (issue 28: "a request's CPU is bounded
by its body limit"): long lists and maps, up to the server's default body limit of
64 MiB. Each case is parsed (and the field's result read, as the server reads it) in
a fresh process with a time limit, so a quadratic build reports "over the limit"
instead of running for minutes.

Run: ``PYTHONPATH=python .venv/bin/python benches/bench_parse_worst.py`` (``--only
NAME`` for some cases, ``--limit-s`` for the time limit). Prints a table and writes
``benches/results/bench_parse_worst.json`` (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results" / "bench_parse_worst.json"
MIB = 1024 * 1024
BODY_LIMIT = 64 * MIB


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def _words(n: int, width: int) -> list[str]:
    return [f"{i:0{width}d}" for i in range(n)]


def _tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i:06d}"}} for i in range(n)]


def _fill(make: Callable[[int], dict[str, Any]], per_item: int, size: int) -> dict[str, Any]:
    """``make(n)`` with ``n`` as large as fits ``size`` bytes (``per_item`` is a guess
    of the bytes per entry, corrected once)."""
    n = size // per_item
    n = int(n * (size - 64 * 1024) / len(json.dumps(make(n))))
    while len(json.dumps(body := make(n))) > size:
        n = n * 99 // 100
    return body


def _structural_tag(n: int) -> dict[str, Any]:
    return {
        "type": "structural_tag",
        "triggers": [f"<t{i}>" for i in range(n)],
        "structures": [
            {"begin": f"<t{n - 1}>", "schema": {"type": "object"}, "end": "</t>"} for _ in range(n)
        ],
    }


#: name -> (endpoint, body maker, reader of the result)
CASES: dict[str, tuple[str, Callable[[], dict[str, Any]], Callable[[Any], Any]]] = {
    "bad_words_100k": ("chat", lambda: _chat(bad_words=_words(100_000, 6)), lambda p: p.sampling),
    "bad_words_300k_9mb": (
        "chat",
        lambda: _chat(bad_words=_words(300_000, 28)),
        lambda p: p.sampling,
    ),
    "tools_200k_10mb": ("chat", lambda: _chat(tools=_tools(200_000)), lambda p: p.structured),
    "messages_10mb_refused": (
        "chat",
        lambda: _fill(
            lambda n: {"messages": [{"role": "user", "content": "hi"} for _ in range(n)]},
            33,
            10 * MIB,
        ),
        lambda p: p.messages,
    ),
    "messages_10mb_1024": (
        "chat",
        lambda: {"messages": [{"role": "user", "content": "x" * (10 * MIB // 1024 - 40)}] * 1024},
        lambda p: p.messages,
    ),
    "bad_words_64mb": (
        "chat",
        lambda: _fill(lambda n: _chat(bad_words=_words(n, 7)), 11, BODY_LIMIT),
        lambda p: p.sampling,
    ),
    "tools_64mb": (
        "chat",
        lambda: _fill(lambda n: _chat(tools=_tools(n)), 52, BODY_LIMIT),
        lambda p: p.structured,
    ),
    "structural_tag_64mb": (
        "chat",
        lambda: _fill(lambda n: _chat(response_format=_structural_tag(n)), 80, BODY_LIMIT),
        lambda p: p.structured,
    ),
    "logit_bias_64mb": (
        "chat",
        lambda: _fill(lambda n: _chat(logit_bias={str(i): 1 for i in range(n)}), 14, BODY_LIMIT),
        lambda p: p.sampling,
    ),
    "stop_token_ids_64mb": (
        "chat",
        lambda: _fill(lambda n: _chat(stop_token_ids=list(range(n))), 9, BODY_LIMIT),
        lambda p: p.sampling,
    ),
    "content_parts_64mb": (
        "chat",
        lambda: _fill(
            lambda n: {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "t"}] * n}]
            },
            29,
            BODY_LIMIT,
        ),
        lambda p: p.messages,
    ),
    "generate_xargs_64mb": (
        "generate",
        lambda: _fill(
            lambda n: {
                "token_ids": [1],
                "sampling_params": {"extra_args": {f"k{i}": 0 for i in range(n)}},
                "vllm_xargs": {f"k{i}": 0 for i in range(n)},
            },
            24,
            BODY_LIMIT,
        ),
        lambda p: p.sampling,
    ),
}


def _one(name: str) -> dict[str, Any]:
    import ec_frontend as ecf

    endpoint, make, read = CASES[name]
    body = json.dumps(make()).encode()
    start = time.perf_counter()
    cpu = time.process_time()
    try:
        read(ecf.parse_request(endpoint, body, model_id="m"))
        outcome = "ok"
    except ecf.RequestError as e:
        outcome = f"400 at {e.param!r}"
    return {
        "case": name,
        "body_mib": round(len(body) / MIB, 2),
        "wall_s": round(time.perf_counter() - start, 4),
        "cpu_s": round(time.process_time() - cpu, 4),
        "outcome": outcome,
        "core": ecf._core.__file__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", nargs="*", default=list(CASES))
    ap.add_argument("--limit-s", type=float, default=60.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(_one(args.case)))
        return
    rows = []
    for name in args.only:
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--case", name],
                capture_output=True,
                text=True,
                timeout=args.limit_s,
                env=os.environ,
                check=True,
            )
            row = json.loads(done.stdout)
        except subprocess.TimeoutExpired:
            row = {"case": name, "wall_s": None, "outcome": f"over the {args.limit_s:.0f} s limit"}
        rows.append(row)
        wall = "-" if row["wall_s"] is None else f"{row['wall_s']:.3f} s"
        size = row.get("body_mib", "-")
        print(f"{name:24s} {size:>6} MiB  {wall:>10}  {row['outcome']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
