"""E+PD over Mooncake Store and E+P+D over Mooncake Store + Transfer Engine, real processes.

One deployment for the module, on loopback, with a real ``mooncake_master``:

* ``agg``: the aggregated reference;
* ``e``: encoder (``MooncakeStoreECConnector``, ``ec_producer``);
* ``pd1``: a PD instance (``ec_consumer``) behind the proxy ``E+PD1``;
* ``p`` (``ec_consumer`` + ``MooncakeConnector`` ``kv_both``): the second PD instance
  (proxy ``E+PD2``) and, with ``d`` (``MooncakeConnector`` ``kv_consumer``), the
  prefill of the proxy ``E+P+D``.

Greedy outputs must be token-identical to ``agg``'s, streamed and not; the
metrics must show that no consumer encoded anything, that decode computed no
prompt token, and that every instance is idle afterwards. The last tests break
things: prefill killed before decode's read, then the master killed mid-run.
"""

from __future__ import annotations

import base64
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..disagg.conftest import MODEL_NAME, RelayEncoder, messages, png_data_url, proxy, serve
from ..helpers.processes import Proc, start_all
from ..helpers.video import make_clip
from .conftest import Master, mooncake_kv, raw_client, store_ec, until

pytestmark = pytest.mark.slow

RED = png_data_url(56, (200, 30, 40))
BLUE = png_data_url(84, (20, 60, 200))
CASES: dict[str, list[dict[str, Any]]] = {
    "text": messages("Tell me a story about a lighthouse."),
    "one-image": messages("What is in this picture?", RED),
    "two-images-repeated": messages("Compare these.", BLUE, RED, BLUE),
}
MAX_TOKENS = 8
IDLE = ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "encoder_cache_refs",
        "kv_requests_held")  # fmt: skip


@pytest.fixture(scope="module")
def dep(builtin_model_dir: Path) -> Iterator[dict[str, Any]]:
    master = Master()
    m = builtin_model_dir
    procs: list[Proc] = []
    try:
        engines = {
            "agg": serve(m, "agg"),
            "e": serve(m, "e", ec=store_ec("ec_producer", master)),
            "pd1": serve(m, "pd1", ec=store_ec("ec_consumer", master)),
            "p": serve(
                m, "p", ec=store_ec("ec_consumer", master), kv=mooncake_kv("kv_both", ttl_s=20.0)
            ),
            "d": serve(m, "d", kv=mooncake_kv("kv_consumer", timeout_s=5.0)),
        }
        procs += engines.values()
        start_all(list(engines.values()))
        e = [engines["e"].url]
        proxies = {
            "E+PD1": proxy("px1", encode=e, decode=[engines["pd1"].url]),
            "E+PD2": proxy("px2", encode=e, decode=[engines["p"].url]),
            "E+P+D": proxy("px3", encode=e, prefill=[engines["p"].url], decode=[engines["d"].url]),
        }
        procs += proxies.values()
        start_all(list(proxies.values()))
        yield {**engines, **proxies, "master": master}
    finally:
        for p in procs:  # all at once: with the master gone, each takes a while to exit
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            p.stop()
        master.kill()


def client(p: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(p: Proc, msgs: list[dict[str, Any]], *, stream: bool) -> tuple[str, int]:
    """``(text, prompt_tokens)`` of a greedy chat completion."""
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": msgs, "max_tokens": MAX_TOKENS,
                              "temperature": 0}  # fmt: skip
    with client(p) as api:
        if not stream:
            r = api.chat.completions.create(**kwargs)
            assert r.usage is not None
            return r.choices[0].message.content or "", r.usage.prompt_tokens
        text, prompt = "", 0
        for chunk in api.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        ):
            if chunk.usage is not None:
                prompt = chunk.usage.prompt_tokens
            for c in chunk.choices:
                text += c.delta.content or ""
        return text, prompt


_AGG: dict[str, tuple[str, int]] = {}
Metrics = dict[str, dict[str, float]]


def reference(dep: dict[str, Any], case: str) -> tuple[str, int]:
    if case not in _AGG:
        _AGG[case] = chat(dep["agg"], CASES[case], stream=False)
    return _AGG[case]


def metrics(dep: dict[str, Any], *names: str) -> Metrics:
    return {n: dep[n].metrics() for n in names}


def delta(before: Metrics, dep: dict[str, Any], name: str, metric: str) -> float:
    key = "ec_frontend_" + metric
    return dep[name].metrics().get(key, 0.0) - before[name].get(key, 0.0)


def assert_idle(dep: dict[str, Any], *names: str) -> None:
    for n in names:
        for gauge in IDLE:
            assert dep[n].settled_metric(gauge, 0, timeout_s=15) == 0, (n, gauge)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("topology", ["E+PD1", "E+P+D"])
def test_token_identical_to_aggregated(
    dep: dict[str, Any], topology: str, case: str, stream: bool
) -> None:
    assert chat(dep[topology], CASES[case], stream=stream) == reference(dep, case)


def test_two_pd_instances_share_the_store(dep: dict[str, Any]) -> None:
    image = png_data_url(84, (zlib.crc32(b"share") % 256, 120, 33))
    msgs = messages("Describe it.", image)
    before = metrics(dep, "e", "pd1", "p")
    first = chat(dep["E+PD1"], msgs, stream=False)
    assert delta(before, dep, "e", "encoder_items_computed_total") == 1
    assert chat(dep["E+PD2"], msgs, stream=True) == first
    assert chat(dep["agg"], msgs, stream=False) == first
    for pd in ("pd1", "p"):
        assert delta(before, dep, pd, "encoder_items_computed_total") == 0
        assert delta(before, dep, pd, "ec_items_loaded_total") == 1
        assert delta(before, dep, pd, "ec_load_fallbacks_total") == 0
    assert_idle(dep, "e", "pd1", "p")


def test_decode_computes_no_prompt_token(dep: dict[str, Any]) -> None:
    before = metrics(dep, "p", "d")
    text, prompt = chat(dep["E+P+D"], messages("And now?", RED, BLUE), stream=False)
    assert (text, prompt) == chat(dep["agg"], messages("And now?", RED, BLUE), stream=False)
    assert delta(before, dep, "d", "prompt_tokens_computed_total") == 0
    assert delta(before, dep, "d", "kv_tokens_received_total") == prompt
    assert delta(before, dep, "d", "encoder_items_computed_total") == 0
    assert delta(before, dep, "p", "encoder_items_computed_total") == 0
    # Decode reported its read: prefill freed the blocks long before the TTL (20 s).
    assert dep["p"].settled_metric("kv_requests_held", 0, timeout_s=5) == 0
    assert delta(before, dep, "p", "kv_tokens_sent_total") == prompt
    assert_idle(dep, "p", "d")


def test_a_video_moves_through_the_store(dep: dict[str, Any]) -> None:
    """A video beside an image, E+PD and E+P+D over Mooncake: the answer is the
    aggregated one; the encoder decodes and encodes the video, PD / P load it from the
    store and decode no video (D gets the KV)."""
    clip = "data:video/mp4;base64," + base64.b64encode(make_clip(6)).decode()
    content = [
        {"type": "video_url", "video_url": {"url": clip}},
        *messages("And this?", RED)[0]["content"],
    ]
    msgs = [{"role": "user", "content": content}]
    want = chat(dep["agg"], msgs, stream=False)
    for topology, consumers in (("E+PD1", ("pd1",)), ("E+P+D", ("p", "d"))):
        before = metrics(dep, "e", *consumers)
        assert chat(dep[topology], msgs, stream=False) == want, topology
        # decoded for E+PD1; for E+P+D, the same video again, from the encoder's
        # processed-video cache
        taken = delta(before, dep, "e", "videos_decoded_total") + delta(
            before, dep, "e", "video_cache_hits_total"
        )
        assert taken == 1, topology
        for name in consumers:
            for metric in (
                "videos_decoded_total",
                "video_cache_hits_total",
                "encoder_items_computed_total",
            ):
                assert delta(before, dep, name, metric) == 0, (topology, name, metric)
        assert delta(before, dep, consumers[0], "ec_items_loaded_total") >= 1
        assert delta(before, dep, consumers[0], "ec_load_fallbacks_total") == 0
    assert_idle(dep, "e", "pd1", "p", "d")


def test_an_item_evicted_before_pd_reads_it(dep: dict[str, Any]) -> None:
    """The store drops the item between the encoder's answer and PD's read (a relay in
    front of the encoder evicts it): PD holds only the reference, so the proxy sends the
    image inline and PD encodes it; the answers are the aggregated ones."""
    raw = raw_client(dep["master"])

    def evict(params: dict[str, Any]) -> dict[str, Any]:
        for entry in params.values():
            # Removable once the master's lease (200 ms) on the fresh item ran out.
            assert until(lambda key=entry["key"]: raw.remove(key) == 0)
        return params

    relay = RelayEncoder(dep["e"].url, evict)
    px = proxy("px_evict", encode=[relay.url], decode=[dep["pd1"].url])
    try:
        start_all([px])
        before = metrics(dep, "pd1")
        for stream, color in ((False, (5, 90, 170)), (True, (170, 5, 90))):
            msgs = messages("Evicted?", png_data_url(70, color))
            assert chat(px, msgs, stream=stream) == chat(dep["agg"], msgs, stream=False)
        assert px.metric("proxy_reference_retries_total") == 2
        assert delta(before, dep, "pd1", "encoder_items_computed_total") == 2
        assert delta(before, dep, "pd1", "ec_items_loaded_total") == 0
        assert_idle(dep, "e", "pd1")
    finally:
        px.stop()
        relay.close()
        raw.close()


def test_an_item_in_the_store_is_not_encoded_again_by_another_encoder(
    dep: dict[str, Any], builtin_model_dir: Path
) -> None:
    """Two encoders on one store (vLLM's ``cross_encoder_cache``): an image encoded by
    ``e`` (through ``E+PD1``) is found in the store by ``e2`` (a proxy in front of
    ``e2`` and ``p``), which does not compute it; ``p`` loads it and answers as the
    aggregated instance does."""
    image = png_data_url(70, (zlib.crc32(b"cross") % 256, 90, 140))
    msgs = messages("What is this?", image)
    want = chat(dep["agg"], msgs, stream=False)
    before = metrics(dep, "e", "p")
    assert chat(dep["E+PD1"], msgs, stream=False) == want
    assert delta(before, dep, "e", "encoder_items_computed_total") == 1
    e2 = serve(builtin_model_dir, "e2", ec=store_ec("ec_producer", dep["master"]))
    px = proxy("px_e2", encode=[e2.url], decode=[dep["p"].url])
    try:
        start_all([e2, px])
        assert chat(px, msgs, stream=True) == want
        assert e2.metric("encoder_items_computed_total") == 0
        assert e2.metric("encoder_items_found_stored_total") == 1
        assert delta(before, dep, "p", "encoder_items_computed_total") == 0
        assert delta(before, dep, "p", "ec_items_loaded_total") == 1
        # A new image is still computed by e2, once.
        other = messages("And this?", png_data_url(70, (10, 200, 90)))
        assert chat(px, other, stream=False) == chat(dep["agg"], other, stream=False)
        assert e2.metric("encoder_items_computed_total") == 1
        assert_idle(dep, "p")
    finally:
        px.stop()
        e2.stop()


def test_prefill_params_for_a_dead_prefill_fail_cleanly(
    dep: dict[str, Any], builtin_model_dir: Path
) -> None:
    """Prefill killed after it answered, before decode's read: a clear error, no leak."""
    body = {"model": MODEL_NAME, "messages": messages("Short."), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    extra_p = serve(builtin_model_dir, "p2", kv=mooncake_kv("kv_producer"))
    try:
        start_all([extra_p])
        r = httpx.post(extra_p.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        assert params["remote_port"] > 0 and params["remote_kv_addrs"]
    finally:
        extra_p.kill()
        extra_p.stop()
    decode = {**body, "max_tokens": 4, "kv_transfer_params": params}
    start = time.monotonic()
    r = httpx.post(dep["d"].url + "/v1/chat/completions", json=decode, timeout=60)
    assert time.monotonic() - start < 5 + 10
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "kv_transfer_failed" and "failed" in error["message"]
    assert_idle(dep, "d")


def test_master_killed_mid_run(dep: dict[str, Any]) -> None:
    """Runs last: without the store, PD encodes locally and answers the same."""
    msgs = messages("After the outage.", png_data_url(56, (9, 200, 140)))
    want = chat(dep["agg"], msgs, stream=False)
    dep["master"].kill()
    before = metrics(dep, "pd1")
    start = time.monotonic()
    assert chat(dep["E+PD1"], msgs, stream=False) == want
    assert chat(dep["E+PD1"], msgs, stream=True) == want
    assert time.monotonic() - start < 60
    assert delta(before, dep, "pd1", "encoder_items_computed_total") >= 1
    assert delta(before, dep, "pd1", "ec_items_loaded_total") == 0
    assert_idle(dep, "e", "pd1")
