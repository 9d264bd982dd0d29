"""Disaggregated serving on the built-in model (CPU), all instances on loopback.

Two measurements, each against a baseline taken in the same run:

1. **E+PD vs aggregated**: streamed chat requests with two distinct images
   each (fresh images, so no cache hits), or with ``--media video`` one fresh
   video each (``--video-frames`` frames of ``--image-size`` pixels a side,
   H.264, written by PyAV), ``--concurrency`` in flight, through
   ``ec-frontend proxy`` (side-channel encoder -> PD) and straight to one
   aggregated instance. Time to first token (client side), requests/s and
   output tokens/s; rounds alternate between the two and the medians count.
2. **Generate through P/D**: the decode round trip (prefill already done, the
   request sent to decode with prefill's ``kv_transfer_params``) of
   ``/inference/v1/generate`` against ``/v1/chat/completions`` on the same
   prompt tokens, and how many prompt tokens decode computed (it must be 0).

Writes ``benches/results/bench_disagg.json``.

Run: ``.venv/bin/python benches/bench_disagg.py [--requests 32] [--concurrency 8] [--rounds 2]``;
``--media video --only epd`` for videos (the first measurement alone), written to
``benches/results/bench_disagg_video.json``.
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
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results" / "bench_disagg.json"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, command: str, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ec_frontend.entrypoints.cli", command]
        cmd += ["--port", str(self.port), "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait(self) -> Proc:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.proc.args} did not start")

    def metric(self, name: str) -> float:
        from ec_frontend.metrics import parse_text

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return parse_text(text).get("ec_frontend_" + name, 0.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve(*extra: str) -> Proc:
    base = ["--device", "cpu", "--max-model-len", "2048", "--served-model-name", MODEL]
    return Proc("serve", [*base, *extra])


def image_url(rng: random.Random, size: int) -> str:
    img = Image.effect_noise((size, size), 40 + rng.random() * 60).convert("RGB")
    tint = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    Image.blend(img, tint, 0.5).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def video_url(rng: random.Random, size: int, frames: int) -> str:
    """A fresh H.264 MP4 of ``frames`` noisy tinted frames at 8 fps, as a data URL."""
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        gen = np.random.default_rng(rng.randrange(2**32))
        for _ in range(frames):
            rgb = gen.integers(0, 256, (size, size, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def media_body(rng: random.Random, args: argparse.Namespace, max_tokens: int) -> dict[str, Any]:
    """A streamed chat request with two fresh images, or one fresh video."""
    if args.media == "video":
        url = video_url(rng, args.image_size, args.video_frames)
        content: list[dict[str, Any]] = [{"type": "video_url", "video_url": {"url": url}}]
        content.append({"type": "text", "text": "Describe what happens in the video."})
        return _chat_body(content, max_tokens)
    return two_image_body(rng, args.image_size, max_tokens)


def two_image_body(rng: random.Random, size: int, max_tokens: int) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": image_url(rng, size)}} for _ in range(2)]
    content.append({"type": "text", "text": "Compare the two pictures in detail."})
    return _chat_body(content, max_tokens)


def _chat_body(content: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[float, int]:
    """``(ttft_s, completion_tokens)`` of one streamed chat request."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']}")
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            for choice in data.get("choices", ()):
                if ttft is None and choice.get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens


async def run_load(url: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    ttfts: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal tokens
            while not queue.empty():
                body = queue.get_nowait()
                ttft, n = await one_stream(client, url, body)
                ttfts.append(ttft)
                tokens += n

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    ttfts.sort()
    return {
        "requests": len(ttfts),
        "seconds": elapsed,
        "requests_per_s": len(ttfts) / elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.9))],
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
    }


def bench_epd_vs_agg(args: argparse.Namespace) -> dict[str, Any]:
    sc = {"ec_connector": "ECSideChannelConnector", "ec_connector_extra_config": {"port": 0}}
    agg = serve()
    enc = serve("--ec-transfer-config", json.dumps({**sc, "ec_role": "ec_producer"}))
    pd = serve("--ec-transfer-config", json.dumps({**sc, "ec_role": "ec_consumer"}))
    procs = [agg, enc, pd]
    try:
        for p in procs:
            p.wait()
        px = Proc("proxy", ["--encode", enc.url, "--decode", pd.url]).wait()
        procs.append(px)
        rng = random.Random(0)
        warm = [media_body(rng, args, 4) for _ in range(4)]
        for url in (agg.url, px.url):
            asyncio.run(run_load(url, warm, 2))
        rounds: dict[str, list[dict[str, Any]]] = {"aggregated": [], "e+pd": []}
        for _ in range(args.rounds):
            for name, url in (("aggregated", agg.url), ("e+pd", px.url)):
                bodies = [media_body(rng, args, args.max_tokens) for _ in range(args.requests)]
                result = asyncio.run(run_load(url, bodies, args.concurrency))
                rounds[name].append(result)
                print(name, json.dumps({k: round(v, 2) for k, v in result.items()}), flush=True)
        pd_computed = pd.metric("encoder_items_computed_total")
        enc_computed = enc.metric("encoder_items_computed_total")
    finally:
        for p in procs:
            p.stop()
    if pd_computed:
        raise SystemExit(f"the PD instance computed {pd_computed:.0f} encoder items: not E+PD")
    out: dict[str, Any] = {"rounds": rounds}
    for name, rs in rounds.items():
        out[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    out["ratio_ttft_p50_epd_over_agg"] = (
        out["e+pd"]["ttft_p50_ms"] / out["aggregated"]["ttft_p50_ms"]
    )
    out["ratio_throughput_epd_over_agg"] = (
        out["e+pd"]["requests_per_s"] / out["aggregated"]["requests_per_s"]
    )
    out["pd_encoder_items_computed"] = pd_computed
    out["encoder_items_computed"] = enc_computed
    return out


def bench_generate_through_pd(args: argparse.Namespace) -> dict[str, Any]:
    from ec_frontend.model.builtin import ensure_builtin_checkpoint
    from ec_frontend.model.loader import load_processor

    kv = {"kv_connector": "KVSideChannelConnector", "kv_connector_extra_config": {"port": 0}}
    p = serve("--kv-transfer-config", json.dumps({**kv, "kv_role": "kv_producer"}))
    d = serve("--kv-transfer-config", json.dumps({**kv, "kv_role": "kv_consumer"}))
    procs = [p, d]
    text = " ".join(f"word{i}" for i in range(args.prompt_words))
    messages = [{"role": "user", "content": text}]
    processor = load_processor(ensure_builtin_checkpoint())
    parts = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    ids = processor.process_chat(parts, []).prompt_token_ids
    sampling = {"max_tokens": args.decode_tokens, "temperature": 0, "ignore_eos": True}
    chat_body = {"model": MODEL, "messages": messages, **sampling}
    gen_body = {"token_ids": ids, "sampling_params": sampling}
    times: dict[str, list[float]] = {"chat": [], "generate": []}
    try:
        for proc in procs:
            proc.wait()
        computed0 = d.metric("prompt_tokens_computed_total")
        received0 = d.metric("kv_tokens_received_total")
        with httpx.Client(timeout=600) as client:
            for i in range(args.pd_iterations + 1):
                for kind, path, body in (
                    ("chat", "/v1/chat/completions", chat_body),
                    ("generate", "/inference/v1/generate", gen_body),
                ):
                    first = json.loads(json.dumps(body))
                    first["kv_transfer_params"] = {"do_remote_decode": True}
                    if kind == "chat":
                        first["max_tokens"] = 1
                    else:
                        first["sampling_params"]["max_tokens"] = 1
                    r = client.post(p.url + path, json=first)
                    r.raise_for_status()
                    params = r.json()["kv_transfer_params"]
                    t0 = time.perf_counter()
                    r = client.post(d.url + path, json={**body, "kv_transfer_params": params})
                    elapsed = time.perf_counter() - t0
                    r.raise_for_status()
                    if i:
                        times[kind].append(elapsed)
        n = 2 * (args.pd_iterations + 1)
        computed = d.metric("prompt_tokens_computed_total") - computed0
        received = d.metric("kv_tokens_received_total") - received0
    finally:
        for proc in procs:
            proc.stop()
    chat_ms = 1000 * statistics.median(times["chat"])
    gen_ms = 1000 * statistics.median(times["generate"])
    return {
        "prompt_tokens": len(ids),
        "decode_tokens": args.decode_tokens,
        "iterations": args.pd_iterations,
        "decode_round_trip_chat_ms": chat_ms,
        "decode_round_trip_generate_ms": gen_ms,
        "ratio_generate_over_chat": gen_ms / chat_ms,
        "decode_prompt_tokens_computed": computed,
        "decode_kv_tokens_received": received,
        "decode_requests": n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--pd-iterations", type=int, default=10)
    ap.add_argument("--media", choices=("image", "video"), default="image")
    ap.add_argument("--video-frames", type=int, default=16)
    ap.add_argument("--only", choices=("epd", "generate"), help="one measurement alone")
    args = ap.parse_args()
    # One transfer secret for every instance and the proxy, as in a deployment: without
    # it (or --transfer-peers) a consumer ignores the transfer params it is sent and
    # encodes or prefills by itself, and nothing disaggregated would be measured.
    os.environ.setdefault("EC_FRONTEND_TRANSFER_SECRET", secrets.token_hex(16))
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load": os.getloadavg(),
        },
        "settings": vars(args),
    }
    if args.only != "epd":
        results["generate_through_pd"] = bench_generate_through_pd(args)
        print(json.dumps(results["generate_through_pd"], indent=1), flush=True)
    if args.only != "generate":
        results["epd_vs_aggregated"] = bench_epd_vs_agg(args)
    out = RESULTS.with_name("bench_disagg_video.json") if args.media == "video" else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    if "epd_vs_aggregated" not in results:
        return
    summary = {k: v for k, v in results["epd_vs_aggregated"].items() if k != "rounds"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
