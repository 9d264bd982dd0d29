"""Seconds from ``ec-frontend serve`` to a healthy ``/health``, per engine mode.

The built-in model and ``--mock-engine``, each with the engine in its own process
(the default) and in the server's process (``--engine-mode inprocess``, the
baseline: one interpreter, one set of imports), in alternating rounds so that each
mode sees the same host load. Prints the median per mode and the multiprocess /
in-process ratio; writes ``benches/results/bench_startup.json``.

Run: ``.venv/bin/python benches/bench_startup.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))

from bench_serving import launch_server  # noqa: E402

RESULTS = ROOT / "benches" / "results"
MODES: dict[str, list[str]] = {
    "builtin multiprocess": [],
    "builtin inprocess": ["--engine-mode", "inprocess"],
    "mock multiprocess": ["--mock-engine"],
    "mock inprocess": ["--mock-engine", "--engine-mode", "inprocess"],
}


def time_to_health(flags: list[str]) -> float:
    start = time.perf_counter()
    proc, _ = launch_server(["--log-level", "warning", *flags])
    elapsed = time.perf_counter() - start
    proc.terminate()
    proc.wait(60)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    time_to_health([])  # the built-in checkpoint is written once, not timed
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, flags in MODES.items():
            samples[mode].append(time_to_health(flags))
    medians = {mode: statistics.median(v) for mode, v in samples.items()}
    ratios = {
        kind: medians[f"{kind} multiprocess"] / medians[f"{kind} inprocess"]
        for kind in ("builtin", "mock")
    }
    for mode, value in medians.items():
        rounds = ", ".join(f"{v:.2f}" for v in samples[mode])
        print(f"{mode:22s} {value:6.2f} s  (rounds: {rounds})")
    for kind, ratio in ratios.items():
        print(f"{kind}: multiprocess / in-process startup = {ratio:.2f}x")
    result = {
        "bench": "bench_startup",
        "rounds": args.rounds,
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "median_s": {m: round(v, 3) for m, v in medians.items()},
        "samples_s": {m: [round(x, 3) for x in v] for m, v in samples.items()},
        "multiprocess_over_inprocess": {k: round(v, 3) for k, v in ratios.items()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_startup.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
