"""A request's media items with every URL item replaced by the bytes it names.

Contract of :func:`resolve_items`:

* inline items and ``image_embeds`` references are returned as they are;
* the URL items of one request are fetched concurrently, each distinct URL
  once, under one :class:`~ec_frontend.media.fetch.RequestBudget`;
* an item is fetched as its kind (``image`` or ``video``: content types and
  byte cap, :class:`~ec_frontend.media.fetch.MediaFetcher`);
* a fetched item without ``uuid`` is keyed by its content exactly as an inline
  item with the same bytes, model, processor kwargs and ``cache_salt`` (and for
  a video the request's ``media_io_kwargs["video"]``)
  (:func:`ec_frontend._core.compute_mm_hash`), so the same image by URL and
  inline shares encoder-cache and prefix-cache entries, and a URL whose bytes
  change gets a new key; an item with a ``uuid`` keeps the key of its uuid
  (vLLM's EPD proxy and ours name items by ``uuid = sha256(url)``);
* the first failure (in item order) is raised as a
  :class:`~ec_frontend.media.policy.MediaError` naming the item's ``param``,
  after every other fetch of the request has been cancelled and has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ec_frontend import _core
from ec_frontend.media.fetch import Fetched, MediaFetcher, MediaKind, RequestBudget
from ec_frontend.media.policy import MediaError

#: Items at least this large are hashed in a worker thread.
_THREAD_HASH_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class FetchedItem:
    """A media item whose bytes were fetched; reads like the native ``MediaItem``."""

    data: bytes
    url: str
    uuid: str | None
    mm_hash: str
    param: str
    kind: Literal["image", "video"] = "image"
    #: Not enforced against the content (origins often mislabel), as in vLLM.
    mime_type: str | None = None
    image_grid_thw: tuple[int, int, int] | None = None

    def __len__(self) -> int:
        return len(self.data)


async def resolve_items(
    fetcher: MediaFetcher,
    media: Sequence[Any],
    *,
    model_id: str,
    processor_kwargs: Mapping[str, Any] | None,
    cache_salt: str | None,
    video_options: Mapping[str, Any] | None = None,
) -> list[Any]:
    """``media`` with each URL item fetched (module docstring); ``video_options`` is
    the request's ``media_io_kwargs["video"]``."""
    urls: list[tuple[MediaKind, str]] = []
    for item in media:
        url = item.url
        if url is not None and (item.kind, url) not in urls:
            urls.append((item.kind, url))
    if not urls:
        return list(media)
    budget = RequestBudget(fetcher.config.max_request_bytes)
    tasks = {
        (kind, url): asyncio.ensure_future(fetcher.fetch(url, budget, kind)) for kind, url in urls
    }
    try:
        await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    failed = _first_failure(media, tasks)
    if failed is not None:
        raise failed
    kwargs = dict(processor_kwargs) if processor_kwargs is not None else None
    video = dict(video_options) if video_options is not None else None
    out: list[Any] = []
    for item in media:
        if item.url is None:
            out.append(item)
            continue
        fetched: Fetched = tasks[(item.kind, item.url)].result()
        data = fetched.data
        mm_hash = item.mm_hash
        if item.uuid is None:
            mm_hash = await _content_hash(data, model_id, kwargs, cache_salt, item.kind, video)
        out.append(FetchedItem(data, item.url, item.uuid, mm_hash, item.param, kind=item.kind))
    return out


def _first_failure(
    media: Sequence[Any], tasks: Mapping[tuple[MediaKind, str], asyncio.Future[Fetched]]
) -> BaseException | None:
    """The error of the first item (in request order) whose fetch failed, naming it."""
    for item in media:
        task = tasks.get((item.kind, item.url)) if item.url is not None else None
        if task is None or task.cancelled():
            continue
        exc = task.exception()
        if exc is None:
            continue
        if isinstance(exc, MediaError):
            return exc.at(item.param)
        return exc
    return None


async def _content_hash(
    data: bytes,
    model_id: str,
    kwargs: dict[str, Any] | None,
    salt: str | None,
    kind: Literal["image", "video"],
    video: dict[str, Any] | None,
) -> str:
    def run() -> str:
        return _core.compute_mm_hash(
            data,
            model_id=model_id,
            processor_kwargs=kwargs,
            cache_salt=salt,
            kind=kind,
            video_options=video,
        )

    if len(data) >= _THREAD_HASH_BYTES:
        return await asyncio.to_thread(run)
    return run()
