"""E+PD and E+P+D through ``ec-frontend proxy``, against an aggregated instance.

One deployment per module, all real processes on loopback:

* ``agg``: one instance doing everything (the reference);
* ``E+PD/shared-storage``: encoder ``e_ss`` -> ``pd_ss`` over a shared directory;
* ``E+PD/side-channel``: encoder ``e_sc`` -> ``pd_sc`` over TCP;
* ``E+P+D``: ``e_sc`` -> prefill ``pd_sc`` (it is also a KV producer) -> decode ``d``.

Greedy outputs through each proxy must be token-identical to ``agg``'s (the
tokens, and the logprobs of every token decode computed, to float tolerance),
streamed and not, and the metrics must show that nothing was recomputed.
"""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..helpers.processes import Proc, start_all, stop_all
from .conftest import (
    MODEL_NAME,
    messages,
    png_data_url,
    proxy,
    resign,
    serve,
    shared_storage_ec,
    side_channel_ec,
    side_channel_kv,
)

pytestmark = pytest.mark.slow

RED = png_data_url(56, (200, 30, 40))
BLUE = png_data_url(84, (20, 60, 200))
CASES: dict[str, list[dict[str, Any]]] = {
    "text": messages("Tell me a story about a lighthouse."),
    "one-image": messages("What is in this picture?", RED),
    "two-images-repeated": messages("Compare these.", BLUE, RED, BLUE),
}
TOPOLOGIES = ("E+PD/shared-storage", "E+PD/side-channel", "E+P+D")
MAX_TOKENS = 10
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def dep(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Proc]]:
    shared = tmp_path_factory.mktemp("ec-shared")
    m = builtin_model_dir
    engines = {
        "agg": serve(m, "agg"),
        "e_ss": serve(m, "e_ss", ec=shared_storage_ec("ec_producer", shared)),
        "pd_ss": serve(m, "pd_ss", ec=shared_storage_ec("ec_consumer", shared)),
        "e_sc": serve(m, "e_sc", ec=side_channel_ec("ec_producer")),
        "pd_sc": serve(
            m, "pd_sc", ec=side_channel_ec("ec_consumer"), kv=side_channel_kv("kv_both", ttl_s=10.0)
        ),
        "d": serve(m, "d", kv=side_channel_kv("kv_consumer")),
    }
    procs = start_all(list(engines.values()))
    proxies = {
        "E+PD/shared-storage": proxy(
            "px_ss", encode=[engines["e_ss"].url], decode=[engines["pd_ss"].url]
        ),
        "E+PD/side-channel": proxy(
            "px_sc", encode=[engines["e_sc"].url], decode=[engines["pd_sc"].url]
        ),
        "E+P+D": proxy(
            "px_epd",
            encode=[engines["e_sc"].url],
            prefill=[engines["pd_sc"].url],
            decode=[engines["d"].url],
        ),
    }
    procs += start_all(list(proxies.values()))
    yield {**engines, **proxies}
    stop_all(procs)


def client(p: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(
    p: Proc, msgs: list[dict[str, Any]], *, stream: bool
) -> tuple[str, list[tuple[str, float]], int]:
    """``(text, [(token, logprob)], prompt_tokens)`` of a greedy chat completion."""
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": msgs,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    with client(p) as api:
        if not stream:
            r = api.chat.completions.create(**kwargs)
            lps = r.choices[0].logprobs.content if r.choices[0].logprobs else []
            assert r.usage is not None
            return (
                r.choices[0].message.content or "",
                [(t.token, t.logprob) for t in lps or []],
                r.usage.prompt_tokens,
            )
        text, lps, prompt = "", [], 0
        for chunk in api.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        ):
            if chunk.usage is not None:
                prompt = chunk.usage.prompt_tokens
            for c in chunk.choices:
                text += c.delta.content or ""
                if c.logprobs and c.logprobs.content:
                    lps += [(t.token, t.logprob) for t in c.logprobs.content]
        return text, lps, prompt


_AGG: dict[str, tuple[str, list[tuple[str, float]], int]] = {}


def reference(dep: dict[str, Proc], case: str) -> tuple[str, list[tuple[str, float]], int]:
    if case not in _AGG:
        _AGG[case] = chat(dep["agg"], CASES[case], stream=False)
    return _AGG[case]


def assert_same(
    got: tuple[str, list[tuple[str, float]], int], want: tuple[str, list[tuple[str, float]], int]
) -> None:
    text, lps, prompt = got
    want_text, want_lps, want_prompt = want
    assert (text, prompt) == (want_text, want_prompt)
    assert len(want_lps) == MAX_TOKENS
    # Decode receives the first token from prefill: its logprobs cover the rest.
    offset = len(want_lps) - len(lps)
    assert offset in (0, 1)
    for (tok, lp), (want_tok, want_lp) in zip(lps, want_lps[offset:], strict=True):
        assert tok == want_tok
        assert lp == pytest.approx(want_lp, abs=LOGPROB_TOL)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_token_identical_to_aggregated(
    dep: dict[str, Proc], topology: str, case: str, stream: bool
) -> None:
    assert_same(chat(dep[topology], CASES[case], stream=stream), reference(dep, case))


def fresh_images(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        png_data_url(
            rng.choice((56, 84)), (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    ("topology", "encoder", "consumer", "decode"),
    [
        ("E+PD/shared-storage", "e_ss", "pd_ss", None),
        ("E+PD/side-channel", "e_sc", "pd_sc", None),
        ("E+P+D", "e_sc", "pd_sc", "d"),
    ],
)
def test_nothing_recomputed(
    dep: dict[str, Proc], topology: str, encoder: str, consumer: str, decode: str | None
) -> None:
    names = [encoder, consumer] + ([decode] if decode else [])
    before = {n: dep[n].metrics() for n in names}
    a, b = fresh_images(2, seed=zlib.crc32(topology.encode()))
    prompts = 0
    for msgs in (messages("one", a), messages("two", a, b, a)):
        prompts += chat(dep[topology], msgs, stream=False)[2]

    def delta(name: str, metric: str) -> float:
        key = "ec_frontend_" + metric
        return dep[name].metrics().get(key, 0.0) - before[name].get(key, 0.0)

    assert delta(encoder, "encoder_items_computed_total") == 2
    assert delta(consumer, "encoder_items_computed_total") == 0
    # The proxy sends encoded images on as image_embeds references: no bytes to decode.
    assert delta(encoder, "images_preprocessed_total") >= 2
    assert delta(consumer, "images_preprocessed_total") == 0
    assert delta(consumer, "ec_items_loaded_total") == 2
    assert delta(consumer, "ec_load_fallbacks_total") == 0
    if decode is not None:
        assert delta(decode, "encoder_items_computed_total") == 0
        assert delta(decode, "images_preprocessed_total") == 0
        assert delta(decode, "prompt_tokens_computed_total") <= 2
        assert delta(decode, "kv_tokens_received_total") == prompts
        assert delta(consumer, "kv_tokens_sent_total") == prompts
        assert dep[consumer].settled_metric("kv_requests_held", 0) == 0
    assert dep[encoder].settled_metric("ec_items_held", 0) == 0


def generate(url: str, token_ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"token_ids": token_ids, "sampling_params": {"max_tokens": 8, "temperature": 0}, **extra}
    r = httpx.post(url + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_through_prefill_and_decode(dep: dict[str, Proc]) -> None:
    ids = [101, 203, 318, 257, 132, 286, 262, 501, 108, 13]
    want = generate(dep["agg"].url, ids)["choices"][0]["token_ids"]
    before = dep["d"].metrics()
    got = generate(dep["E+P+D"].url, ids)["choices"][0]["token_ids"]
    after = dep["d"].metrics()
    assert got == want and len(got) == 8
    computed = "ec_frontend_prompt_tokens_computed_total"
    received = "ec_frontend_kv_tokens_received_total"
    assert after[computed] - before[computed] == 0
    assert after[received] - before[received] == len(ids)


def test_completions_through_prefill_and_decode(dep: dict[str, Proc]) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 0,
    }
    with client(dep["agg"]) as agg, client(dep["E+P+D"]) as epd:
        want = agg.completions.create(**kwargs).choices[0].text
        assert epd.completions.create(**kwargs).choices[0].text == want


def test_request_id_travels_and_proxy_reports(dep: dict[str, Proc]) -> None:
    px = dep["E+P+D"]
    body = {"model": MODEL_NAME, "messages": CASES["one-image"], "max_tokens": 2}
    r = httpx.post(
        px.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"}, timeout=60
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert "x-ec-fallback" not in r.headers
    m = px.metrics()
    assert m['ec_frontend_proxy_requests_total{endpoint="chat",status="200"}'] >= 1
    assert m["ec_frontend_proxy_prefills_total"] >= 1
    assert httpx.get(px.url + "/health").status_code == 200
    assert httpx.get(px.url + "/v1/models").json()["data"][0]["id"] == MODEL_NAME


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": "nope"}', "messages"),
        (
            "/v1/chat/completions",
            b'{"messages": [], "ec_transfer_params": [1]}',
            "ec_transfer_params",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [], "kv_transfer_params": "x"}',
            "kv_transfer_params",
        ),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "n": 2}', "n"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "n": 3}', "n"),
        (
            "/inference/v1/generate",
            b'{"token_ids": [1], "sampling_params": [1]}',
            "sampling_params",
        ),
        (
            "/inference/v1/generate",
            b'{"token_ids": [1], "sampling_params": {"n": 2}}',
            "sampling_params.n",
        ),
    ],
)
def test_proxy_bad_requests(
    dep: dict[str, Proc], path: str, body: bytes, param: str | None
) -> None:
    r = httpx.post(dep["E+P+D"].url + path, content=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] and error["param"] == param


def prefill(dep: dict[str, Proc], ids: list[int]) -> dict[str, Any]:
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0},
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    r = httpx.post(dep["pd_sc"].url + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    kv = r.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert {
        "remote_engine_id",
        "remote_request_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
    } <= set(kv)
    return kv


def test_params_are_consumed_once_and_prefill_frees_after_the_pull(dep: dict[str, Proc]) -> None:
    ids = [11, 22, 33, 44, 55, 66, 77]
    want = generate(dep["agg"].url, ids)["choices"][0]["token_ids"]
    kv = prefill(dep, ids)
    assert generate(dep["d"].url, ids, kv_transfer_params=kv)["choices"][0]["token_ids"] == want
    assert dep["pd_sc"].settled_metric("kv_requests_held", 0) == 0
    # The same signed params again: a replay, refused before any connection; the
    # prompt is computed locally.
    before = dep["d"].metrics()
    assert generate(dep["d"].url, ids, kv_transfer_params=kv)["choices"][0]["token_ids"] == want
    after = dep["d"].metrics()
    for name in ("transfer_params_rejected_total", "kv_local_prefill_fallbacks_total"):
        key = "ec_frontend_" + name
        assert after[key] == before[key] + 1
    # Signed afresh (as by a trusted party): prefill is asked and has nothing left.
    body = {
        "token_ids": ids,
        "sampling_params": {"max_tokens": 8, "temperature": 0},
        "kv_transfer_params": resign("kv", kv["remote_request_id"], kv),
    }
    again = httpx.post(dep["d"].url + "/inference/v1/generate", json=body, timeout=60)
    # Signed params from a trusted prefill that cannot serve them: the decode instance is a gateway.
    assert again.status_code == 502
    error = again.json()["error"]
    assert error["code"] == "kv_transfer_failed"
    assert "KV transfer from the prefill instance" in error["message"]
    assert "no such item" in error["message"]


@pytest.mark.parametrize(
    "change",
    [
        {"remote_port": "nope"},
        {"remote_block_ids": []},
        {"remote_num_tokens": 3},
        {"prompt_hash": "0" * 32},
        {"mrope_position_delta": 5},
        {"first_token_id": None},
    ],
    ids=["port", "blocks", "num-tokens", "other-prompt", "positions", "first-token"],
)
def test_unusable_kv_params_give_a_logged_local_prefill(
    dep: dict[str, Proc], change: dict[str, Any]
) -> None:
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    want = generate(dep["agg"].url, ids)["choices"][0]["token_ids"]
    kv = prefill(dep, ids)
    kv = resign("kv", kv["remote_request_id"], {**kv, **change})
    before = dep["d"].metric("kv_local_prefill_fallbacks_total")
    assert generate(dep["d"].url, ids, kv_transfer_params=kv)["choices"][0]["token_ids"] == want
    assert dep["d"].metric("kv_local_prefill_fallbacks_total") == before + 1


def test_client_disconnect_mid_stream_aborts_decode(dep: dict[str, Proc]) -> None:
    d = dep["d"]
    watched = ("generation_tokens_total", "requests_aborted_total", "engine_steps_total")
    before = {name: d.metric(name) for name in watched}
    body = {"model": MODEL_NAME, "messages": CASES["one-image"], "max_tokens": 900,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    seen_lines: list[str] = []
    with httpx.stream(
        "POST", dep["E+P+D"].url + "/v1/chat/completions", json=body, timeout=60
    ) as r:
        assert r.status_code == 200
        # Leave after the first generated token (the opening chunk's empty content
        # comes before decode has its request), so that decode has a request to abort.
        for line in r.iter_lines():
            seen_lines.append(line)
            if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
                break
        else:
            raise AssertionError(f"the stream ended before any token: {seen_lines[-3:]}")
    # The gauges trail the abort by a step or two: wait until the abort is counted and
    # the request and its blocks are gone (or 20 s have passed).
    deadline = time.monotonic() + 20
    while True:
        now = d.metrics()
        seen = {name: now.get("ec_frontend_" + name, 0.0) - before[name] for name in watched}
        settled = (
            seen["requests_aborted_total"] >= 1
            and now.get("ec_frontend_num_requests_running") == 0
            and now.get("ec_frontend_kv_blocks_used") == 0
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # On a failure, which side kept the request: the decode API server (no abort
    # counted), or its engine (aborted, yet still stepping).
    assert now.get("ec_frontend_num_requests_running") == 0, seen
    assert now.get("ec_frontend_kv_blocks_used") == 0, seen
    assert seen["generation_tokens_total"] < 900
    assert seen["requests_aborted_total"] == 1


def test_client_request_id_reused_while_prefill_holds_its_kv(dep: dict[str, Proc]) -> None:
    ids = [21, 22, 23, 24, 25, 26]
    want = generate(dep["agg"].url, ids)["choices"][0]["token_ids"]
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0},
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    held = []
    for _ in range(2):
        r = httpx.post(dep["pd_sc"].url + "/inference/v1/generate", json=body,
                       headers={"X-Request-Id": "same-id"}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        held.append(r.json()["kv_transfer_params"])
    first, second = (kv["remote_request_id"] for kv in held)
    assert first == "same-id" and second.startswith("same-id-")
    for kv in held:
        assert generate(dep["d"].url, ids, kv_transfer_params=kv)["choices"][0]["token_ids"] == want


@pytest.mark.parametrize(
    ("deployment", "content"),
    [
        ("E+P+D", "Tell me about lighthouses."),
        (
            "E+PD/side-channel",
            [{"type": "input_text", "text": "What is in this picture?"},
             {"type": "input_image", "image_url": RED}],
        ),
    ],
)  # fmt: skip
def test_responses_and_tokenize_through_the_proxy(
    dep: dict[str, Proc], deployment: str, content: Any
) -> None:
    """Forwarded whole to the decode (or PD) instance: the same greedy text as an
    aggregated instance, and the same prompt tokens."""
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": 6,
        "temperature": 0,
    }
    with client(dep["agg"]) as agg, client(dep[deployment]) as via:
        want = agg.responses.create(**kwargs)
        got = via.responses.create(**kwargs)
    assert got.output_text == want.output_text and got.output_text
    assert got.usage is not None and want.usage is not None
    assert got.usage.input_tokens == want.usage.input_tokens
    body = {"model": MODEL_NAME, "prompt": "Tell me about lighthouses."}
    direct = httpx.post(dep["agg"].url + "/tokenize", json=body, timeout=30).json()
    assert httpx.post(dep[deployment].url + "/tokenize", json=body, timeout=30).json() == direct
