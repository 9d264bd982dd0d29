"""Requests/s of the HTTP frontend alone: ``ec-frontend serve --mock-engine`` vs a
FastAPI + pydantic baseline (``benches/baseline_server.py``) on the same mock engine.

Both servers run as separate processes on loopback; a lean load generator
(raw asyncio sockets, HTTP/1.1 keep-alive, prebuilt request bytes) keeps
``--concurrency`` connections busy. Rounds alternate between the servers and
the median round counts, so background load hits both alike. Writes
``benches/results/server_mock.json``.

Run: ``.venv/bin/python benches/bench_server.py [--seconds 2] [--rounds 8] [--ours-only]
[--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results" / "server_mock.json"
MODEL = "mock-model"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], url: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{cmd} did not start")


def request_bytes(port: int, stream: bool, max_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Describe the picture in one short sentence."},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = None
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if length is not None:
        return status, await reader.readexactly(length)
    if not chunked:
        raise RuntimeError("response without length")
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return status, b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def load(port: int, payload: bytes, concurrency: int, seconds: float) -> dict[str, Any]:
    stop_at = time.perf_counter() + seconds
    latencies: list[float] = []
    errors = 0

    async def worker() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                writer.write(payload)
                status, body = await read_response(reader)
                if status != 200 or b"length" not in body:
                    errors += 1
                latencies.append(time.perf_counter() - t0)
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    latencies.sort()
    return {
        "requests": len(latencies),
        "errors": errors,
        "seconds": elapsed,
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--ours-only",
        action="store_true",
        help="no FastAPI baseline (e.g. to compare two trees with bench_against.py)",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    ours_port, base_port = free_port(), free_port()
    py = sys.executable
    servers = {
        "ec-frontend": start(
            [
                py,
                "-m",
                "ec_frontend.entrypoints.cli",
                "serve",
                "--mock-engine",
                "--port",
                str(ours_port),
                "--served-model-name",
                MODEL,
                "--log-level",
                "warning",
            ],
            f"http://127.0.0.1:{ours_port}",
        ),
        **(
            {}
            if args.ours_only
            else {
                "fastapi+pydantic": start(
                    [
                        py,
                        str(ROOT / "benches" / "baseline_server.py"),
                        "--port",
                        str(base_port),
                        "--model",
                        MODEL,
                    ],
                    f"http://127.0.0.1:{base_port}",
                )
            }
        ),
    }
    ports = {"ec-frontend": ours_port, "fastapi+pydantic": base_port}
    if args.ours_only:
        del ports["fastapi+pydantic"]
    results: dict[str, Any] = {}
    try:
        for stream in (False, True):
            scenario = "chat_stream" if stream else "chat"
            rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
            for port in ports.values():  # warm-up
                asyncio.run(
                    load(port, request_bytes(port, stream, args.max_tokens), args.concurrency, 1.0)
                )
            for r in range(args.rounds):
                order = list(ports.items()) if r % 2 == 0 else list(ports.items())[::-1]
                for name, port in order:
                    payload = request_bytes(port, stream, args.max_tokens)
                    cpu0 = cpu_seconds(servers[name].pid)
                    res = asyncio.run(load(port, payload, args.concurrency, args.seconds))
                    used = cpu_seconds(servers[name].pid) - cpu0
                    res["server_cpu_us_per_request"] = 1e6 * used / max(res["requests"], 1)
                    rounds[name].append(res)
                    print(
                        f"{scenario:12s} round {r} {name:18s} {res['rps']:8.1f} req/s "
                        f"p50 {res['p50_ms']:.1f} ms p99 {res['p99_ms']:.1f} ms "
                        f"server CPU {res['server_cpu_us_per_request']:.0f} us/req "
                        f"errors {res['errors']}"
                    )
            med = {n: statistics.median(x["rps"] for x in v) for n, v in rounds.items()}
            cpu = {
                n: statistics.median(x["server_cpu_us_per_request"] for x in v)
                for n, v in rounds.items()
            }
            if args.ours_only:
                print(f"{scenario}: ec-frontend {med['ec-frontend']:.1f} req/s, server CPU "
                      f"per request {cpu['ec-frontend']:.0f} us")  # fmt: skip
                results[scenario] = {
                    "median_rps": med,
                    "median_server_cpu_us_per_request": cpu,
                    "rounds": rounds,
                }
                continue
            ratio = med["ec-frontend"] / med["fastapi+pydantic"]
            cpu_ratio = cpu["fastapi+pydantic"] / cpu["ec-frontend"]
            print(
                f"{scenario}: ec-frontend {med['ec-frontend']:.1f} req/s, baseline "
                f"{med['fastapi+pydantic']:.1f} req/s, ratio {ratio:.2f}x; server CPU per "
                f"request {cpu['ec-frontend']:.0f} vs {cpu['fastapi+pydantic']:.0f} us "
                f"({cpu_ratio:.2f}x less)"
            )
            results[scenario] = {
                "median_rps": med,
                "ratio": ratio,
                "median_server_cpu_us_per_request": cpu,
                "cpu_ratio": cpu_ratio,
                "rounds": rounds,
            }
    finally:
        for proc in servers.values():
            proc.terminate()
            proc.wait(30)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "bench_server",
        "command": "python benches/bench_server.py " + " ".join(sys.argv[1:]),
        "concurrency": args.concurrency,
        "seconds_per_round": args.seconds,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
