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
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from ec_frontend.config import TRANSFER_SECRET_ENV
from ec_frontend.entrypoints.proxy.app import item_uuid
from ec_frontend.entrypoints.proxy.routing import rendezvous_order

from ..helpers.origin import Route, origin
from ..helpers.processes import Proc, start_all
from .conftest import (
    MODEL_NAME,
    SECRET,
    image_part,
    messages,
    png_data_url,
    proxy,
    serve,
    side_channel_ec,
)

# Routing figures (hit ratios, load shares) depend on timing: alone on the machine.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

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
        with ThreadPoolExecutor(4) as pool:
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


def admin(method: str, px: Proc, key: str | None = ADMIN_KEY, **kw: Any) -> httpx.Response:
    headers = {"X-API-Key": key} if key is not None else {}
    return httpx.request(method, px.url + "/instances", headers=headers, timeout=10, **kw)


def register(px: Proc, role: str, url: str) -> None:
    r = admin("POST", px, json={"role": role, "url": url})
    assert r.status_code == 200, r.text
    assert r.json() == {"registered": True}


def test_registration_with_a_bad_admin_key_is_refused(fleet: dict[str, Proc]) -> None:
    px = fleet["px_dyn"]
    record = {"role": "encode", "url": fleet["e1"].url}
    for key in (None, "", "not-the-key"):
        r = admin("POST", px, key, json=record)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "invalid_admin_key"
        assert admin("DELETE", px, key, params={"url": fleet["e1"].url}).status_code == 403
    assert admin("GET", px, None).json()["encode"] == {"live": [], "evicted": []}
    r = chat(px.url, messages("anyone?"))
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_instance"
    bad = admin("POST", px, json={"role": "encoder", "url": fleet["e1"].url})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"


def test_a_launcher_registers_the_fleet(fleet: dict[str, Proc]) -> None:
    px = fleet["px_dyn"]
    for e in ("e1", "e2"):
        register(px, "encode", fleet[e].url)
    for pd in ("pd1", "pd2"):
        register(px, "prefill_decode", fleet[pd].url + "/")
    again = admin("POST", px, json={"role": "encode", "url": fleet["e1"].url})
    assert again.json() == {"registered": False}
    clash = admin("POST", px, json={"role": "decode", "url": fleet["e3"].url})
    assert clash.status_code == 409, clash.text
    status = admin("GET", px, None).json()
    assert status["encode"]["live"] == [fleet["e1"].url, fleet["e2"].url]
    assert status["prefill_decode"]["live"] == [fleet["pd1"].url, fleet["pd2"].url]
    r = chat(px.url, messages("what is this?", image(200)))
    assert r.status_code == 200, r.text
    assert "x-ec-fallback" not in r.headers


def owned_by(owner: str, live: list[str], start: int) -> str:
    """An image, from colour ``start`` on, whose rendezvous owner among ``live`` is ``owner``."""
    for k in range(start, start + 64):
        img = image(k)
        if rendezvous_order(item_uuid(image_part(img)).encode(), live)[0] == owner:
            return img
    raise AssertionError("no such image")


def test_a_new_encoder_gets_traffic_within_one_probe_interval(fleet: dict[str, Proc]) -> None:
    px, e3 = fleet["px_dyn"], fleet["e3"]
    live = [fleet["e1"].url, fleet["e2"].url, e3.url]
    img = owned_by(e3.url, live, 300)
    computed = e3.metric("encoder_items_computed_total")
    started = time.monotonic()
    register(px, "encode", e3.url)
    r = chat(px.url, messages("new here?", img))
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert e3.metric("encoder_items_computed_total") == computed + 1
    assert elapsed < PROBE_S
    routed = labelled(px, "proxy_routed_total", role="encode")
    assert routed.get(e3.url) == 1


def test_an_encoder_killed_mid_run_moves_only_its_share(fleet: dict[str, Proc]) -> None:
    px = fleet["px_dyn"]
    encoders = [fleet["e1"], fleet["e2"], fleet["e3"]]
    images = [image(k) for k in range(400, 424)]
    for img in images:
        assert chat(px.url, messages("first pass", img)).status_code == 200
    owners = {e.url: 0 for e in encoders}
    live = [e.url for e in encoders]
    for img in images:
        owners[rendezvous_order(item_uuid(image_part(img)).encode(), live)[0]] += 1
    victim, survivors = encoders[2], encoders[:2]
    computed = total(survivors, "encoder_items_computed_total")
    with ThreadPoolExecutor(1) as pool:
        run = pool.map(chat, [px.url] * len(images), [messages("again", i) for i in images])
        victim.kill()
        results = list(run)
    assert [r.status_code for r in results] == [200] * len(images), [r.text for r in results]
    assert all("x-ec-fallback" not in r.headers for r in results)
    moved = total(survivors, "encoder_items_computed_total") - computed
    print(f"\nencoder killed: {owners[victim.url]} of {len(images)} items were its; "
          f"{moved:g} recomputed on the others")  # fmt: skip
    # Its items served before the kill (at most the one in flight) did not move.
    assert owners[victim.url] - 1 <= moved <= owners[victim.url]
    deadline = time.monotonic() + 4 * PROBE_S * 2 + 2
    while victim.url not in admin("GET", px, None).json()["encode"]["evicted"]:
        assert time.monotonic() < deadline, admin("GET", px, None).text
        time.sleep(0.1)
    assert labelled(px, "proxy_ejections_total", role="encode") == {victim.url: 1.0}


def wait_for(px: Proc, url: str, state: str, timeout_s: float) -> float:
    started = time.monotonic()
    while url not in admin("GET", px, None).json()["encode"][state]:
        assert time.monotonic() - started < timeout_s, admin("GET", px, None).text
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_failing_instance_leaves_rotation_and_comes_back(fleet: dict[str, Proc]) -> None:
    px = fleet["px_dyn"]
    healthy, failing = Route(b"{}", content_type="application/json"), Route(b"", status=503)
    with origin() as peer:
        peer.set("/health", healthy)
        url = peer.url("")
        register(px, "encode", url)
        peer.set("/health", failing)
        wait_for(px, url, "evicted", timeout_s=PROBE_S * 4 + 1)
        peer.set("/health", healthy)
        wait_for(px, url, "live", timeout_s=PROBE_S * 4 + 1)
        r = admin("DELETE", px, params={"url": url})
        assert r.json() == {"removed": True}
        status = admin("GET", px, None).json()["encode"]
        assert url not in status["live"] + status["evicted"]
