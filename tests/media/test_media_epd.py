"""Images by URL in E+PD, behind ``ec-frontend proxy`` and behind vLLM 0.33.0's EPD proxy
(``disagg_epd_proxy.py``, unmodified, run by the vLLM environment).

Only the encoder fetches: the prefill/decode instance is started **without**
``--allowed-media-networks``, so any fetch it tried would fail the request; it
receives ``image_embeds`` references and counts no fetch, no image decode and no
encoder item, and every request the origin logged is one the encoder counted.
Answers are token-identical to an aggregated instance given the same bytes
inline (and by URL). Neither proxy fetches (the origin's log has exactly the
encoder's fetches).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ..disagg.conftest import proxy, serve, side_channel_ec
from ..helpers.origin import Origin, Route, origin
from ..helpers.processes import Proc, start_all
from ..interop.conftest import VllmScript, vllm_python  # noqa: F401 (a fixture)
from ..interop.test_epd_proxy import vllm_proxy
from .conftest import data_url, image_messages, png_bytes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "tiny"
LOOPBACK = ["--allowed-media-networks", "127.0.0.0/8"]
IMAGES = {"/a.png": png_bytes(56, (200, 30, 30)), "/b.png": png_bytes(84, (20, 160, 90))}
FETCHES = 'ec_frontend_media_fetches_total{scheme="http"}'


@pytest.fixture(scope="module")
def dep(
    vllm_python: Path,  # noqa: F811 (the fixture imported above)
    builtin_model_dir: Path,
) -> Iterator[dict[str, Any]]:
    m = builtin_model_dir
    with origin("127.0.0.1") as media:
        procs = {
            "agg": serve(m, "agg", extra=LOOPBACK),
            "e": serve(m, "e", ec=side_channel_ec("ec_producer"), extra=LOOPBACK),
            "pd": serve(m, "pd", ec=side_channel_ec("ec_consumer")),
        }
        start_all(list(procs.values()))
        ours = proxy("ours", encode=[procs["e"].url], decode=[procs["pd"].url])
        theirs = vllm_proxy(vllm_python, procs["e"].url, procs["pd"].url)
        try:
            start_all([ours])
            theirs.wait_ready()
            yield {**procs, "ours": ours, "vllm": theirs, "origin": media}
        finally:
            theirs.stop()
            ours.stop()
            for p in procs.values():
                p.stop()


def ask(url: str, image: str) -> tuple[str, int]:
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        r = c.chat.completions.create(
            model=MODEL,
            messages=image_messages(image),  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0.0,
        )
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens


def fetches(proc: Proc) -> float:
    return proc.metrics().get(FETCHES, 0.0)


@pytest.mark.parametrize("front", ["ours", "vllm"])
def test_url_images_through_a_proxy_are_fetched_by_the_encoder_only(
    dep: dict[str, Any], front: str
) -> None:
    media: Origin = dep["origin"]
    agg, e, pd = dep["agg"], dep["e"], dep["pd"]
    front_url = dep[front].url
    logged, encoder_fetches = len(media.paths()), fetches(e)
    loaded = pd.metric("ec_items_loaded_total")
    for path, body in IMAGES.items():
        # A URL of its own per proxy: both name an item by the SHA-256 of its URL, and the
        # prefill/decode instance would find the other proxy's items in its caches.
        url = media.set(f"/{front}{path}", Route(body))
        want = ask(agg.url, data_url(body))
        assert ask(agg.url, url) == want
        got = ask(front_url, url)
        assert got == want, (front, path, dep[front].log()[-2000:])
    # The aggregated instance fetched once per image; the rest is the encoder's.
    encoder_delta = fetches(e) - encoder_fetches
    assert encoder_delta >= len(IMAGES)
    assert len(media.paths()) - logged == len(IMAGES) + encoder_delta
    assert fetches(pd) == 0
    assert pd.metric("images_preprocessed_total") == 0
    assert pd.metric("encoder_items_computed_total") == 0
    assert pd.metric("ec_items_loaded_total") - loaded >= len(IMAGES)


def test_an_encoder_fetch_failure_reaches_the_client(dep: dict[str, Any]) -> None:
    """Through our proxy, an origin 404 is the encoder's 400 (no partial work: the
    prefill/decode instance never sees the request)."""
    media: Origin = dep["origin"]
    before = dep["pd"].metric("prompt_tokens_computed_total")
    with pytest.raises(openai.BadRequestError) as info:
        ask(dep["ours"].url, media.url("/nowhere.png"))
    err: Any = info.value.body
    assert (err["code"], err["param"]) == ("media_fetch_failed", "messages[0].content[1].image_url")
    assert dep["pd"].metric("prompt_tokens_computed_total") == before
