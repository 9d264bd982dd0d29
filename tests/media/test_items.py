"""A request's URL items resolved to bytes: keys, concurrency, failures."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from typing import Any

import orjson
import pytest
from ec_frontend import _core
from ec_frontend.media import MediaError, MediaFetchConfig, MediaFetcher, parse_networks
from ec_frontend.media.items import FetchedItem, resolve_items
from PIL import Image

from ..helpers.origin import Origin, Route, origin

MODEL = "ec-frontend/qwen2-vl-tiny"


def png(color: tuple[int, int, int], size: int = 28) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def chat(urls: list[str], uuids: list[str | None] | None = None, **extra: Any) -> bytes:
    uuids = uuids or [None] * len(urls)
    parts = []
    for url, uid in zip(urls, uuids, strict=True):
        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
        if uid is not None:
            part["uuid"] = uid
        parts.append(part)
    return orjson.dumps({"messages": [{"role": "user", "content": parts}], **extra})


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def resolve(fetcher: MediaFetcher, body: bytes) -> list[Any]:
    parsed = _core.parse_request("chat", body, model_id=MODEL)

    async def run() -> list[Any]:
        try:
            return await resolve_items(
                fetcher,
                parsed.media,
                model_id=MODEL,
                processor_kwargs=parsed.mm_processor_kwargs,
                cache_salt=parsed.cache_salt,
            )
        finally:
            await fetcher.aclose()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def local() -> Any:
    with origin("127.0.0.1") as o:
        yield o


def fetcher(**kw: Any) -> MediaFetcher:
    return MediaFetcher(MediaFetchConfig(allowed_networks=parse_networks("127.0.0.0/8"), **kw))


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"cache_salt": "tenant-a"},
        {"mm_processor_kwargs": {"max_pixels": 200704, "min_pixels": 3136}},
    ],
)
def test_a_fetched_item_has_the_key_of_the_same_bytes_inline(
    local: Origin, extra: dict[str, Any]
) -> None:
    body = png((40, 50, 60))
    url = local.set("/same.png", Route(body))
    fetched = resolve(fetcher(), chat([url], **extra))[0]
    inline = _core.parse_request("chat", chat([data_url(body)], **extra), model_id=MODEL).media[0]
    url_keyed = _core.parse_request("chat", chat([url], **extra), model_id=MODEL).media[0]
    assert isinstance(fetched, FetchedItem)
    assert fetched.data == body == inline.data
    assert fetched.mm_hash == inline.mm_hash
    assert fetched.mm_hash != url_keyed.mm_hash  # content, not the URL
    assert fetched.param == "messages[0].content[0].image_url"


def test_new_bytes_behind_one_url_get_a_new_key(local: Origin) -> None:
    url = local.set("/latest.png", Route(png((1, 1, 1))))
    first = resolve(fetcher(), chat([url]))[0].mm_hash
    local.set("/latest.png", Route(png((2, 2, 2))))
    second = resolve(fetcher(), chat([url]))[0].mm_hash
    assert first != second


def test_an_item_with_a_uuid_keeps_the_uuid_key(local: Origin) -> None:
    url = local.set("/named.png", Route(png((3, 3, 3))))
    fetched = resolve(fetcher(), chat([url], ["sha-of-url"]))[0]
    assert fetched.data == png((3, 3, 3))
    assert fetched.mm_hash == _core.hash_for_uuid("sha-of-url", model_id=MODEL)


def test_items_are_fetched_concurrently_and_once_per_url(local: Origin) -> None:
    """Three slow URLs (about 0.6 s each) take about as long as one; a URL given twice
    is fetched once."""
    body = png((9, 9, 9), size=8)
    drip = 0.6 / len(body)
    urls = [local.set(f"/slow{i}.png", Route(body, drip_s=drip)) for i in range(3)]
    before = len(local.paths())
    started = time.monotonic()
    items = resolve(fetcher(), chat([*urls, urls[0]]))
    elapsed = time.monotonic() - started
    assert [i.data for i in items] == [body] * 4
    assert len(local.paths()) - before == 3
    assert elapsed < 1.5, elapsed


def test_inline_items_pass_through(local: Origin) -> None:
    body = png((5, 5, 5))
    url = local.set("/mixed.png", Route(png((6, 6, 6))))
    items = resolve(fetcher(), chat([data_url(body), url]))
    assert items[0].data == body and not isinstance(items[0], FetchedItem)
    assert isinstance(items[1], FetchedItem)


def test_the_first_failing_item_is_named_and_the_others_are_cancelled(local: Origin) -> None:
    slow = local.set("/forever.png", Route(png((7, 7, 7)) * 50, drip_s=0.5))
    missing = local.url("/missing.png")
    started = time.monotonic()
    with pytest.raises(MediaError) as info:
        resolve(fetcher(timeout_s=30.0), chat([slow, missing]))
    assert time.monotonic() - started < 5.0  # the slow fetch was not waited for
    assert info.value.param == "messages[0].content[1].image_url"
    assert info.value.reason == "http_status"
