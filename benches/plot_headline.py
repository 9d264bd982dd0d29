"""Plots of the headline benchmarks, from their last results in ``benches/results/``.

Four panels in one figure (``benches/results/headline.png``):

* requests/s against vLLM 0.33's API server over the same stub engine
  (``bench_vs_vllm_api.json``), with the 2x goal;
* E+PD against aggregated serving on the built-in model: requests/s and TTFT p50
  (``bench_disagg.json``);
* transfer throughput, Mooncake against the side channel, per payload
  (``bench_transfer.json``);
* the second turn's TTFT with and without prefix caching (``bench_prefix.json``).

Nothing is measured here: rerun a benchmark, then this script. A results file
that is missing leaves its panel saying so.

Run: ``.venv/bin/python benches/plot_headline.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _bars(ax: Axes, labels: list[str], values: list[float], fmt: str) -> None:
    bars = ax.bar(labels, values, color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][: len(values)])
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(fmt.format(value), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)  # fmt: skip


def vs_vllm(ax: Axes, data: dict[str, Any]) -> None:
    workloads = list(data["results"])
    ratios = [data["results"][w]["ratio_requests_per_s"] for w in workloads]
    _bars(ax, workloads, ratios, "{:.2f}x")
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="goal 2x")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("requests/s, ours / vLLM API server")
    mode = "engine in its own process" if "outside" in data.get("ec_frontend_mode", "") else ""
    ax.set_title(f"vs vLLM 0.33's API server, same stub engine ({mode})", fontsize=9)
    ax.legend(fontsize=8)


def disagg(ax: Axes, data: dict[str, Any]) -> None:
    runs = data["epd_vs_aggregated"]
    names = [n for n in ("aggregated", "e+pd") if n in runs]
    rps = [runs[n]["requests_per_s"] for n in names]
    ttft = [runs[n]["ttft_p50_ms"] for n in names]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], rps, width=0.4, label="requests/s", color="#4c72b0")
    twin = ax.twinx()
    twin.bar([i + 0.2 for i in x], ttft, width=0.4, label="TTFT p50 (ms)", color="#dd8452")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("requests/s")
    twin.set_ylabel("TTFT p50 (ms)")
    ax.set_title("E+PD vs aggregated (built-in model, 2 CPU cores)", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)


def transfers(ax: Axes, data: dict[str, Any]) -> None:
    cases = [k for k, v in data.items() if isinstance(v, dict) and "mooncake_mb_s" in v]
    x = range(len(cases))
    ax.bar([i - 0.2 for i in x], [data[c]["mooncake_mb_s"] for c in cases], width=0.4,
           label="Mooncake", color="#55a868")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [data[c]["side_channel_mb_s"] for c in cases], width=0.4,
           label="side channel", color="#4c72b0")  # fmt: skip
    ax.set_xticks(list(x), cases)
    ax.set_ylabel("MB/s")
    ax.set_title("transfers on loopback", fontsize=9)
    ax.legend(fontsize=8)


def prefix(ax: Axes, data: dict[str, Any]) -> None:
    median = data["median"]
    labels = ["prefix caching", "no prefix caching"]
    values = [median["prefix_caching"]["turn2_s"], median["no_prefix_caching"]["turn2_s"]]
    _bars(ax, labels, values, "{:.1f} s")
    ax.set_ylabel("second turn TTFT (s)")
    speedup = data.get("ratios", {}).get("turn2_ttft_speedup", 0.0)
    ax.set_title(f"prefix caching, second turn ({speedup:.1f}x faster)", fontsize=9)


PANELS: list[tuple[str, Callable[[Axes, dict[str, Any]], None]]] = [
    ("bench_vs_vllm_api.json", vs_vllm),
    ("bench_disagg.json", disagg),
    ("bench_transfer.json", transfers),
    ("bench_prefix.json", prefix),
]


def main() -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (name, draw) in zip(axes.flat, PANELS, strict=True):
        data = _load(name)
        if data is None:
            ax.text(0.5, 0.5, f"no {name}", ha="center", va="center")
            ax.set_axis_off()
            continue
        draw(ax, data)
    fig.suptitle("ec-frontend headline benchmarks (benches/results/*.json)")
    fig.tight_layout()
    out = RESULTS / "headline.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out.relative_to(RESULTS.parent.parent)}")


if __name__ == "__main__":
    main()
