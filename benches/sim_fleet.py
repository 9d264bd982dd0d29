"""Fleet-scale simulation of the proxy's routing policies (no processes, no network).

It plans for a fleet this machine cannot run: 64 encoders and 128 prefill/PD
instances behind one proxy, with the policies of
``ec_frontend/entrypoints/proxy/routing.py`` deciding every request.

The workload: ``--requests`` requests, each with one image drawn from a Zipf
distribution over ``--images`` images (exponent ``--zipf``) and one shared prompt
prefix drawn the same way over ``--prefixes`` prefixes. Requests arrive at a steady
rate and hold their instance for an exponentially distributed time, so that
about ``--concurrency`` requests per instance are in flight: that in-flight count
is the load the policies see, as the proxy's would be. Each encoder keeps an LRU
cache of ``--encoder-cache`` items, each prefill instance an LRU of
``--prefix-cache`` prefixes: a request is a hit when its item (its prefix) is in
the cache of the instance it lands on. The fleet changes under the load: at 25% of
the requests a quarter of the encoders fail (their caches are gone), at 40% as
many new, empty encoders join; at 60% and 75% the same happens to prefill.

Reported per policy: the hit ratio, the load imbalance (the busiest instance's
in-flight count over the mean, sampled every 100 requests: its mean and its
maximum), and for the keyed policies, the share of 2,000 keys whose owner changed
at each membership change (a quarter of the instances: ideally 0.25). Writes
``benches/results/sim_fleet.json`` and ``sim_fleet.png``.

Run: ``.venv/bin/python benches/sim_fleet.py [--requests 40000]``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ec_frontend.entrypoints.proxy.routing import (
    ENCODER_POLICIES,
    PREFILL_POLICIES,
    Router,
)

RESULTS = Path(__file__).parent / "results"


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[int, None] = OrderedDict()

    def touch(self, key: int) -> bool:
        """Whether ``key`` was held; it is held (most recent) afterwards."""
        if key in self.items:
            self.items.move_to_end(key)
            return True
        self.items[key] = None
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)
        return False


def zipf_sampler(n: int, s: float, rng: random.Random) -> list[int]:
    """Cumulative weights of ranks 1..n under Zipf(s), for ``rng.choices``."""
    weights = [1.0 / (rank**s) for rank in range(1, n + 1)]
    order = list(range(n))
    rng.shuffle(order)  # popularity is unrelated to the key's value
    return [order[i] for i in range(n)], weights  # type: ignore[return-value]


@dataclass
class Tier:
    """One role's instances in the simulation."""

    name: str
    size: int
    cache: int
    members: list[str] = field(default_factory=list)
    caches: dict[str, LRU] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    serial: int = 0

    def join(self, count: int) -> None:
        for _ in range(count):
            url = f"http://{self.name}-{self.serial}:8000"
            self.serial += 1
            self.members.append(url)
            self.caches[url] = LRU(self.cache)
            self.loads[url] = 0

    def fail(self, count: int, rng: random.Random) -> None:
        for url in rng.sample(self.members, count):
            self.members.remove(url)
            del self.caches[url]
            del self.loads[url]


def simulate(
    tier_name: str, size: int, cache: int, policy: str, keys: list[int], args: Any
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tier = Tier(tier_name, size, cache)
    tier.join(size)
    router = Router(policy, load_factor=args.load_factor)
    fail_at = {int(len(keys) * 0.25): "fail", int(len(keys) * 0.40): "join"}
    if tier_name == "pd":
        fail_at = {int(len(keys) * 0.60): "fail", int(len(keys) * 0.75): "join"}
    changes = max(1, size // 4)
    mean_hold = args.concurrency * size  # arrivals per unit time is 1: Little's law
    in_flight: list[tuple[float, str]] = []
    hits = 0
    imbalance: list[float] = []
    moved: dict[str, float] = {}
    probe = [k.to_bytes(8, "little") for k in keys[:2000]]
    for i, key in enumerate(keys):
        now = float(i)
        while in_flight and in_flight[0][0] <= now:
            _, url = heapq.heappop(in_flight)
            if url in tier.loads:
                tier.loads[url] -= 1
        event = fail_at.get(i)
        if event is not None and policy not in ("round-robin", "least-loaded"):
            before = {k: router.pick(k, tier.members, {}) for k in probe}
            if event == "fail":
                tier.fail(changes, rng)
            else:
                tier.join(changes)
            after = {k: router.pick(k, tier.members, {}) for k in probe}
            moved[event] = sum(before[k] != after[k] for k in probe) / len(probe)
        elif event == "fail":
            tier.fail(changes, rng)
        elif event == "join":
            tier.join(changes)
        kb = key.to_bytes(8, "little")
        url = router.pick(kb, tier.members, tier.loads)
        hits += tier.caches[url].touch(key)
        tier.loads[url] += 1
        heapq.heappush(in_flight, (now + rng.expovariate(1.0 / mean_hold), url))
        if i % 100 == 0 and i > mean_hold:
            loads = [tier.loads[u] for u in tier.members]
            mean = sum(loads) / len(loads)
            if mean > 0:
                imbalance.append(max(loads) / mean)
    return {
        "tier": tier_name,
        "policy": policy,
        "hit_ratio": hits / len(keys),
        "imbalance_mean": statistics.fmean(imbalance),
        "imbalance_max": max(imbalance),
        "moved_on_fail": moved.get("fail"),
        "moved_on_join": moved.get("join"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40000)
    ap.add_argument("--encoders", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--images", type=int, default=50000)
    ap.add_argument("--prefixes", type=int, default=4000)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--encoder-cache", type=int, default=200)
    ap.add_argument("--prefix-cache", type=int, default=16)
    ap.add_argument("--concurrency", type=float, default=4.0)
    ap.add_argument("--load-factor", type=float, default=1.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=RESULTS / "sim_fleet.json")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    images, w_img = zipf_sampler(args.images, args.zipf, rng)
    prefixes, w_pre = zipf_sampler(args.prefixes, args.zipf, rng)
    image_keys = rng.choices(images, weights=w_img, k=args.requests)
    prefix_keys = rng.choices(prefixes, weights=w_pre, k=args.requests)

    rows = []
    for policy in ENCODER_POLICIES:
        rows.append(
            simulate("encoder", args.encoders, args.encoder_cache, policy, image_keys, args)
        )
    for policy in PREFILL_POLICIES:
        rows.append(simulate("pd", args.prefill, args.prefix_cache, policy, prefix_keys, args))

    print(f"{'tier':8} {'policy':13} {'hit ratio':>9} {'imbalance':>9} {'max':>6} "
          f"{'moved/fail':>10} {'moved/join':>10}")  # fmt: skip
    for r in rows:
        print(
            f"{r['tier']:8} {r['policy']:13} {r['hit_ratio']:9.3f} {r['imbalance_mean']:9.2f} "
            f"{r['imbalance_max']:6.2f} {_share(r['moved_on_fail'])} {_share(r['moved_on_join'])}"
        )
    for tier in ("encoder", "pd"):
        tier_rows = {r["policy"]: r for r in rows if r["tier"] == tier}
        keyed = tier_rows["affinity" if tier == "encoder" else "cache-aware"]
        rr = tier_rows["round-robin"]
        print(
            f"{tier}: keyed routing's hit ratio {keyed['hit_ratio'] / rr['hit_ratio']:.1f}x "
            "round-robin's (same workload, same run)"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.output.write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    plot(rows, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


def _share(value: float | None) -> str:
    return f"{value:10.3f}" if value is not None else f"{'-':>10}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = [f"{r['tier']}\n{r['policy']}" for r in rows]
    colors = ["#4c72b0" if r["tier"] == "encoder" else "#dd8452" for r in rows]
    axes[0].bar(labels, [r["hit_ratio"] for r in rows], color=colors)
    axes[0].set_ylabel("cache hit ratio")
    axes[0].set_ylim(0, 1)
    axes[1].bar(labels, [r["imbalance_mean"] for r in rows], color=colors, label="mean")
    axes[1].scatter(
        labels, [r["imbalance_max"] for r in rows], color="black", label="max", zorder=3
    )
    axes[1].set_ylabel("busiest / mean in-flight load")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("Fleet simulation: 64 encoders, 128 prefill instances, Zipf popularity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
