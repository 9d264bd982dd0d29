"""Encoder-cache keys across tenants (issue 15, H1; DESIGN 4.5).

Before keys had namespaces, a lower-case hex ``uuid`` was used verbatim as the
item's key: an attacker who sent their image with ``uuid`` set to the content hash of
a victim's image planted their embeddings under the victim's key, and the victim's
later requests were answered from them. Here the attack runs against a real server
on the built-in model, and the victim's greedy logprobs are compared with those of
a fresh server that never saw the attacker.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import ec_frontend as ecf
import httpx
import openai
import pytest
from PIL import Image

from ..disagg.conftest import proxy, serve, side_channel_ec
from ..helpers.processes import Proc, start_all

MODEL_NAME = "tiny"


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), color).save(buf, format="PNG")
    return buf.getvalue()


VICTIM_PNG = _png((20, 60, 220))
ATTACKER_PNG = _png((230, 200, 10))


def _messages(png: bytes, uuid: str | None = None) -> list[dict[str, Any]]:
    part: dict[str, Any] = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()},
    }
    if uuid is not None:
        part["uuid"] = uuid
    return [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]},
    ]


def _chat_body(png: bytes, uuid: str | None = None, salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": _messages(png, uuid)}
    if salt is not None:
        body["cache_salt"] = salt
    return body


class _Server:
    """A built-in-model server and an openai client on it."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        self.model_id = httpx.get(proc.url + "/v1/models").json()["data"][0]["root"]

    def greedy(self, body: dict[str, Any]) -> list[tuple[str, float, list[float]]]:
        """Each generated token with its logprob and its top-3 logprobs."""
        extra = {k: v for k, v in body.items() if k not in ("model", "messages")}
        r = self.client.chat.completions.create(
            model=MODEL_NAME,
            messages=body["messages"],
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body=extra,
        )
        content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        assert content, r
        return [(t.token, t.logprob, [top.logprob for top in t.top_logprobs]) for t in content]

    def encoder_counters(self) -> tuple[float, float]:
        m = self.proc.metrics()
        return (
            m["ec_frontend_encoder_items_computed_total"],
            m["ec_frontend_encoder_cache_hits_total"],
        )

    def key(self, body: dict[str, Any]) -> str:
        """The key the server gives the body's one item (it parses with its model id)."""
        raw = httpx.Request("POST", "/", json=body).content
        parsed = ecf.parse_request("chat", raw, model_id=self.model_id)
        (item,) = parsed.media
        return item.mm_hash


class Deployment(NamedTuple):
    fresh: _Server  # an aggregated server that never sees the attacker
    attacked: _Server  # the PD instance, attacked directly (no transfer params: it encodes)
    encoder: Proc
    proxy: Proc


@pytest.fixture(scope="module")
def dep(builtin_model_dir: Path) -> Iterator[Deployment]:
    """An aggregated server, and E+PD over the EC side channel behind a proxy."""
    m = builtin_model_dir
    agg = serve(m, "agg")
    e = serve(m, "e", ec=side_channel_ec("ec_producer"))
    pd = serve(m, "pd", ec=side_channel_ec("ec_consumer"))
    procs = start_all([agg, e, pd])
    procs.append(proxy("proxy", encode=[e.url], decode=[pd.url]).wait_ready())
    servers = (_Server(agg), _Server(pd))
    try:
        yield Deployment(*servers, e, procs[3])
    finally:
        for server in servers:
            server.client.close()
        codes = {p.name: p.stop() for p in procs}
    assert (codes["agg"], codes["e"], codes["pd"]) == (0, 0, 0)


def _same(a: list[tuple[str, float, list[float]]], b: list[tuple[str, float, list[float]]]) -> bool:
    return [t for t, _, _ in a] == [t for t, _, _ in b] and all(
        lp_a == pytest.approx(lp_b, abs=1e-4) and top_a == pytest.approx(top_b, abs=1e-4)
        for (_, lp_a, top_a), (_, lp_b, top_b) in zip(a, b, strict=True)
    )


@pytest.mark.slow
def test_uuid_cannot_poison_a_content_key(dep: Deployment) -> None:
    attacked, fresh = dep.attacked, dep.fresh
    victim = _chat_body(VICTIM_PNG)
    victim_key = ecf.compute_mm_hash(VICTIM_PNG, model_id=attacked.model_id)
    assert attacked.key(victim) == victim_key

    reference = fresh.greedy(victim)
    attacker = _chat_body(ATTACKER_PNG, uuid=victim_key)
    assert attacked.key(attacker) == ecf.hash_for_uuid(victim_key, model_id=attacked.model_id)
    assert attacked.key(attacker) != victim_key
    attacked.greedy(attacker)

    computed, hits = attacked.encoder_counters()
    got = attacked.greedy(victim)
    assert attacked.encoder_counters() == (computed + 1, hits), "the victim's image was encoded"
    assert _same(got, reference), (got, reference)


@pytest.mark.slow
def test_shared_keys_serve_the_first_item_unless_salted(dep: Deployment) -> None:
    """One uuid names one item: a second image sent under a uuid already cached is
    answered from the first image's embeddings (so the comparison above can see a
    poisoned answer), unless the two requests carry different ``cache_salt``."""
    attacked, fresh = dep.attacked, dep.fresh
    reference = fresh.greedy(_chat_body(VICTIM_PNG))

    attacked.greedy(_chat_body(ATTACKER_PNG, uuid="shared-name"))
    computed, hits = attacked.encoder_counters()
    prefix_hits = attacked.proc.metric("prefix_cache_hits_total")
    shared = attacked.greedy(_chat_body(VICTIM_PNG, uuid="shared-name"))
    # Not encoded again: served from the first item's encoder output, or (prefix
    # caching is on by default) from KV blocks keyed by that same item.
    new_computed, new_hits = attacked.encoder_counters()
    assert new_computed == computed
    assert new_hits == hits + 1 or attacked.proc.metric("prefix_cache_hits_total") > prefix_hits
    assert not _same(shared, reference), "a cache hit on the other image's key looks the same"

    attacked.greedy(_chat_body(ATTACKER_PNG, uuid="salted-name", salt="tenant-a"))
    computed, hits = attacked.encoder_counters()
    salted = attacked.greedy(_chat_body(VICTIM_PNG, uuid="salted-name", salt="tenant-b"))
    assert attacked.encoder_counters() == (computed + 1, hits)
    assert _same(salted, reference), (salted, reference)


@pytest.mark.slow
@pytest.mark.parametrize("uuid", [None, "item-9"])
def test_encoder_and_decoder_agree_on_salted_keys(dep: Deployment, uuid: str | None) -> None:
    """Through the proxy, a salted item (content- or uuid-keyed) encoded on E is
    found under the same key on PD: PD loads it and encodes nothing."""
    e, pd, px = dep.encoder, dep.attacked.proc, dep.proxy
    before = (e.metric("encoder_items_computed_total"), pd.metrics())
    client = openai.OpenAI(base_url=px.url + "/v1", api_key="unused", max_retries=0)
    body = _chat_body(VICTIM_PNG, uuid=uuid, salt=f"tenant-{uuid}")
    with client:
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=body["messages"], max_tokens=3, temperature=0,
            extra_body={"cache_salt": body["cache_salt"]},
        )  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop")
    after = pd.metrics()
    assert e.metric("encoder_items_computed_total") == before[0] + 1
    assert (
        after["ec_frontend_encoder_items_computed_total"]
        == (before[1]["ec_frontend_encoder_items_computed_total"])
    )
    assert after["ec_frontend_ec_items_loaded_total"] == (
        before[1]["ec_frontend_ec_items_loaded_total"] + 1
    )


@pytest.mark.parametrize(
    ("salt", "code"),
    [("", "invalid_value"), (7, "invalid_type"), (["a"], "invalid_type"), (False, "invalid_type")],
)
def test_bad_cache_salt_is_a_request_error(salt: Any, code: str) -> None:
    body = httpx.Request("POST", "/", json={**_chat_body(VICTIM_PNG), "cache_salt": salt}).content
    with pytest.raises(ecf.RequestError) as err:
        ecf.parse_request("chat", body)
    assert (err.value.code, err.value.param) == (code, "cache_salt")


def test_keys_from_python_match_the_parser() -> None:
    """``compute_mm_hash`` / ``hash_for_uuid`` give what ``parse_request`` gives, for
    every salt and kwargs, so a client or a proxy can predict keys."""
    kwargs = {"max_pixels": 50176}
    for salt in (None, "tenant-a"):
        for uuid in (None, "item-1", "ab" * 32):
            body = {**_chat_body(VICTIM_PNG, uuid, salt), "mm_processor_kwargs": kwargs}
            raw = httpx.Request("POST", "/", json=body).content
            parsed = ecf.parse_request("chat", raw, model_id="m")
            assert parsed.cache_salt == salt
            scope: dict[str, Any] = {
                "model_id": "m",
                "processor_kwargs": kwargs,
                "cache_salt": salt,
            }
            want = (
                ecf.compute_mm_hash(VICTIM_PNG, **scope)
                if uuid is None
                else ecf.hash_for_uuid(uuid, **scope)
            )
            assert parsed.media[0].mm_hash == want
