"""The engine core in its own process vs in a thread of the server: streamed chat.

For each model (the built-in tiny Qwen2-VL, and a mid-size Qwen2-VL config with
``--load-format dummy`` weights) and each ``--engine-mode`` (``inprocess``,
``multiprocess``), one ``ec-frontend serve`` process runs on loopback and serves
streamed chat completions with one image (a different PNG per request, so the
image processor and the vision encoder run every time), ``ignore_eos`` and
``--max-tokens`` each, at concurrency 1, 8 and 32 (``concurrency`` client tasks
pulling from a queue of ``max(2 x concurrency, --min-requests)`` requests).
Measured per run: output tokens/s of wall time, TTFT and ITL p50/p99 from the
client's clock (each SSE chunk with content is a token; the final usage chunk
gives the token count), and CPU seconds per request of the server process
(``/proc``; for multiprocess, of the frontend and engine processes apart) and of
this client.

The client runs on the same cores as the server, so what it spends is taken from
the server. ``--client light`` (the default) keeps one keep-alive connection per
concurrent stream and parses responses with httptools and orjson: about 0.6 ms of
CPU per request of 32 tokens. ``--client httpx`` (httpx's streaming line iterator
and ``json``) spends about 6 ms, a third of the host at concurrency 32, and caps
both modes near the same figure.

The ceiling: the same model's engine core stepped directly by this process (no
server, no HTTP, no detokenization; each request's chat template, tokenization and
image preprocessing done before the clock starts), at each concurrency with the same
requests and the engine process's torch threads. No arrangement of server processes
can serve more output tokens/s than this; ``ceiling_over_inprocess_tok_s`` is the
most the multiprocess engine could gain over the in-process one on this host.

``--mock`` adds ``--mock-engine`` servers: frontend CPU per request of the
multiprocess mock (the mock model behind the engine core in its own process)
against the in-process mock engine.

Both modes run in the same invocation, modes alternating per model, so
background load hits both alike. Writes ``benches/results/bench_engine_proc.json``.

Run: ``.venv/bin/python benches/bench_engine_proc.py [--max-tokens 48] [--mock]
[--concurrency 32] [--rounds 5] [--client httpx] [--no-ceiling] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results" / "bench_engine_proc.json"
MODES = ("inprocess", "multiprocess")
CONCURRENCY = (1, 8, 32)
#: A loaded 2-core host can take minutes to import torch twice and build a model.
START_TIMEOUT_S = 900
#: The mid-size config: a Qwen2-VL of ~40M parameters (dummy weights).
MID_SIZE = {
    "hidden_size": 384,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "rope_scaling": {"mrope_section": [8, 12, 12], "type": "mrope"},  # head_dim 64
    "vision": {"depth": 4, "embed_dim": 128, "hidden_size": 384, "num_heads": 4},
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mid_size_checkpoint(builtin: Path, into: Path, size: dict[str, Any] | None = None) -> Path:
    """The built-in checkpoint's tokenizer and processor with a bigger config
    (:data:`MID_SIZE`, or ``size`` in its form)."""
    size = MID_SIZE if size is None else size
    into.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(builtin):
        if not name.endswith(".safetensors"):
            shutil.copy(builtin / name, into / name)
    config = json.loads((builtin / "config.json").read_text())
    vision = size["vision"]
    config.update({k: v for k, v in size.items() if k != "vision"})
    config["vision_config"].update(vision)
    (into / "config.json").write_text(json.dumps(config))
    return into


def png_url(seed: int, size: int = 112) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Server:
    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        program: Callable[[int], list[str]] | None = None,
    ) -> None:
        """``program``: the command for a port, in place of ``ec-frontend serve`` (the
        server's flags, ``args``, then come to it in ``env``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if program is None:
            cmd = [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve"]
            cmd += ["--port", str(self.port), "--log-level", "warning", "--served-model-name", "m"]
            cmd += args
        else:
            cmd = program(self.port)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{cmd} exited: {self.log.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            self.proc.kill()
            raise RuntimeError(f"{cmd} did not start")
        self.engine_pids = [c for c in children(self.proc.pid) if _is_engine(c)]

    def cpu(self) -> tuple[float, float]:
        """(frontend, engine) CPU seconds so far."""
        return cpu_seconds(self.proc.pid), sum(cpu_seconds(p) for p in self.engine_pids)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _is_engine(pid: int) -> bool:
    try:
        return b"core_proc" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[float, list[float], int]:
    """(TTFT, inter-token gaps, output tokens) of one streamed chat, through httpx."""
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens = _event(json.loads(line[6:]), stamps, tokens)
    return _timings(start, stamps, tokens)


def _event(chunk: dict[str, Any], stamps: list[float], tokens: int) -> int:
    """Stamps a chunk with content; the token count (from the usage chunk)."""
    if "error" in chunk:
        raise RuntimeError(chunk["error"])
    if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices", ()):
        if choice.get("delta", {}).get("content"):
            stamps.append(time.perf_counter())
    return tokens


def _timings(start: float, stamps: list[float], tokens: int) -> tuple[float, list[float], int]:
    if not stamps:
        raise RuntimeError("no content came back")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - start, gaps, tokens


class LightConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection for streamed chats, parsed with httptools.

    The benchmark client shares the host's two cores with the server, so what it
    spends per request is taken from the server: this one does per chunk only the
    C parser's callback, a split and ``orjson.loads`` (httpx's line iterator and
    ``json`` cost several times that).
    """

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[None] | None = None
        self._pending = b""
        self._stamps: list[float] = []
        self._tokens = 0
        self._error: bytes | None = None

    @classmethod
    async def open(cls, port: int) -> LightConnection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, "127.0.0.1", port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except Exception as exc:  # a malformed response ends the request with it
            if self._done is not None and not self._done.done():
                self._done.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc or ConnectionError("the server closed the connection"))

    def on_body(self, body: bytes) -> None:
        if self._parser.get_status_code() != 200:
            self._error = (self._error or b"") + body
            return
        events = (self._pending + body).split(b"\n\n")
        self._pending = events.pop()
        for event in events:
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                self._tokens = _event(orjson.loads(event[6:]), self._stamps, self._tokens)

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    async def chat(self, body: dict[str, Any]) -> tuple[float, list[float], int]:
        """(TTFT, inter-token gaps, output tokens) of one streamed chat."""
        assert self._transport is not None
        payload = orjson.dumps(body)
        self._done = asyncio.get_running_loop().create_future()
        self._pending, self._stamps, self._tokens, self._error = b"", [], 0, None
        start = time.perf_counter()
        self._transport.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(payload), payload)
        )
        await self._done
        status = self._parser.get_status_code()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(self._error or b'')[:300]!r}")
        return _timings(start, self._stamps, self._tokens)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def run_level(
    server: Server,
    concurrency: int,
    requests: int,
    max_tokens: int,
    seed: int,
    image: bool,
    client: str = "light",
) -> dict[str, Any]:
    bodies = chat_bodies(requests, max_tokens, seed, image)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    ttfts: list[float] = []
    itls: list[float] = []
    total = 0

    async def worker(ask: Callable[[dict[str, Any]], Awaitable[tuple[float, list[float], int]]]):
        nonlocal total
        while not queue.empty():
            body = queue.get_nowait()
            ttft, gaps, tokens = await ask(body)
            ttfts.append(ttft)
            itls.extend(gaps)
            total += tokens

    async with contextlib.AsyncExitStack() as stack:
        if client == "light":
            conns = [await LightConnection.open(server.port) for _ in range(concurrency)]
            stack.callback(lambda: [c.close() for c in conns])
            asks = [c.chat for c in conns]
        else:
            limits = httpx.Limits(max_connections=concurrency + 4)
            pool = await stack.enter_async_context(httpx.AsyncClient(timeout=600, limits=limits))
            asks = [functools.partial(one_request, pool, server.url)] * concurrency
        cpu0, client0 = server.cpu(), time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(ask) for ask in asks))
        wall = time.perf_counter() - t0
        cpu1, client_cpu = server.cpu(), time.process_time() - client0
    return {
        "concurrency": concurrency,
        "requests": requests,
        "output_tokens": total,
        "wall_s": round(wall, 3),
        "output_tok_s": round(total / wall, 1),
        "ttft_p50_ms": round(pct(ttfts, 50) * 1e3, 2),
        "ttft_p99_ms": round(pct(ttfts, 99) * 1e3, 2),
        "itl_p50_ms": round(pct(itls, 50) * 1e3, 2),
        "itl_p99_ms": round(pct(itls, 99) * 1e3, 2),
        "frontend_cpu_ms_per_request": round((cpu1[0] - cpu0[0]) / requests * 1e3, 2),
        "engine_cpu_ms_per_request": round((cpu1[1] - cpu0[1]) / requests * 1e3, 2),
        "client_cpu_ms_per_request": round(client_cpu / requests * 1e3, 2),
    }


def chat_bodies(requests: int, max_tokens: int, seed: int, image: bool) -> list[dict[str, Any]]:
    bodies = []
    for i in range(requests):
        content: list[dict[str, Any]] = [{"type": "text", "text": f"Describe image {i}."}]
        if image:
            content.insert(0, {"type": "image_url", "image_url": {"url": png_url(seed + i)}})
        bodies.append(
            {
                "model": "m",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    return bodies


class _Image:
    """What the input processor reads of a media item."""

    def __init__(self, url: str) -> None:
        from ec_frontend import _core

        self.data = base64.b64decode(url.split(",", 1)[1])
        self.mm_hash = _core.compute_mm_hash(self.data)


def ceiling(args: list[str], opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Output tokens/s of the engine core alone (see the module doc), per concurrency."""
    import torch
    from ec_frontend.engine.builder import (
        build_core,
        cpu_threads,
        engine_config,
        engine_process_threads,
    )
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.entrypoints.launcher import ServeOptions
    from ec_frontend.model.builtin import BUILTIN_MODEL_ID

    flags = argparse.ArgumentParser(add_help=False)
    for flag in ("--model", "--load-format", "--device"):
        flags.add_argument(flag)
    flags.add_argument("--max-model-len", type=int)
    known, _ = flags.parse_known_args(args)
    serve = ServeOptions(
        model=known.model,
        device=known.device,
        max_model_len=known.max_model_len,
        load_format=known.load_format or "auto",
    )
    config, _ = engine_config(serve)
    threads = cpu_threads(serve, builtin=config.model_id == BUILTIN_MODEL_ID)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or engine_process_threads(len(os.sched_getaffinity(0))))
    core, processor = build_core(config)
    rows = []
    try:
        for c in opts.concurrency:
            n = max(2 * c, opts.min_requests)
            inputs = []
            for body in chat_bodies(n, opts.max_tokens, 1000 * c, image=True):
                content = body["messages"][0]["content"]
                parts = [
                    {"type": "image", "media_index": 0} if p["type"] == "image_url" else p
                    for p in content
                ]
                media = [_Image(p["image_url"]["url"]) for p in content if "image_url" in p]
                messages = [{"role": "user", "content": parts}]
                inputs.append(processor().process_chat(messages, media))
            params = SamplingParams(max_tokens=opts.max_tokens, ignore_eos=True, temperature=0)
            waiting = list(enumerate(inputs))
            tokens = running = 0
            cpu0, t0 = time.process_time(), time.perf_counter()
            while waiting or running:
                while waiting and running < c:
                    i, prompt = waiting.pop(0)
                    core.add_request(f"ceiling-{c}-{i}", prompt, params)
                    running += 1
                for out in core.step():
                    tokens += len(out.token_ids)
                    if out.finished:
                        if out.finish_reason != "length":
                            raise RuntimeError(f"{out.request_id}: {out.finish_reason} {out.error}")
                        running -= 1
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            rows.append(
                {
                    "concurrency": c,
                    "requests": n,
                    "output_tokens": tokens,
                    "wall_s": round(wall, 3),
                    "output_tok_s": round(tokens / wall, 1),
                    "engine_cpu_ms_per_request": round(cpu / n * 1e3, 2),
                }
            )
    finally:
        del core
        torch.set_num_threads(previous)
    return rows


def write_report(
    out: Path, med: dict[str, Any], ratios: dict[str, Any], runs: dict[str, Any]
) -> None:
    """Writes a comparison's results JSON (with the command and the host's load) and
    prints its medians and ratios."""
    host = {"cpus": os.cpu_count(), "load": os.getloadavg()}
    command = " ".join([Path(sys.executable).name, *sys.argv])
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "host": host, "medians": med, "ratios": ratios, "rounds": runs}
    out.write_text(json.dumps(report, indent=2) + "\n")
    for name, m in med.items():
        print(f"median {name:14s} {m}")
    print(ratios)
    print(f"wrote {out}")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of median output tokens/s among rounds, with every round's figure."""
    ordered = sorted(rows, key=lambda r: r["output_tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds_tok_s": [r["output_tok_s"] for r in rows]}


def bench_model(
    name: str, args: list[str], opts: argparse.Namespace, image: bool = True
) -> dict[str, Any]:
    """Per mode (and the ceiling), a row per concurrency: with several rounds (every
    mode once per round, in turn), the round of median output tokens/s."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}

    def keep(mode: str, row: dict[str, Any], note: str) -> None:
        runs.setdefault(mode, {}).setdefault(row["concurrency"], []).append(row)
        print(f"{name:9s} {mode:12s} c={row['concurrency']:<3d} {row['output_tok_s']:8.1f} tok/s  "
              + note, flush=True)  # fmt: skip

    for _ in range(opts.rounds):
        for mode in opts.modes:
            server = Server([*args, "--engine-mode", mode])
            try:
                asyncio.run(run_level(server, 2, 4, 4, 10_000, image, opts.client))  # warm-up
                for c in opts.concurrency:
                    n = max(2 * c, opts.min_requests)
                    level = run_level(server, c, n, opts.max_tokens, 1000 * c, image, opts.client)
                    row = asyncio.run(level)
                    keep(
                        mode,
                        row,
                        f"TTFT p50 {row['ttft_p50_ms']:7.1f} p99 {row['ttft_p99_ms']:7.1f} ms  "
                        f"ITL p50 {row['itl_p50_ms']:6.1f} p99 {row['itl_p99_ms']:7.1f} ms  "
                        f"CPU/req frontend {row['frontend_cpu_ms_per_request']:.1f} ms "
                        f"engine {row['engine_cpu_ms_per_request']:.1f} ms "
                        f"client {row['client_cpu_ms_per_request']:.1f} ms",
                    )
            finally:
                server.stop()
        if image and not opts.no_ceiling:
            for row in ceiling(args, opts):
                note = "(the engine core alone, no server)  "
                keep("ceiling", row, note + f"CPU/req {row['engine_cpu_ms_per_request']:.1f} ms")
    results: dict[str, Any] = {
        mode: [_median_row(by_c[c]) for c in opts.concurrency] for mode, by_c in runs.items()
    }
    for label, mine, theirs in (
        ("ratio_multiprocess_over_inprocess_tok_s", "multiprocess", "inprocess"),
        ("ceiling_over_inprocess_tok_s", "ceiling", "inprocess"),
        ("multiprocess_share_of_ceiling", "multiprocess", "ceiling"),
    ):
        if mine in results and theirs in results:
            results[label] = {
                str(a["concurrency"]): round(b["output_tok_s"] / a["output_tok_s"], 3)
                for a, b in zip(results[theirs], results[mine], strict=True)
            }
            print(f"{name:9s} {label}: {results[label]}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    ap.add_argument("--rounds", type=int, default=1, help="every mode once per round; medians")
    ap.add_argument("--models", nargs="+", default=["builtin", "mid-size"])
    ap.add_argument("--mock", action="store_true", help="also the --mock-engine CPU comparison")
    ap.add_argument(
        "--client",
        choices=("light", "httpx"),
        default="light",
        help="the benchmark's HTTP client: light (httptools + orjson) or httpx",
    )
    ap.add_argument(
        "--no-ceiling",
        action="store_true",
        help="skip the engine core stepped in this process (it uses the engine's own API)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    opts = ap.parse_args()

    from ec_frontend.model.builtin import ensure_builtin_checkpoint

    builtin = ensure_builtin_checkpoint()
    common = ["--device", "cpu", "--max-model-len", "2048"]
    report: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "max_tokens": opts.max_tokens,
        "client": opts.client,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "builtin": ["--model", str(builtin)],
            "mid-size": [
                "--model", str(mid_size_checkpoint(builtin, Path(tmp) / "mid")),
                "--load-format", "dummy",
            ],
        }  # fmt: skip
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        runs = [(name, [*models[name], *common], True) for name in opts.models]
        if opts.mock:
            runs.append(("mock", ["--mock-engine"], False))
        for name, args, image in runs:
            report[name] = bench_model(name, args, opts, image=image)
            opts.out.write_text(json.dumps(report, indent=2) + "\n")  # after each model
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
