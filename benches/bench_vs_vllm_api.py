"""Requests/s and TTFT of ``ec-frontend serve --mock-engine`` against vLLM's own API
server layer over a stub engine, both measured by ``vllm bench serve``.

The vLLM side is ``benches/vllm_api_stub_driver.py``: vLLM 0.33.0's unmodified
``build_app`` + ``init_app_state`` (chat template, tokenizer and Hugging Face image
processor run in its process, as in ``vllm serve``) with an in-process engine
client that echoes tokens as ec-frontend's mock engine does. ec-frontend runs its
default ``serve --mock-engine`` with ``EC_FRONTEND_MOCK_IMAGE_MODEL`` set, so its
mock processor preprocesses every image with the checkpoint's image processor.
Both load the built-in checkpoint's configuration, neither loads weights, and both
generate ``--output-len`` tokens per request, one stream chunk per token.

One ``vllm bench serve`` process (vLLM's client, from ``.venv-vllm``, through
``tests/interop/bench_driver.py``) runs every measurement: a warm-up run per server
and scenario, then ``--rounds`` rounds that alternate which server goes first.
Scenarios: streamed chat without an image, and with one ``--image-size`` image
(``random-mm`` dataset; one seed per round, so both servers get the same prompts
and images in a round, and new ones the next round: vLLM's multimodal processor
cache gets no hits from a repeated image). The same two without streaming
(``"stream": false``, the whole answer in one response): ``vllm bench serve``
only streams, so these go through this script's own light client (``httptools``,
``--concurrency`` keep-alive connections), with prompts built alike: random token
ids of the checkpoint's tokenizer decoded to ``--input-len`` tokens of text, and a
random-noise JPEG, new ones every round, the same for both servers.

Reported per scenario: the median over rounds of requests/s, TTFT p50 and p99
(end-to-end latency without streaming), and each server's CPU time per
request (its process tree, and its API process alone, from ``/proc``); the
ratio is ec-frontend's requests/s over vLLM's.

ec-frontend's mock engine tokenizes by characters and renders a plain
``role: text`` prompt, where vLLM's layer renders the checkpoint's chat template
and tokenizes with its tokenizer. So that the difference is not hidden, the
benchmark also times ec-frontend's real input processor (template + tokenizer,
the work its server does for a model) on prompts of the same length and reports
ec-frontend's CPU per request with that time added. Writes
``benches/results/bench_vs_vllm_api.json``.

Run: ``.venv/bin/python benches/bench_vs_vllm_api.py [--rounds 3] [--num-prompts 200]``
(needs ``bash scripts/setup_vllm.sh`` first).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
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
from ec_frontend.model.builtin import ensure_builtin_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine_proc import LightConnection

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results" / "bench_vs_vllm_api.json"
STUB_DRIVER = ROOT / "benches" / "vllm_api_stub_driver.py"
BENCH_DRIVER = ROOT / "tests" / "interop" / "bench_driver.py"
MODEL = "tiny"
SERVERS = ("ec-frontend", "vllm-api")
SUMMARY_KEYS = (
    "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "server_cpu_ms_per_request",
    "api_process_cpu_ms_per_request", "server_busy_cores",
)  # fmt: skip
WHOLE_KEYS = (
    "requests_per_s", "e2el_p50_ms", "e2el_p99_ms", "server_cpu_ms_per_request",
    "api_process_cpu_ms_per_request", "server_busy_cores",
)  # fmt: skip
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_sample(servers: dict[str, Server]) -> dict[str, tuple[float, float]]:
    """Per server: (CPU seconds of its process tree, of its API process alone)."""
    return {
        name: (sum(cpu_seconds(p) for p in tree_pids(s.proc.pid)), cpu_seconds(s.proc.pid))
        for name, s in servers.items()
    }


class Server:
    """A server process on a free loopback port, its output in a temporary file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        argv = [a.format(port=self.port) for a in argv]
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy in {timeout_s} s:\n{self.tail()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def start_servers(
    model: Path, vllm_python: Path, latency_ms: float, ec_args: list[str]
) -> dict[str, Server]:
    ours = Server(
        "ec-frontend",
        [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--mock-engine",
         "--model", str(model), "--served-model-name", MODEL, "--port", "{port}",
         "--max-model-len", "4096", "--log-level", "warning",
         "--mock-token-latency-ms", str(latency_ms), *ec_args],
        {"EC_FRONTEND_MOCK_IMAGE_MODEL": str(model)},
    )  # fmt: skip
    env = {k: v for k, v in OFFLINE.items()}
    vllm = Server(
        "vllm-api",
        [str(vllm_python), str(STUB_DRIVER), "--model", str(model),
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", "{port}",
         "--max-model-len", "4096", "--disable-uvicorn-access-log",
         "--stub-token-latency-ms", str(latency_ms)],
        env,
    )  # fmt: skip
    servers = {"ec-frontend": ours, "vllm-api": vllm}
    try:
        for server in servers.values():
            server.wait_ready(300)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def scenario_args(items: int, image_size: int) -> list[str]:
    """``random-mm`` with ``items`` images per request (0: text only, and no prompt
    re-alignment through ``/tokenize``, so both servers get the same text)."""
    return [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--dataset-name", "random-mm",
        "--random-mm-base-items-per-request", str(items),
        "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
        "--random-mm-bucket-config", f"{{({image_size}, {image_size}, 1): 1.0}}",
    ]  # fmt: skip


def plan(
    args: argparse.Namespace, servers: dict[str, Server], model: Path, out: Path
) -> list[dict[str, Any]]:
    """Every ``vllm bench serve`` run, in order: warm-ups, then alternating rounds."""
    scenarios = {
        "chat": scenario_args(0, args.image_size),
        "chat+image": scenario_args(1, args.image_size),
    }
    runs: list[dict[str, Any]] = []

    def add(label: str, scenario: str, server: str, prompts: int, seed: int) -> None:
        name = f"{label}.{scenario}.{server}"
        runs.append({
            "name": name, "scenario": scenario, "server": server, "label": label,
            "argv": [
                *scenarios[scenario],
                "--base-url", servers[server].url, "--model", MODEL, "--tokenizer", str(model),
                "--num-prompts", str(prompts), "--max-concurrency", str(args.concurrency),
                "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
                "--temperature", "0", "--ignore-eos", "--seed", str(seed),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                "--disable-tqdm", "--save-result", "--result-dir", str(out),
                "--result-filename", f"{name}.json",
            ],
        })  # fmt: skip

    for scenario in scenarios:
        for server in SERVERS:
            add("warmup", scenario, server, args.warmup_prompts, 1000)
    for r in range(args.rounds):
        order = SERVERS if r % 2 == 0 else SERVERS[::-1]
        for scenario in scenarios:
            for server in order:
                add(f"round{r}", scenario, server, args.num_prompts, r)
    return runs


def run_client(
    vllm_python: Path, runs: list[dict[str, Any]], servers: dict[str, Server], out: Path
) -> tuple[dict[str, tuple[float, float]], str]:
    """Run every run in one client process; each run's server CPU seconds (the CPU its
    target server's process tree and API process used between the run's start marker
    and the next one), and the client's output."""
    spec = out / "runs.json"
    spec.write_text(json.dumps([{"name": r["name"], "argv": r["argv"]} for r in runs]))
    env = {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.Popen(
        [str(vllm_python), str(BENCH_DRIVER), str(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=out,
    )
    marks: list[tuple[str, dict[str, tuple[float, float]]]] = []
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("=== "):
            marks.append((line[4:].strip(), cpu_sample(servers)))
    proc.wait()
    end = cpu_sample(servers)
    by_name = {r["name"]: r["server"] for r in runs}
    cpu_used: dict[str, tuple[float, float]] = {}
    for i, (name, cpu) in enumerate(marks):
        after = marks[i + 1][1] if i + 1 < len(marks) else end
        server = by_name[name]
        cpu_used[name] = (after[server][0] - cpu[server][0], after[server][1] - cpu[server][1])
    return cpu_used, "".join(lines)


def summarize(
    runs: list[dict[str, Any]], cpu_used: dict[str, tuple[float, float]], out: Path, output: str
) -> dict[str, Any]:
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        if run["label"] == "warmup":
            continue
        path = out / f"{run['name']}.json"
        if not path.is_file():
            raise RuntimeError(f"no result for {run['name']}:\n{output[-6000:]}")
        res = json.loads(path.read_text())
        tree, api = cpu_used[run["name"]]
        requests = res["completed"] + 1  # and the client's initial test request
        row = {
            "round": run["label"],
            "completed": res["completed"],
            "failed": res["failed"],
            "output_tokens": res["total_output_tokens"],
            "requests_per_s": res["request_throughput"],
            "output_tokens_per_s": res["output_throughput"],
            "ttft_p50_ms": res["p50_ttft_ms"],
            "ttft_p99_ms": res["p99_ttft_ms"],
            "tpot_p50_ms": res["p50_tpot_ms"],
            "e2el_p50_ms": res["p50_e2el_ms"],
            "server_cpu_ms_per_request": 1000 * tree / requests,
            "api_process_cpu_ms_per_request": 1000 * api / requests,
            # below 1: the server waited for the client (or for other load on the host)
            "server_busy_cores": tree / res["duration"],
        }
        rows.setdefault(run["scenario"], {}).setdefault(run["server"], []).append(row)
    return scenario_summaries(rows, SUMMARY_KEYS)


def scenario_summaries(
    rows: dict[str, dict[str, list[dict[str, Any]]]], keys: tuple[str, ...]
) -> dict[str, Any]:
    """Per scenario: the medians of ``keys`` over rounds, and ec-frontend's ratios."""
    summary: dict[str, Any] = {}
    for scenario, by_server in rows.items():
        med = {
            server: {key: statistics.median(r[key] for r in rs) for key in keys}
            for server, rs in by_server.items()
        }
        ours, theirs = by_server["ec-frontend"], by_server["vllm-api"]
        summary[scenario] = {
            "median": med,
            "ratio_requests_per_s": med["ec-frontend"]["requests_per_s"]
            / med["vllm-api"]["requests_per_s"],
            "ratio_per_round": [
                a["requests_per_s"] / b["requests_per_s"] for a, b in zip(ours, theirs, strict=True)
            ],
            "ratio_server_cpu_per_request": med["vllm-api"]["server_cpu_ms_per_request"]
            / med["ec-frontend"]["server_cpu_ms_per_request"],
            "ratio_api_process_cpu_per_request": med["vllm-api"]["api_process_cpu_ms_per_request"]
            / med["ec-frontend"]["api_process_cpu_ms_per_request"],
            "failed": {s: sum(r["failed"] for r in rs) for s, rs in by_server.items()},
            "output_tokens": {s: [r["output_tokens"] for r in rs] for s, rs in by_server.items()},
            "rounds": by_server,
        }
    return summary


class WholeConnection(LightConnection):
    """:mod:`bench_engine_proc`'s light connection, posting non-streamed chats: per
    response only the C parser's callbacks and one ``json.loads``."""

    def on_body(self, body: bytes) -> None:
        self._pending += body

    async def chat_whole(self, payload: bytes) -> tuple[int, bytes]:
        """(status, body) of one chat."""
        assert self._transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self._pending = b""
        self._transport.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(payload), payload)
        )
        await self._done
        return self._parser.get_status_code(), self._pending


def whole_bodies(
    model: Path,
    count: int,
    input_len: int,
    output_len: int,
    image_size: int,
    image: bool,
    seed: int,
) -> list[bytes]:
    """Non-streamed chat bodies: ``input_len`` random token ids of the checkpoint's
    tokenizer as text, and with ``image`` a random-noise JPEG (as ``random-mm``)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(count):
        ids = rng.integers(0, tokenizer.vocab_size, input_len).tolist()
        content: list[dict[str, Any]] = [{"type": "text", "text": tokenizer.decode(ids)}]
        if image:
            pixels = rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, "JPEG")
            url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
            content.append({"type": "image_url", "image_url": {"url": url}})
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_completion_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": False,
        }  # fmt: skip
        bodies.append(json.dumps(body).encode())
    return bodies


async def run_whole(server: Server, bodies: list[bytes], concurrency: int) -> dict[str, Any]:
    """Send ``bodies`` over ``concurrency`` connections; requests/s, latencies, and
    the responses that failed or did not carry every output token."""
    conns = [await WholeConnection.open(server.port) for _ in range(concurrency)]
    assert all(isinstance(c, WholeConnection) for c in conns)
    todo = list(reversed(bodies))
    latencies: list[float] = []
    failed = 0
    tokens = 0

    async def worker(conn: Any) -> None:
        nonlocal failed, tokens
        while todo:
            payload = todo.pop()
            start = time.perf_counter()
            status, body = await conn.chat_whole(payload)
            latencies.append(time.perf_counter() - start)
            if status != 200:
                failed += 1
                continue
            tokens += json.loads(body)["usage"]["completion_tokens"]

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for c in conns:
            c.close()
    duration = time.perf_counter() - start
    latencies.sort()
    return {
        "completed": len(bodies) - failed,
        "failed": failed,
        "output_tokens": tokens,
        "duration": duration,
        "requests_per_s": (len(bodies) - failed) / duration,
        "e2el_p50_ms": 1000 * latencies[len(latencies) // 2],
        "e2el_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


def whole_rounds(
    args: argparse.Namespace, servers: dict[str, Server], model: Path
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The non-streamed scenarios: a warm-up per server, then alternating rounds."""
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for scenario, image in (("chat (whole)", False), ("chat+image (whole)", True)):

        def make(n: int, seed: int, image: bool = image) -> list[bytes]:
            return whole_bodies(
                model, n, args.input_len, args.output_len, args.image_size, image, seed
            )

        warm = make(args.warmup_prompts, 1000)
        for name in SERVERS:
            asyncio.run(run_whole(servers[name], warm, args.concurrency))
        for r in range(args.rounds):
            bodies = make(args.num_prompts, r)
            for name in SERVERS if r % 2 == 0 else SERVERS[::-1]:
                before = cpu_sample(servers)[name]
                row = asyncio.run(run_whole(servers[name], bodies, args.concurrency))
                after = cpu_sample(servers)[name]
                tree, api = after[0] - before[0], after[1] - before[1]
                row["round"] = f"round{r}"
                row["server_cpu_ms_per_request"] = 1000 * tree / len(bodies)
                row["api_process_cpu_ms_per_request"] = 1000 * api / len(bodies)
                row["server_busy_cores"] = tree / row["duration"]
                rows.setdefault(scenario, {}).setdefault(name, []).append(row)
    return rows


def template_cost_ms(model: Path, input_len: int, count: int = 200) -> float:
    """CPU ms per request of ec-frontend's real input processor (chat template and
    tokenizer) on single-message chats of ``input_len`` random tokens: the work a
    served model adds over the mock's character tokenizer."""
    from ec_frontend.model.loader import load_processor

    processor = load_processor(model)
    tokenizer = processor.tokenizer
    rng = random.Random(0)
    chats = [
        [{"role": "user", "content": [{"type": "text", "text": tokenizer.decode(
            [rng.randrange(tokenizer.vocab_size) for _ in range(input_len)])}]}]
        for _ in range(count)
    ]  # fmt: skip
    for chat in chats[:20]:
        processor.process_chat(chat, [])
    start = time.process_time()
    for chat in chats:
        processor.process_chat(chat, [])
    return 1000 * (time.process_time() - start) / count


def engine_mode(server: Server) -> str:
    """How the ec-frontend server runs its (mock) engine, observed from its processes."""
    children = len(tree_pids(server.proc.pid)) - 1
    if children == 0:
        return "engine in the API process (one process)"
    return f"engine outside the API process ({children + 1} processes)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--warmup-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--token-latency-ms", type=float, default=0.0)
    p.add_argument(
        "--ec-frontend-args",
        default="",
        help="more `ec-frontend serve` flags, one string (e.g. '--engine-mode inprocess')",
    )
    p.add_argument("--streamed-only", action="store_true", help="skip the non-streamed scenarios")
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    vllm_python = args.vllm_venv / "bin" / "python"
    if not vllm_python.is_file():
        sys.exit(f"{vllm_python} is missing: run `bash scripts/setup_vllm.sh`")
    model = ensure_builtin_checkpoint()
    ec_args = args.ec_frontend_args.split()
    servers = start_servers(model, vllm_python, args.token_latency_ms, ec_args)
    mode = engine_mode(servers["ec-frontend"])
    load_before = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
            out = Path(tmp)
            runs = plan(args, servers, model, out)
            cpu_used, output = run_client(vllm_python, runs, servers, out)
            summary = summarize(runs, cpu_used, out, output)
        if not args.streamed_only:
            summary.update(scenario_summaries(whole_rounds(args, servers, model), WHOLE_KEYS))
    finally:
        for server in servers.values():
            server.stop()

    template_ms = template_cost_ms(model, args.input_len)
    print(f"ec-frontend: serve --mock-engine {' '.join(ec_args)}".rstrip() + f", {mode}")
    print(f"ec-frontend's real chat template + tokenizer: {template_ms:.3f} ms CPU per request")
    for scenario, s in summary.items():
        for server in SERVERS:
            m = s["median"][server]
            first = "TTFT" if "ttft_p50_ms" in m else "E2E "
            p50 = m.get("ttft_p50_ms", m.get("e2el_p50_ms"))
            p99 = m.get("ttft_p99_ms", m.get("e2el_p99_ms"))
            print(
                f"{scenario:11s} {server:12s} {m['requests_per_s']:8.1f} req/s  "
                f"{first} p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  "
                f"server CPU {m['server_cpu_ms_per_request']:6.2f} ms/req, "
                f"{m['server_busy_cores']:.2f} cores (API process "
                f"{m['api_process_cpu_ms_per_request']:.2f} ms/req)  "
                f"failed {s['failed'][server]}"
            )
        ours_cpu = s["median"]["ec-frontend"]["server_cpu_ms_per_request"] + template_ms
        s["ratio_server_cpu_per_request_with_template"] = (
            s["median"]["vllm-api"]["server_cpu_ms_per_request"] / ours_cpu
        )
        rounds = ", ".join(f"{x:.2f}" for x in s["ratio_per_round"])
        print(
            f"{scenario:11s} ratio {s['ratio_requests_per_s']:.2f}x req/s (rounds: {rounds}); "
            f"server CPU per request {s['ratio_server_cpu_per_request']:.2f}x less "
            f"({s['ratio_server_cpu_per_request_with_template']:.2f}x with the template cost; "
            f"API process alone {s['ratio_api_process_cpu_per_request']:.2f}x less)"
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    result = {
        "benchmark": "bench_vs_vllm_api",
        "command": "python benches/bench_vs_vllm_api.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "ec_frontend_mode": f"serve --mock-engine {' '.join(ec_args)}".rstrip() + f", {mode}",
        "vllm": "0.33.0 API server layer (build_app + init_app_state) over a stub engine client",
        "settings": {k: v for k, v in vars(args).items() if k not in ("vllm_venv", "out")},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
        "ec_frontend_template_tokenize_ms_per_request": template_ms,
        "results": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
