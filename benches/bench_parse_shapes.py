"""The request parser on body shapes it was not tuned on: ``ec_frontend.parse_request``
against ``orjson.loads`` on chat bodies of 1 to 10 KB shaped like vLLM's own client
examples (a system prompt and a multi-turn conversation, tool definitions as in its
tool-calling example, images by http URL as in its multimodal example, sampling
parameters and ``vllm_xargs``), not the 2.5 KB data-URL body of ``bench_parse.py``.

Both are timed interleaved in one run, best of ``--rounds`` rounds of ``--reps``
parses each; the ratio ``parse_request / orjson.loads`` is the figure (goal: within
2x, issue 33). Writes ``benches/results/bench_parse_shapes.json``.

Run: ``.venv/bin/python benches/bench_parse_shapes.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import ec_frontend as ecf
import orjson

RESULTS = Path(__file__).resolve().parents[1] / "benches" / "results" / "bench_parse_shapes.json"
MODEL_ID = "tiny-qwen2-vl"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city to find the weather for"},
                "state": {"type": "string", "description": "the two-letter abbreviation"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "state", "unit"],
        },
    },
}


def body(target_bytes: int) -> bytes:
    """A chat body of about ``target_bytes``: turns are added until it is that long."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant that looks at pictures."}
    ]
    tools = []
    turn = 0
    while True:
        content = [
            {"type": "text", "text": f"Turn {turn}: what is in this image, and the weather?"},
            {"type": "image_url",
             "image_url": {"url": f"https://upload.example.org/images/{turn:04d}/Gfp-wisconsin.jpg"}},
        ]  # fmt: skip
        messages.append({"role": "user", "content": content})
        messages.append({"role": "assistant", "content": f"Answer {turn}: a boardwalk in a "
                         "green meadow under a blue sky with a few clouds."})  # fmt: skip
        if turn % 3 == 0:
            tool = json.loads(json.dumps(WEATHER_TOOL))
            tool["function"]["name"] = f"get_current_weather_{turn}"
            tools.append(tool)
        turn += 1
        out = {
            "model": MODEL_ID,
            "messages": messages,
            "tools": tools,
            "tool_choice": "auto",
            "max_tokens": 256,
            "temperature": 0.7,
            "top_p": 0.95,
            "top_k": 50,
            "seed": 1234,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop": ["</s>", "\n\nUser:"],
            "vllm_xargs": {"tenant": "bench", "priority_hint": 1},
        }
        data = json.dumps(out).encode()
        if len(data) >= target_bytes:
            return data


def best_per_call(fn: Any, data: bytes, reps: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn(data)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=2000)
    args = p.parse_args()

    def ours(data: bytes) -> Any:
        return ecf.parse_request("chat", data, model_id=MODEL_ID)

    rows = []
    for size in (1024, 2048, 4096, 10240):
        data = body(size)
        ours(data)  # a body the parser refuses would stop the run here
        # Interleaved: each round times both, so a busy moment hits both alike.
        o_best, j_best = float("inf"), float("inf")
        for _ in range(args.rounds):
            o_best = min(o_best, best_per_call(ours, data, args.reps, 1))
            j_best = min(j_best, best_per_call(orjson.loads, data, args.reps, 1))
        rows.append({"bytes": len(data), "parse_request_us": o_best * 1e6,
                     "orjson_loads_us": j_best * 1e6, "ratio": o_best / j_best})  # fmt: skip
        print(f"{len(data):6d} B  parse_request {o_best * 1e6:8.2f} us  orjson.loads "
              f"{j_best * 1e6:8.2f} us  ratio {o_best / j_best:.2f}x")  # fmt: skip
    RESULTS.write_text(json.dumps({
        "benchmark": "bench_parse_shapes",
        "command": "python benches/bench_parse_shapes.py",
        "rounds": args.rounds, "reps": args.reps,
        "host": {"cpus": os.cpu_count(), "load": list(os.getloadavg())},
        "results": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {RESULTS.relative_to(RESULTS.parents[2])}")


if __name__ == "__main__":
    main()
