"""Soak of ``ec-frontend serve`` with hostile requests mixed into well-formed traffic.

Two phases against one server process on the built-in model, closed loop at a
fixed concurrency: a clean phase (only well-formed requests), then a hostile
phase in which about one request in ten is one of the cheap attacks of issue 15
(client-chosen transfer peers, oversized processor kwargs, fan-out, a PNG whose
header claims 30000x30000 pixels, a huge text prompt, a huge header, a long URL,
a MIME type that lies, a header that trickles in and stops, bodies that are not
JSON or have the wrong types, a grammar of 1,500 choices to compile, and
clients that drop a stream after its first event). Every well-formed request
must answer 200; every hostile one must answer 4xx (never 5xx, never a dropped
connection; the dropped streams and the grammar answer 200), and the loopback
listener posing as a peer must receive no connection. Reports per phase:
requests, errors, latency p50/p99 of the well-formed requests, and the RSS of the
server's processes (API server and engine) sampled every few seconds; the
hostile phase's p99 is printed as a ratio to the clean phase's.

Run: ``.venv/bin/python benches/soak_hostile.py --clean-s 300 --hostile-s 600``.
Writes ``benches/results/soak_hostile.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import socket
import struct
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from bench_serving import launch_server
from ec_frontend import parse_request
from ec_frontend.model.builtin import BUILTIN_MODEL_ID
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
#: A hostile client trickling its headers must be cut by the server within this time.
TRICKLE_LIMIT_S = 60.0
#: Hostile kinds that a server may also answer with 200 by ignoring the untrusted part
#: (client-chosen transfer peers); the peer listener then must still see no connection.
IGNORABLE = frozenset({"ec_peers", "kv_peer"})
#: Hostile kinds that are well-formed for the server and must answer 200.
ANSWERED = frozenset({"disconnect", "grammar"})
#: The server runs as an EC and KV consumer, so that client-chosen peers are a real threat.
CONSUMER_ARGS = [
    "--ec-transfer-config",
    '{"ec_connector": "ECSideChannelConnector", "ec_role": "ec_consumer"}',
    "--kv-transfer-config",
    '{"kv_connector": "KVSideChannelConnector", "kv_role": "kv_consumer"}',
]


def png_data_url(size: int, seed: int) -> str:
    rnd = random.Random(seed)
    img = Image.new("RGB", (size, size), tuple(rnd.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def png_bomb_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height``: a few dozen bytes, no real pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 4096)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


class PeerListener:
    """A loopback listener posing as a transfer peer; counts the connections it receives."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


def chat(content: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


def good_request(i: int, images: list[str]) -> tuple[str, dict[str, Any]]:
    stream = i % 2 == 0
    content = [
        {"type": "text", "text": f"request {i}: what is in the picture?"},
        {"type": "image_url", "image_url": {"url": images[i % len(images)]}},
    ]
    return "/v1/chat/completions", chat(
        content, max_tokens=16, temperature=0, ignore_eos=True, stream=stream
    )


def ec_peers_request(peer_port: int) -> tuple[str, dict[str, Any]]:
    """A fresh image whose real key, among 499 others, names a client-chosen peer."""
    img = png_data_url(56, random.randrange(1 << 30))
    body = chat([{"type": "image_url", "image_url": {"url": img}}], max_tokens=2)
    mm_hash = parse_request("chat", json.dumps(body), model_id=BUILTIN_MODEL_ID).media[0].mm_hash
    entry = {"peer_host": "127.0.0.1", "peer_port": peer_port, "num_tokens": 4}
    params = {f"{i:064x}": entry for i in range(499)}
    params[mm_hash] = entry
    return "/v1/chat/completions", {**body, "ec_transfer_params": params}


def hostile_requests(peer_port: int) -> list[tuple[str, Any]]:
    """(kind, spec): spec is (path, body) for JSON posts, or a raw-socket marker."""
    img = png_data_url(28, 7)
    bomb = "data:image/png;base64," + base64.b64encode(png_bomb_header(30000, 30000)).decode()
    jpeg_buf = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(jpeg_buf, format="JPEG")
    lying = "data:image/png;base64," + base64.b64encode(jpeg_buf.getvalue()).decode()
    kv_peer = {
        "do_remote_prefill": True,
        "remote_engine_id": "x",
        "remote_request_id": "x",
        "remote_block_ids": [0],
        "remote_host": "127.0.0.1",
        "remote_port": peer_port,
    }
    image_part = {"type": "image_url", "image_url": {"url": img}}
    return [
        ("ec_peers", lambda: ec_peers_request(peer_port)),
        ("kv_peer", ("/v1/chat/completions", chat("hi", max_tokens=2, kv_transfer_params=kv_peer))),
        (
            "max_pixels",
            (
                "/v1/chat/completions",
                chat(
                    [image_part],
                    max_tokens=2,
                    mm_processor_kwargs={"min_pixels": 40_000_000, "max_pixels": 40_000_000},
                ),
            ),
        ),
        ("fan_out", ("/v1/completions", {"prompt": ["a"] * 1000, "n": 128, "max_tokens": 1})),
        (
            "png_bomb",
            ("/v1/chat/completions", chat([{"type": "image_url", "image_url": {"url": bomb}}])),
        ),
        ("huge_text", ("/v1/completions", {"prompt": "word " * 400_000, "max_tokens": 1})),
        (
            "lying_mime",
            ("/v1/chat/completions", chat([{"type": "image_url", "image_url": {"url": lying}}])),
        ),
        ("huge_header", "huge_header"),
        ("long_url", "long_url"),
        ("trickle", "trickle"),
        ("not_json", ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"')),
        (
            "wrong_types",
            ("/v1/chat/completions", {"messages": "hi", "max_tokens": "many", "n": [1]}),
        ),
        ("disconnect", "disconnect"),
        (
            "grammar",
            (
                "/v1/chat/completions",
                chat(
                    "pick one",
                    max_tokens=4,
                    structured_outputs={"choice": [f"choice number {i}" for i in range(1500)]},
                ),
            ),
        ),
    ]


def raw_exchange(port: int, kind: str) -> int:
    """Hostile requests that need a raw socket; returns the status code (0 when closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        if kind == "huge_header":
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
        elif kind == "long_url":
            s.sendall(b"GET /v1/models?" + b"a" * 200_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        else:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")
            s.settimeout(1.0)
            deadline = time.monotonic() + TRICKLE_LIMIT_S
            while time.monotonic() < deadline:
                try:
                    answer = s.recv(4096)
                    return int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") else 408
                except TimeoutError:
                    pass
                except OSError:
                    return 408
                try:
                    s.sendall(b"X")
                except OSError:
                    return 408
            return 0
        try:
            data = s.recv(4096)
        except OSError:
            return 0
    if not data.startswith(b"HTTP/1.1 "):
        return 0
    return int(data[9:12])


def rss_kib(pid: int) -> int:
    """The resident memory of ``pid`` and its descendants (the engine process)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += rss_kib(int(child))
    except OSError:
        pass
    return total


async def phase(
    url: str,
    port: int,
    pid: int,
    seconds: float,
    concurrency: int,
    hostile_share: float,
    peer: PeerListener,
    seed: int,
) -> dict[str, Any]:
    rnd = random.Random(seed)
    images = [png_data_url(112, s) for s in range(8)]
    hostile = hostile_requests(peer.port)
    latencies: list[float] = []
    good = Counter()
    bad = Counter()
    errors: list[str] = []
    rss: list[int] = []
    counter = 0
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=2 * concurrency, max_keepalive_connections=concurrency)

    async def sample_rss() -> None:
        while time.monotonic() < end:
            rss.append(rss_kib(pid))
            await asyncio.sleep(5)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def send_good(i: int) -> None:
            path, body = good_request(i, images)
            t0 = time.perf_counter()
            try:
                if body["stream"]:
                    async with client.stream("POST", path, json=body) as r:
                        status = r.status_code
                        async for _ in r.aiter_bytes():
                            pass
                else:
                    r = await client.post(path, json=body)
                    status = r.status_code
            except httpx.HTTPError as e:
                status = -1
                errors.append(f"good {type(e).__name__}: {e}")
            latencies.append(time.perf_counter() - t0)
            good[status] += 1
            if status not in (200, -1):
                errors.append(f"good HTTP {status}")

        async def drop_stream(i: int) -> int:
            """A streamed request whose client goes away after the first event."""
            _, body = good_request(2 * i, images)
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    break
                return r.status_code

        async def send_hostile(kind: str, spec: Any) -> None:
            if spec == "disconnect":
                try:
                    status = await drop_stream(counter)
                except httpx.HTTPError as e:
                    status = -1
                    errors.append(f"hostile {kind} {type(e).__name__}")
            elif isinstance(spec, str):
                status = await asyncio.to_thread(raw_exchange, port, spec)
            else:
                path, body = spec() if callable(spec) else spec
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    r = await client.post(path, content=data)
                    status = r.status_code
                except httpx.HTTPError as e:
                    status = -1
                    errors.append(f"hostile {kind} {type(e).__name__}")
            bad[f"{kind}:{status}"] += 1
            if kind in ANSWERED:
                if status != 200:
                    errors.append(f"hostile {kind} answered {status}")
            elif not (400 <= status < 500 or (status == 200 and kind in IGNORABLE)):
                errors.append(f"hostile {kind} answered {status}")

        async def worker() -> None:
            nonlocal counter
            while time.monotonic() < end:
                counter += 1
                if rnd.random() < hostile_share:
                    kind, spec = rnd.choice(hostile)
                    await send_hostile(kind, spec)
                else:
                    await send_good(counter)

        t0 = time.perf_counter()
        await asyncio.gather(sample_rss(), *(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0

    def pct(q: float) -> float:
        values = sorted(latencies)
        return 1000 * values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    return {
        "seconds": wall,
        "hostile_share": hostile_share,
        "well_formed": dict(good),
        "well_formed_ok": good[200],
        "well_formed_errors": sum(v for k, v in good.items() if k != 200),
        "hostile": dict(sorted(bad.items())),
        "latency_p50_ms": pct(0.5),
        "latency_p99_ms": pct(0.99),
        "requests_per_s": (sum(good.values()) + sum(bad.values())) / wall,
        "rss_kib": {"first": rss[0], "last": rss[-1], "max": max(rss)} if rss else {},
        "errors": errors[:50],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clean-s", type=float, default=300)
    p.add_argument("--hostile-s", type=float, default=600)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--hostile-share", type=float, default=0.10)
    p.add_argument("--server-arg", action="append", default=[], help="extra `serve` flag")
    args = p.parse_args()

    peer = PeerListener()
    proc, url = launch_server(["--log-level", "error", *CONSUMER_ARGS, *args.server_arg])
    port = int(url.rsplit(":", 1)[1])
    try:
        warm = asyncio.run(phase(url, port, proc.pid, 20, args.concurrency, 0.0, peer, 0))
        print(f"warm-up: {warm['well_formed_ok']} requests")
        clean = asyncio.run(
            phase(url, port, proc.pid, args.clean_s, args.concurrency, 0.0, peer, 1)
        )
        print("clean:", json.dumps({k: v for k, v in clean.items() if k != "errors"}))
        hostile = asyncio.run(
            phase(
                url, port, proc.pid, args.hostile_s, args.concurrency, args.hostile_share, peer, 2
            )
        )
        print("hostile:", json.dumps({k: v for k, v in hostile.items() if k != "errors"}))
        alive = httpx.get(url + "/health", timeout=5).status_code
    finally:
        proc.terminate()
        proc.wait(60)
    ratio = hostile["latency_p99_ms"] / max(clean["latency_p99_ms"], 1e-9)
    rss_growth = hostile["rss_kib"]["last"] / max(clean["rss_kib"]["last"], 1)
    print(
        f"well-formed errors: clean {clean['well_formed_errors']}, hostile "
        f"{hostile['well_formed_errors']}; hostile requests not answered 4xx: "
        f"{sum(1 for e in hostile['errors'] if e.startswith('hostile'))}; peer connections: "
        f"{peer.connections}; p99 hostile/clean {ratio:.2f}x; RSS end of hostile / end of clean "
        f"{rss_growth:.3f}; /health after: {alive}"
    )
    for e in hostile["errors"][:20]:
        print("  ", e)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "soak_hostile",
        "command": "python benches/soak_hostile.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count()},
        "concurrency": args.concurrency,
        "clean": clean,
        "hostile": hostile,
        "p99_ratio_hostile_over_clean": ratio,
        "rss_ratio_end_hostile_over_end_clean": rss_growth,
        "peer_connections": peer.connections,
        "health_after": alive,
    }
    (RESULTS / "soak_hostile.json").write_text(json.dumps(out, indent=2) + "\n")
    print("wrote benches/results/soak_hostile.json")


if __name__ == "__main__":
    main()
