"""Routing across a fleet through ``ec-frontend proxy``: affinity and cache-aware
routing against round-robin, measured on real processes in the same run, then
membership (registration, probes, eviction) and faults.

One set of processes for the module (tests run in file order; the fault tests
come last because they kill an encoder):

* ``e1``, ``e2``, ``e3``: side-channel encoders; ``pd1``, ``pd2``: E+PD instances
  (side-channel EC consumers, prefix caching on);
* ``px``: the defaults (``--encoder-routing affinity``, ``--routing cache-aware``);
* ``px_rr``: ``--encoder-routing round-robin --routing round-robin``;
* ``px_dyn``: ``--dynamic-registration`` with an admin key and fast probes, empty
  until the tests register instances with it.

Figures are printed (run with ``-s`` to see them) and asserted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from ec_frontend.config import TRANSFER_SECRET_ENV

from ..helpers.processes import Proc, start_all
from .conftest import (
    MODEL_NAME,
    SECRET,
    messages,
    png_data_url,
    proxy,
    serve,
    side_channel_ec,
)

pytestmark = pytest.mark.slow

DISTINCT = 40
COPIES = 5
ADMIN_KEY = "fleet-admin-key"
PROBE_S = 0.5
PD_ARGS = ("--max-model-len", "4096")


@pytest.fixture(scope="module")
def fleet(builtin_model_dir: Path) -> Iterator[dict[str, Proc]]:
    m = builtin_model_dir
    procs = {
        **{f"e{i}": serve(m, f"e{i}", ec=side_channel_ec("ec_producer")) for i in (1, 2, 3)},
        **{
            f"pd{i}": serve(m, f"pd{i}", ec=side_channel_ec("ec_consumer"), extra=PD_ARGS)
            for i in (1, 2)
        },
    }
    start_all(list(procs.values()))
    encoders = [procs[f"e{i}"].url for i in (1, 2, 3)]
    pds = [procs["pd1"].url, procs["pd2"].url]
    rr = ["--encoder-routing", "round-robin", "--routing", "round-robin"]
    dyn = ["--dynamic-registration", "--probe-interval", str(PROBE_S),
           "--probe-timeout", "0.5", "--fail-threshold", "2"]  # fmt: skip
    proxies = {
        "px": proxy("px", encode=encoders, decode=pds),
        "px_rr": proxy("px_rr", encode=encoders, decode=pds, extra=rr),
    }
    env = {TRANSFER_SECRET_ENV: SECRET, "ADMIN_API_KEY": ADMIN_KEY}
    proxies["px_dyn"] = Proc("proxy", dyn, "px_dyn", env=env)
    start_all(list(proxies.values()))
    yield {**procs, **proxies}
    for p in (*procs.values(), *proxies.values()):
        p.stop()


def image(k: int) -> str:
    return png_data_url(28, ((k * 37) % 256, (k * 91) % 256, (k * 53) % 256))


def chat(url: str, msgs: list[dict[str, Any]], max_tokens: int = 1) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def total(procs: list[Proc], name: str) -> float:
    return sum(p.metric(name) for p in procs)


def labelled(p: Proc, name: str, **labels: str) -> dict[str, float]:
    """``{instance: value}`` of a proxy series whose labels include ``labels``."""
    out: dict[str, float] = {}
    for key, value in p.metrics().items():
        if not key.startswith("ec_frontend_" + name + "{"):
            continue
        pairs = dict(kv.split("=", 1) for kv in key[key.index("{") + 1 : -1].split('",'))
        pairs = {k: v.strip('"') for k, v in pairs.items()}
        if all(pairs.get(k) == v for k, v in labels.items()):
            out[pairs["instance"]] = out.get(pairs["instance"], 0.0) + value
    return out


def workload(first: int) -> list[str]:
    """``DISTINCT`` images from colour ``first`` on, each ``COPIES`` times, shuffled."""
    images = [image(first + k) for k in range(DISTINCT) for _ in range(COPIES)]
    random.Random(first).shuffle(images)
    return images


def test_affinity_computes_each_image_once_round_robin_does_not(fleet: dict[str, Proc]) -> None:
    encoders = [fleet["e1"], fleet["e2"], fleet["e3"]]
    figures = {}
    # Colours repeat every 256 steps: the two workloads share no image.
    for name, first in (("px_rr", 0), ("px", 100)):
        before = total(encoders, "encoder_items_computed_total")
        for img in workload(first):
            r = chat(fleet[name].url, messages("what is this?", img))
            assert r.status_code == 200, r.text
            assert "x-ec-fallback" not in r.headers
        figures[name] = total(encoders, "encoder_items_computed_total") - before
    print(f"\nencoder items computed, {DISTINCT} images x {COPIES}: "
          f"affinity {figures['px']:g}, round-robin {figures['px_rr']:g}")  # fmt: skip
    assert figures["px"] == DISTINCT
    assert figures["px_rr"] > DISTINCT
    hits = labelled(fleet["px"], "proxy_affinity_hits_total", role="encode")
    assert sum(hits.values()) == DISTINCT * COPIES
    routed = labelled(fleet["px"], "proxy_routed_total", role="encode", policy="affinity")
    assert sorted(routed) == sorted(e.url for e in encoders)


def system_prompt(k: int) -> str:
    """A long system prompt of its own (past the prefix key's 2 KiB)."""
    rng = random.Random(k)
    words = ["harbour", "lantern", "granite", "meadow", "copper", "violet", "thunder",
             "orchard", "saffron", "glacier", "cobalt", "willow", "ember", "falcon"]  # fmt: skip
    return f"Policy {k}: " + " ".join(rng.choice(words) for _ in range(400))


def test_cache_aware_prefill_hits_the_prefix_cache_with_bounded_load(
    fleet: dict[str, Proc],
) -> None:
    pds = [fleet["pd1"], fleet["pd2"]]
    figures: dict[str, float] = {}
    shares: dict[str, dict[str, float]] = {}
    for name, first in (("px_rr", 100), ("px", 200)):
        bodies = [
            [{"role": "system", "content": system_prompt(first + k)},
             {"role": "user", "content": f"question {q} about policy {k}"}]
            for q in range(4) for k in range(8)
        ]  # fmt: skip
        random.Random(first).shuffle(bodies)
        role = "prefill_decode"
        before_routed = labelled(fleet[name], "proxy_routed_total", role=role)
        hits = total(pds, "prefix_cache_hits_total")
        queries = total(pds, "prefix_cache_queries_total")
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(chat, [fleet[name].url] * len(bodies), bodies))
        assert [r.status_code for r in results] == [200] * len(bodies)
        figures[name] = (total(pds, "prefix_cache_hits_total") - hits) / (
            total(pds, "prefix_cache_queries_total") - queries
        )
        after = labelled(fleet[name], "proxy_routed_total", role=role)
        shares[name] = {u: after.get(u, 0) - before_routed.get(u, 0) for u in after}
    print(f"\nprefix-cache hit ratio, 8 prefixes x 4 on 2 PD: cache-aware {figures['px']:.3f}, "
          f"round-robin {figures['px_rr']:.3f}; requests per PD (cache-aware) "
          f"{sorted(shares['px'].values())}")  # fmt: skip
    assert figures["px"] > figures["px_rr"]
    load = list(shares["px"].values())
    assert len(load) == 2 and sum(load) == 32
    assert max(load) <= 1.5 * (sum(load) / 2)
