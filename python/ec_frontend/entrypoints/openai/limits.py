"""Request-level resource bounds of the server, checked before work is spent.

:class:`ResourceLimits` holds the bounds (each a ``serve`` flag); the checks
here raise :class:`~ec_frontend.entrypoints.http.errors.APIError` with a status and
a ``code`` that names the limit:

* media: items per request, pixels per image and per request, read from each
  image's header (nothing is decoded), the decoder set and the data URL's MIME
  type against the detected format (:func:`check_media`);
* prompt text in characters, before the tokenizer sees it (:func:`check_prompt_text`);
* engine requests one HTTP request may fan out to (prompts x ``n``);
* input processing (decode, tokenizer, image processor) in a bounded
  :class:`ProcessingPool`: when its queue is full, 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ec_frontend._core import ParsedRequest
from ec_frontend.entrypoints.http.errors import APIError
from ec_frontend.model.media import DEFAULT_IMAGE_FORMATS, probe_image
from ec_frontend.model.video import VideoLimits
from ec_frontend.model.video_cache import DEFAULT_CACHE_GB

T = TypeVar("T")

#: Characters of prompt text allowed per token of context when no explicit limit is set.
PROMPT_CHARS_PER_TOKEN = 16
#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1


def default_workers() -> int:
    """Input-processing threads: one per CPU, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """Per-request and server-wide bounds on what a request may cost.

    ``max_prompt_chars`` ``None`` means ``PROMPT_CHARS_PER_TOKEN * max_model_len``;
    ``max_processor_pixels`` ``None`` means the checkpoint's own ``max_pixels``.
    """

    max_media_items: int = 32
    max_image_pixels: int = 25_000_000
    max_request_pixels: int = 100_000_000
    image_formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS
    max_processor_pixels: int | None = None
    max_prompt_chars: int | None = None
    max_fanout: int = 256
    #: ``serve`` derives the default from the engine (``launcher.engine_request_limit``).
    max_engine_requests: int = 1024
    processing_workers: int = 0
    max_processing_queue: int = 64
    #: Bounds on each video (``--max-video-*``), checked where it is decoded.
    video: VideoLimits = field(default_factory=VideoLimits)
    #: Bytes of processed videos each API server keeps for a video sent again
    #: (``--mm-processor-cache-gb``; 0: none).
    video_cache_bytes: int = int(DEFAULT_CACHE_GB * 2**30)

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return PROMPT_CHARS_PER_TOKEN * max_model_len


def too_busy(message: str, code: str) -> APIError:
    """429 with ``Retry-After``."""
    return APIError(429, message, code=code, headers={"retry-after": str(RETRY_AFTER_S)})


def check_media(media: Sequence[Any], limits: ResourceLimits) -> None:
    """Bound the request's images from their headers alone.

    Every inline item is probed (format and size, no pixel decoded): the
    format must be one of ``limits.image_formats`` and agree with the data
    URL's MIME type, each image within ``max_image_pixels``, all together
    within ``max_request_pixels``.
    """
    if len(media) > limits.max_media_items:
        raise APIError(
            400,
            f"the request has {len(media)} media items; at most {limits.max_media_items} "
            "are allowed (--max-media-items)",
            param="messages",
            code="too_many_media_items",
        )
    total = 0
    for i, item in enumerate(media):
        if item.kind == "video":
            continue  # bounded by --max-video-* where it is decoded (model/video.py)
        data = item.data
        if data is None:
            continue
        try:
            fmt, width, height = probe_image(data, index=i, formats=limits.image_formats)
        except ValueError as exc:
            code = getattr(exc, "code", "invalid_image")
            raise APIError(400, str(exc), param=item.param, code=code) from exc
        mime = item.mime_type
        if mime is not None and not _mime_matches(mime, fmt):
            raise APIError(
                400,
                f"image {i} is declared as {mime} but its content is {fmt}",
                param=item.param,
                code="mime_type_mismatch",
            )
        pixels = width * height
        if pixels > limits.max_image_pixels:
            raise APIError(
                400,
                f"image {i} is {width}x{height} ({pixels} pixels); at most "
                f"{limits.max_image_pixels} pixels per image are allowed (--max-image-pixels)",
                param=item.param,
                code="image_too_large",
            )
        total += pixels
        if total > limits.max_request_pixels:
            raise APIError(
                400,
                f"the request's images have more than {limits.max_request_pixels} pixels "
                "together (--max-request-pixels)",
                param=item.param,
                code="too_many_pixels",
            )


#: MIME types each decoder answers to, beyond Pillow's own ``image/<format>``.
_JPEG_TYPES = frozenset({"image/jpeg", "image/jpg", "image/pjpeg"})
_MIME_ALIASES: dict[str, frozenset[str]] = {
    "JPEG": _JPEG_TYPES,
    # Pillow's JPEG decoder names a multi-picture JPEG (as phone cameras write) MPO.
    "MPO": _JPEG_TYPES,
    "BMP": frozenset({"image/bmp", "image/x-bmp", "image/x-ms-bmp"}),
}


def _mime_matches(mime: str, fmt: str) -> bool:
    mime = mime.split(";", 1)[0].strip().lower()
    return mime in _MIME_ALIASES.get(fmt, frozenset({"image/" + fmt.lower()}))


def check_prompt_text(parsed: ParsedRequest, limits: ResourceLimits, max_model_len: int) -> None:
    """Reject prompt text longer than the character limit, before tokenization.

    Counted: completion prompts (each), chat and responses text parts and the string
    values of ``chat_template_kwargs`` (together).
    """
    limit = limits.prompt_chars(max_model_len)
    if parsed.endpoint == "completions":
        prompts = parsed.prompts or []
        for i, prompt in enumerate(prompts):
            size = len(prompt) if isinstance(prompt, str) else 0
            if size > limit:
                param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise text_too_long(size, limit, param)
        return
    if parsed.endpoint in ("chat", "responses"):
        size = sum(_text_chars(m) for m in parsed.messages or [])
        # Template variables are rendered into the prompt too.
        kwargs = parsed.chat_template_kwargs or {}
        size += sum(len(v) for v in kwargs.values() if isinstance(v, str))
        if size > limit:
            param = "messages" if parsed.endpoint == "chat" else "input"
            raise text_too_long(size, limit, param)


def _text_chars(message: Mapping[str, Any]) -> int:
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    total = 0
    for part in content or ():
        text = part.get("text") if isinstance(part, Mapping) else None
        if isinstance(text, str):
            total += len(text)
    return total


def text_too_long(size: int, limit: int, param: str) -> APIError:
    return APIError(
        400,
        f"the prompt text has {size} characters; at most {limit} are allowed (--max-prompt-chars)",
        param=param,
        code="prompt_too_long",
    )


def check_fanout(parsed: ParsedRequest, limits: ResourceLimits) -> int:
    """The number of engine requests ``parsed`` becomes; 400 above ``max_fanout``."""
    prompts = len(parsed.prompts or []) if parsed.endpoint == "completions" else 1
    count = prompts * parsed.n
    if count > limits.max_fanout:
        param = "n" if prompts == 1 else "prompt"
        raise APIError(
            400,
            f"the request asks for {count} completions ({prompts} prompts x n={parsed.n}); "
            f"at most {limits.max_fanout} are allowed per request (--max-fanout)",
            param=param,
            code="too_many_completions",
        )
    return count


class ProcessingPool:
    """A fixed set of threads for input processing, with a bounded queue.

    :meth:`run` raises a 429 :class:`APIError` (with ``Retry-After``) instead of
    queueing when ``workers + max_queue`` calls are already admitted, so a
    burst of expensive requests costs bounded memory and CPU.
    """

    def __init__(self, workers: int, max_queue: int) -> None:
        self.workers = workers if workers > 0 else default_workers()
        self.capacity = self.workers + max(0, max_queue)
        self.admitted = 0
        self.rejected = 0
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="ec-inputs")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.admitted >= self.capacity:
            self.rejected += 1
            raise too_busy(
                f"input processing is at capacity ({self.capacity} requests); retry later "
                "(--processing-workers, --max-processing-queue)",
                "processing_queue_full",
            )
        self.admitted += 1
        loop = asyncio.get_running_loop()
        try:
            future = self._executor.submit(fn, *args, **kwargs)
        except BaseException:
            self.admitted -= 1
            raise
        # A slot is free when the work ends, not when its caller stops waiting.
        future.add_done_callback(lambda _: _call_soon(loop, self._release))
        return await asyncio.wrap_future(future)

    def _release(self) -> None:
        self.admitted -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop has nothing left to account for
        loop.call_soon_threadsafe(fn)
