"""Trusted by default (issue 28): with neither a transfer secret nor ``--transfer-peers``,
client-written transfer params are ignored.

Before, such an instance acted on ``ec_transfer_params`` / ``kv_transfer_params``
naming any loopback peer: a fake peer's tensor was loaded under a victim image's
hash, decode's prefix cache could be poisoned, and error texts told open ports
from closed ones. Here, real processes without a secret: an encoder (to learn an
image's real ``mm_hash``) and a consumer (EC consumer and KV both). A client names
a real listening socket on 127.0.0.1 (:class:`FakePeer`, which counts the
connections it accepts) or a closed port: the consumer opens no connection, and
its answer is the same for both, and the same as without the params.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..disagg.conftest import messages, png_data_url, serve, side_channel_ec, side_channel_kv
from ..helpers.processes import Proc, free_port, start_all
from .test_side_channel_limits import FakePeer
from .test_transfer_trust import entry, item_hash, kv_params

pytestmark = pytest.mark.slow

IGNORED = "transfer params in requests will be ignored"


@pytest.fixture(scope="module")
def dep(builtin_model_dir: Path) -> Iterator[dict[str, Any]]:
    m = builtin_model_dir
    rec = FakePeer(lambda conn: None)
    procs = {
        "e": serve(m, "e", ec=side_channel_ec("ec_producer"), secret=None,
                   extra=["--encoder-cache-size", "16", "--max-num-batched-tokens", "16"]),
        "c": serve(m, "c", ec=side_channel_ec("ec_consumer"), kv=side_channel_kv("kv_both"),
                   secret=None),
    }  # fmt: skip
    start_all(list(procs.values()))
    yield {**procs, "open": rec}
    for p in procs.values():
        p.stop()
    rec.close()


def ports(dep: dict[str, Any]) -> dict[str, int]:
    return {"open": dep["open"].port, "closed": free_port()}


def answer(r: httpx.Response) -> tuple[int, Any]:
    """What a client sees: status and body, less what differs per request (ids, times)."""
    body = r.json()
    if r.status_code != 200:
        return r.status_code, body
    for key in ("id", "created", "request_id"):
        body.pop(key, None)
    return r.status_code, body


def post(c: Proc, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(c.url + path, json=body, timeout=60)


def same_for_every_port(
    dep: dict[str, Any], path: str, body: dict[str, Any], key: str, params: Any
) -> tuple[int, Any]:
    """The answer without transfer params; checks that ``key: params(port)`` added for
    an open and a closed port gets exactly that answer and opens no connection."""
    c, rec = dep["c"], dep["open"]
    plain = answer(post(c, path, body))
    seen = {name: answer(post(c, path, {**body, key: params(port)}))
            for name, port in ports(dep).items()}  # fmt: skip
    assert seen["open"] == seen["closed"] == plain
    assert rec.accepted == 0
    return plain


def test_ec_params_naming_a_client_peer_are_ignored_the_same_for_open_and_closed_ports(
    dep: dict[str, Any],
) -> None:
    c = dep["c"]
    image = png_data_url(56, (12, 200, 77))
    mm_hash = item_hash(dep["e"], image)
    body = {"model": "tiny", "messages": messages("hello", image), "max_tokens": 4,
            "temperature": 0, "logprobs": True}  # fmt: skip
    post(c, "/v1/chat/completions", body)  # the prompt is computed, then cached
    rejected = c.metric("transfer_params_rejected_total")
    # The same answer as without the params: tokens, logprobs, usage.
    plain = same_for_every_port(dep, "/v1/chat/completions", body, "ec_transfer_params",
                                lambda port: {mm_hash: {**entry(port), "num_tokens": 16,
                                                        "shape": [16, 64]}})  # fmt: skip
    assert plain[0] == 200
    assert c.metric("transfer_params_rejected_total") == rejected + 2


def test_kv_params_naming_a_client_peer_are_ignored_the_same_for_open_and_closed_ports(
    dep: dict[str, Any],
) -> None:
    c = dep["c"]
    ids = [31, 41, 59, 26, 53, 58, 97]
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 3, "temperature": 0}}
    post(c, "/inference/v1/generate", body)  # the prompt is computed, then cached
    received = c.metric("kv_tokens_received_total")
    plain = same_for_every_port(
        dep, "/inference/v1/generate", body, "kv_transfer_params", lambda p: kv_params(ids, p)
    )
    assert plain[0] == 200
    assert c.metric("kv_tokens_received_total") == received


def test_a_reference_that_needs_the_params_is_refused_with_one_text_whatever_the_port(
    dep: dict[str, Any],
) -> None:
    # A metadata-only reference carries no image: without a trusted load it cannot be
    # served. The refusal is one fixed text; nothing in it depends on the port.
    c = dep["c"]
    part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "ref-1"}
    content = [part, {"type": "text", "text": "hi"}]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    refusal = answer(post(c, "/v1/chat/completions", body))
    assert refusal[0] == 400 and refusal[1]["error"]["code"] == "ec_item_unavailable"
    # The item's key, as the consumer names it in its refusal.
    mm_hash = refusal[1]["error"]["message"].split()[2]
    plain = same_for_every_port(dep, "/v1/chat/completions", body, "ec_transfer_params",
                                lambda port: {mm_hash: {**entry(port), "num_tokens": 4,
                                                        "shape": [4, 64]}})  # fmt: skip
    assert plain == refusal
    assert httpx.get(c.url + "/health", timeout=10).status_code == 200


def test_a_consumer_says_once_at_start_that_it_ignores_transfer_params(
    dep: dict[str, Any],
) -> None:
    consumer, producer = dep["c"].output(), dep["e"].output()
    assert consumer.count(IGNORED) == 1
    assert "--transfer-secret-file" in consumer and "--transfer-peers" in consumer
    assert IGNORED not in producer


def test_outputs_no_consumer_pulls_leave_the_encoders_cache_free(dep: dict[str, Any]) -> None:
    """An encoder's outputs here are offered to consumers that never pull them (nothing
    trusts them). Its cache holds four such items (``--encoder-cache-size 16``, a
    56x56 image is 4 rows), and twelve requests in a row still answer at once, not
    after the side-channel store's 60 s TTL: a finished request's cache entries are
    freed when it finishes, the store keeping its own reference. (They were held
    until pulled or expired, and the fifth request waited for the first's TTL.)"""
    e = dep["e"]
    computed = e.metric("encoder_items_computed_total")
    for i in range(12):
        image = png_data_url(56, (20 * i, 90, 200 - 10 * i))
        body = {"model": "tiny", "messages": messages("what is it", image), "max_tokens": 1}
        started = time.monotonic()
        r = post(e, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert len(r.json()["ec_transfer_params"]) == 1, r.text
        assert time.monotonic() - started < 20
    assert e.metric("encoder_items_computed_total") == computed + 12
