"""This checkout (or ``--head``, a commit) against another commit, in one run: server
start-up, and any benchmark script that writes its results as JSON.

The other commit is checked out in a temporary git worktree and given this
checkout's built native module when the Rust sources of both are the same; with
``--build`` a base whose Rust differs gets its own (``maturin build``, its cargo
target in ``target/bench-against``), else the run refuses. Every measurement
alternates the two trees round by round, each tree's package first on
``PYTHONPATH``, so that background load hits both alike; medians are compared.

* Start-up: ``ec-frontend serve`` of the built-in model (and ``--mock-engine``)
  until ``/health`` answers: wall seconds, and CPU seconds of the API process and
  of its engine process (``/proc``, read just after the first healthy answer).
* ``--bench SCRIPT [ARGS...]`` (after ``--``): ``benches/SCRIPT ARGS --out FILE``
  once per tree and round; every number in the two JSON results is printed with
  its ratio (this checkout / the other commit).

Writes ``benches/results/bench_against.json`` (or ``--out``).

Run: ``.venv/bin/python benches/bench_against.py --base HEAD~1 [--head REV] [--rounds 5]
[--build] [--no-startup] [--out FILE] [-- bench_server.py --rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
STARTS: dict[str, list[str]] = {
    "builtin": [],
    "mock": ["--mock-engine"],
}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def checkout(base: str, into: Path, build: bool) -> Path:
    """A worktree of commit ``base`` at ``into`` with a native module: this checkout's
    when the Rust sources are the same, else (``build``) one built from ``base``."""
    changed = _git("diff", "--name-only", base, "--", "rust", "Cargo.toml", "Cargo.lock")
    if changed and not build:
        sys.exit(f"the Rust sources differ from {base} ({changed.split()[0]}, ...): --build")
    _git("worktree", "add", "--detach", "--quiet", str(into), base)
    package = into / "python" / "ec_frontend"
    if changed:
        wheels = into / "wheels"
        maturin = Path(sys.executable).parent / "maturin"
        subprocess.run(
            [str(maturin), "build", "--release", "--locked", "--quiet", "-o", str(wheels)],
            cwd=into,
            check=True,
            env={**os.environ, "CARGO_TARGET_DIR": str(ROOT / "target" / "bench-against")},
        )
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith("ec_frontend/_core."):
                    (package / Path(name).name).write_bytes(archive.read(name))
        return into
    native = sorted((ROOT / "python" / "ec_frontend").glob("_core.*"))
    if not native:
        sys.exit("no built native module in python/ec_frontend (run scripts/setup.sh)")
    for path in native:
        shutil.copy2(path, package / path.name)
    return into


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def start_once(tree: Path, flags: list[str]) -> dict[str, float]:
    """Wall and CPU seconds of one ``serve`` until healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(tree / "python")}
    cmd = [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "--log-level", "warning", *flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve {flags} of {tree} did not start")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        wall = time.perf_counter() - start
        api = _cpu_s(proc.pid)
        engine = sum(_cpu_s(child) for child in _children(proc.pid))
    finally:
        proc.terminate()
        proc.wait(60)
    return {"wall_s": wall, "api_cpu_s": api, "engine_cpu_s": engine, "cpu_s": api + engine}


def _leaves(value: Any, prefix: str = "") -> dict[str, float]:
    if isinstance(value, dict):
        out: dict[str, float] = {}
        for key, inner in value.items():
            out.update(_leaves(inner, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list):
        out = {}
        for i, inner in enumerate(value):
            label = inner.get("concurrency", i) if isinstance(inner, dict) else i
            out.update(_leaves(inner, f"{prefix}[{label}]"))
        return out
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {prefix: float(value)}
    return {}


def run_bench(tree: Path, script: list[str], out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "python")}
    command = [sys.executable, str(ROOT / "benches" / script[0]), *script[1:], "--out", str(out)]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return _leaves(json.loads(out.read_text()))


def _medians(samples: list[dict[str, float]]) -> dict[str, float]:
    keys = set.intersection(*(set(s) for s in samples))
    return {k: statistics.median(s[k] for s in samples) for k in sorted(keys)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--head", help="a commit in place of this checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-startup", action="store_true", help="only the --bench script")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_against.json")
    parser.add_argument(
        "--build", action="store_true", help="build the base's native module if its Rust differs"
    )
    parser.add_argument("bench", nargs="*", help="-- SCRIPT [ARGS...]: a benchmark of benches/")
    args = parser.parse_args()
    base_rev = _git("rev-parse", "--short", args.base)
    scratch = Path(tempfile.mkdtemp(prefix="bench-against-"))
    if args.head:
        head_rev = _git("rev-parse", "--short", args.head)
        head_tree = checkout(args.head, scratch / "head", args.build)
    else:
        dirty = "+" if _git("status", "--porcelain") else ""
        head_rev = _git("rev-parse", "--short", "HEAD") + dirty
        head_tree = ROOT
    trees = {"head": head_tree, "base": checkout(args.base, scratch / "base", args.build)}
    samples: dict[str, dict[str, list[dict[str, float]]]] = {tree: {} for tree in trees}
    try:
        if not args.no_startup:
            start_once(head_tree, [])  # the built-in checkpoint is written once, not timed
        for round_no in range(args.rounds):
            for tree, path in trees.items():
                if not args.no_startup:
                    for name, flags in STARTS.items():
                        samples[tree].setdefault(f"startup {name}", []).append(
                            start_once(path, flags)
                        )
                if args.bench:
                    out = scratch / f"{tree}-{round_no}.json"
                    samples[tree].setdefault(args.bench[0], []).append(
                        run_bench(path, args.bench, out)
                    )
    finally:
        for tree in trees.values():
            if tree != ROOT:
                _git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(scratch, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "bench_against",
        "head": head_rev,
        "base": base_rev,
        "rounds": args.rounds,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "medians": {},
    }
    print(f"head {head_rev} vs base {base_rev}, medians of {args.rounds} rounds")
    for what in samples["head"]:
        head, base = _medians(samples["head"][what]), _medians(samples["base"][what])
        rows = {}
        print(f"== {what}")
        for key in sorted(set(head) & set(base)):
            ratio = head[key] / base[key] if base[key] else float("nan")
            rows[key] = {"head": head[key], "base": base[key], "head_over_base": ratio}
            print(f"  {key:60s} {head[key]:12.4g} {base[key]:12.4g}  {ratio:6.3f}x")
        result["medians"][what] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
