"""Requests/s of chats whose images come by URL from a loopback origin, against the same
images inline, in one run.

``ec-frontend serve --mock-engine`` runs with the image path of the built-in model
(``EC_FRONTEND_MOCK_IMAGE_MODEL``: every image is probed, decoded and preprocessed
as the real processor does) and ``--allowed-media-networks 127.0.0.0/8``. An origin
process (a minimal asyncio HTTP server, one connection per fetch, as the fetcher
makes them) serves ``--images`` distinct JPEGs. ``--concurrency`` (32) connections
send chats with one image each, request ``i`` naming image ``i mod images``: by
``http://127.0.0.1`` URL in the ``url`` rounds, as a base64 ``data:`` URL in the
``inline`` rounds. Rounds alternate and the median counts, so background load hits
both alike. Writes ``benches/results/bench_media_fetch.json``.

Run: ``.venv/bin/python benches/bench_media_fetch.py [--seconds 4] [--rounds 6]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results" / "bench_media_fetch.json"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_images(count: int, size: int) -> list[bytes]:
    from PIL import Image

    rng = random.Random(0)
    out = []
    for i in range(count):
        img = Image.new("RGB", (size, size), (rng.randrange(256), 80, 160))
        for _ in range(size * 4):
            img.putpixel((rng.randrange(size), rng.randrange(size)), (i % 256, 255, 0))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


# ------------------------------------------------------------------ origin process


def run_origin(directory: str, port: int) -> None:
    files = {f"/{p.name}": p.read_bytes() for p in Path(directory).iterdir()}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            body = files.get(path)
            if body is None:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ------------------------------------------------------------------- load


def chat_payload(port: int, url: str) -> bytes:
    body = json.dumps(
        {
            "model": "mock",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Describe the picture."},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
            "max_tokens": 4,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = next(
        int(v) for n, _, v in (ln.partition(b":") for ln in lines[1:])
        if n.strip().lower() == b"content-length"
    )  # fmt: skip
    await reader.readexactly(length)
    return status


async def load(
    port: int, payloads: list[bytes], concurrency: int, seconds: float
) -> dict[str, Any]:
    stop_at = time.perf_counter() + seconds
    latencies: list[float] = []
    errors = 0
    counter = iter(range(1 << 62))

    async def worker() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at:
                payload = payloads[next(counter) % len(payloads)]
                t0 = time.perf_counter()
                writer.write(payload)
                if await read_response(reader) != 200:
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
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
    }


def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--size", type=int, default=448, help="image side in pixels")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    from ec_frontend.model.builtin import ensure_builtin_checkpoint

    cache = Path(os.environ.get("EC_FRONTEND_CACHE") or tempfile.mkdtemp(prefix="ec-bench-"))
    model_dir = ensure_builtin_checkpoint(cache)
    images = make_images(args.images, args.size)
    workdir = Path(tempfile.mkdtemp(prefix="ec-media-origin-"))
    for i, data in enumerate(images):
        (workdir / f"img{i}.jpg").write_bytes(data)
    origin_port, port = free_port(), free_port()
    origin = subprocess.Popen(
        [sys.executable, __file__, "--origin", str(workdir), str(origin_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {**os.environ, "EC_FRONTEND_MOCK_IMAGE_MODEL": str(model_dir)}
    server = subprocess.Popen(
        [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--mock-engine",
         "--port", str(port), "--log-level", "warning",
         "--allowed-media-networks", "127.0.0.0/8"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        payloads = {
            "url": [
                chat_payload(port, f"http://127.0.0.1:{origin_port}/img{i}.jpg")
                for i in range(args.images)
            ],
            "inline": [
                chat_payload(port, "data:image/jpeg;base64," + base64.b64encode(d).decode())
                for d in images
            ],
        }
        asyncio.run(load(port, payloads["url"], args.concurrency, 1.0))  # warm-up
        asyncio.run(load(port, payloads["inline"], args.concurrency, 1.0))
        rounds: dict[str, list[dict[str, Any]]] = {"url": [], "inline": []}
        for _ in range(args.rounds):
            for mode in ("url", "inline"):
                cpu = cpu_seconds(server.pid), cpu_seconds(origin.pid)
                result = asyncio.run(load(port, payloads[mode], args.concurrency, args.seconds))
                requests = max(1, result["requests"])
                result["server_cpu_ms_per_request"] = (
                    1000 * (cpu_seconds(server.pid) - cpu[0]) / requests
                )
                result["origin_cpu_ms_per_request"] = (
                    1000 * (cpu_seconds(origin.pid) - cpu[1]) / requests
                )
                rounds[mode].append(result)
                print(f"{mode:6s} {result['rps']:8.1f} req/s  p50 {result['p50_ms']:.1f} ms  "
                      f"p99 {result['p99_ms']:.1f} ms  server CPU "
                      f"{result['server_cpu_ms_per_request']:.2f} ms/req  origin CPU "
                      f"{result['origin_cpu_ms_per_request']:.2f} ms/req  "
                      f"errors {result['errors']}")  # fmt: skip
        summary = {
            mode: {
                "rps_median": statistics.median(r["rps"] for r in rs),
                "p50_ms_median": statistics.median(r["p50_ms"] for r in rs),
                "p99_ms_median": statistics.median(r["p99_ms"] for r in rs),
                "server_cpu_ms_per_request_median": statistics.median(
                    r["server_cpu_ms_per_request"] for r in rs
                ),
                "origin_cpu_ms_per_request_median": statistics.median(
                    r["origin_cpu_ms_per_request"] for r in rs
                ),
                "errors": sum(r["errors"] for r in rs),
            }
            for mode, rs in rounds.items()
        }
        ratio = summary["url"]["rps_median"] / summary["inline"]["rps_median"]
        print(f"by URL / inline: {ratio:.2f}x requests/s")
        out = {
            "benchmark": "bench_media_fetch",
            "concurrency": args.concurrency,
            "images": args.images,
            "image_bytes_mean": statistics.mean(len(d) for d in images),
            "image_side": args.size,
            "seconds_per_round": args.seconds,
            "rounds": args.rounds,
            "summary": summary,
            "url_over_inline_rps": ratio,
            "raw": rounds,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    finally:
        server.terminate()
        origin.terminate()
        server.wait(30)
        origin.wait(10)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--origin":
        run_origin(sys.argv[2], int(sys.argv[3]))
    else:
        main()
