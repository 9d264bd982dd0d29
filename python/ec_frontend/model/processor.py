"""Requests -> model inputs: chat template, tokenizer, image processor, M-RoPE.

An :class:`InputProcessor` turns the three request shapes into
:class:`ProcessedInputs`:

* chat messages with image and video parts (:meth:`InputProcessor.process_chat`):
  the chat template renders one ``<|image_pad|>`` per image and one
  ``<|video_pad|>`` per video, each expanded to as many tokens as the vision
  tower will emit for the item (a video is decoded and sampled by
  :mod:`~ec_frontend.model.video`, preprocessed by the family's video rule);
* a completion prompt, text or token ids (:meth:`InputProcessor.process_prompt`);
* token ids whose image placeholders are already expanded, with the items'
  hashes and grids (:meth:`InputProcessor.process_generate`); their pixels are
  absent and must come from an EC connector.

Every rejected input raises :class:`InputError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeGuard

import numpy as np
import torch
from jinja2 import TemplateError
from transformers import AutoTokenizer, PretrainedConfig

from ec_frontend.metrics import VIDEO_CACHE_HITS
from ec_frontend.model.errors import InputError
from ec_frontend.model.image_settings import load_image_processor
from ec_frontend.model.media import DEFAULT_IMAGE_FORMATS, DEFAULT_MAX_IMAGE_PIXELS, decode_image
from ec_frontend.model.mrope import prompt_positions
from ec_frontend.model.native_preprocess import (
    DeferredImage,
    count_preprocessed,
    native_preprocessor_for,
)
from ec_frontend.model.registry import PositionSpec
from ec_frontend.model.video import VideoLimits, VideoSampling, decode_video
from ec_frontend.model.video_cache import ProcessedVideoCache, content_key

__all__ = [
    "InputError",
    "InputProcessor",
    "MediaLike",
    "MultiModalFeature",
    "ProcessedInputs",
]

_HASH_RE = re.compile(r"[0-9a-f]{1,128}")
# Template variables a request may not set: they steer rendering itself.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "chat_template", "tokenize", "add_generation_prompt",
     "continue_final_message", "return_dict", "return_tensors", "tools", "documents"}
)  # fmt: skip
_PROCESSOR_KWARGS = frozenset({"min_pixels", "max_pixels"})


class MediaLike(Protocol):
    """What the processor reads of a media item (the native ``MediaItem``)."""

    @property
    def data(self) -> bytes | None: ...
    @property
    def mm_hash(self) -> str: ...


@dataclass(frozen=True, slots=True)
class VideoPatches:
    """The video a Qwen3-VL temporal patch item belongs to: the video's ``mm_hash``,
    its ``[t, h, w]`` grid and the time of each of its ``t`` patches (what a
    ``video_embeds`` reference to the whole video carries), and which patch this is."""

    mm_hash: str
    grid: tuple[int, int, int]
    times: tuple[float, ...]
    patch: int


@dataclass(slots=True)
class MultiModalFeature:
    """One image of a prompt.

    Its placeholder occupies ``prompt_token_ids[offset : offset + length]`` (all
    image tokens); ``length`` equals the encoder's output rows for the image.
    ``pixel_values`` is ``[t*h*w, patch_dim]`` float32 on the CPU, or ``None``
    when the encoder output must come from a connector or the image is ``deferred``:
    then ``deferred`` holds its bytes and the native rule's values, decoded only if
    the encoder has to run on it (``native_preprocess.decode_deferred``).
    """

    mm_hash: str
    offset: int
    length: int
    image_grid_thw: tuple[int, int, int]
    pixel_values: torch.Tensor | None
    deferred: DeferredImage | None = None
    #: The grid a reference to the item carries where that is not ``image_grid_thw``
    #: (a LLaVA-OneVision video: ``(frames, height, width)``; its item's grid marks
    #: the video for the tower).
    reference_grid: tuple[int, int, int] | None = None
    #: ``"image"`` or ``"video"`` (then ``image_grid_thw`` is the video's grid).
    modality: str = "image"
    #: Whether the grid alone sizes and places the item (a ``*_embeds`` reference),
    #: with :attr:`second_per_grid_ts` where the item has it.
    sized_by_grid: bool = True
    #: A video's seconds per temporal patch, where its M-RoPE positions use absolute
    #: time (Qwen2.5-VL); a reference to it carries this beside its grid.
    second_per_grid_ts: float | None = None
    #: For one temporal patch of a video split into patch items (Qwen3-VL): the video.
    #: Its items are published as one entry for the whole video (``ec_item_params``).
    video_patch_of: VideoPatches | None = None


@dataclass(slots=True)
class ProcessedInputs:
    """A prompt ready for the engine. ``mrope_positions`` is ``[3, len(prompt)]``
    int64; decode position ``i`` (``i >= len(prompt)``) is ``i + mrope_position_delta``
    on all three components. ``mm_features`` are sorted by offset."""

    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    mrope_positions: torch.Tensor
    mrope_position_delta: int
    prompt: str | None = None
    #: vLLM's ``cache_salt``: scopes the prefix cache's block keys to a tenant.
    cache_salt: str | None = None


class InputProcessor:
    """Tokenizer, chat template and image processor of one Qwen2-VL checkpoint.

    Safe to call from several threads (tokenizer calls are serialized; image
    decoding and processing run in parallel).
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        *,
        image_token_id: int,
        spatial_merge_size: int,
        vocab_size: int,
        max_model_len: int,
        model_id: str = "",
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        positions: PositionSpec | None = None,
        patch_size: int | None = None,
        image_tokens: Callable[[tuple[int, int, int]], int] | None = None,
        video_token_id: int | None = None,
        video_rule: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        #: The video placeholder token and the family's video preprocessing
        #: (``video_processor.QwenVideoRule``); without both, video parts are refused.
        self.video_token_id = video_token_id if video_rule is not None else None
        self.video_rule = video_rule
        self.video_limits = VideoLimits()
        #: Processed videos by content (a server's processor: :meth:`configure_media`;
        #: direct callers decode every time).
        self.video_cache: ProcessedVideoCache[_Video] | None = None
        #: Vision patch size, for image processors that give pixels but no grid
        #: (a fixed-size image is then one frame of ``(h / patch, w / patch)`` patches).
        self.patch_size = patch_size
        #: The family's position scheme (default: M-RoPE).
        self.positions = positions or PositionSpec("mrope")
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.spatial_merge_size = spatial_merge_size
        #: Placeholder tokens of an image grid (the family's count; default
        #: ``t * h * w / merge**2``).
        self.image_tokens = image_tokens or self._merged_tokens
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.max_image_pixels = max_image_pixels
        self.image_formats = DEFAULT_IMAGE_FORMATS
        min_pixels, max_pixels = _processor_pixel_range(image_processor)
        #: ``mm_processor_kwargs`` pixel values a request may ask for (the checkpoint's range).
        self.processor_pixel_range = (min_pixels, max_pixels)
        #: The Rust image rule equal to ``image_processor``; ``None``: transformers' path.
        self.native = native_preprocessor_for(
            image_processor, max_image_pixels=max_image_pixels, patch_size=patch_size
        )
        #: Whether bytes the native path decoded before are deferred, not decoded again
        #: (a server's processor: :meth:`configure_media`; direct callers get pixels).
        self.defer_known_images = False
        #: The encoder cache's rows, when known: see :meth:`configure_media`.
        self.max_item_rows: int | None = None
        # Hugging Face tokenizers are not safe to call from several threads at once.
        self._lock = threading.Lock()

    def configure_media(
        self,
        *,
        max_image_pixels: int | None = None,
        formats: Sequence[str] | None = None,
        max_processor_pixels: int | None = None,
        defer_known_images: bool = True,
        video_limits: VideoLimits | None = None,
        video_cache_bytes: int = 0,
        max_item_rows: int | None = None,
    ) -> None:
        """Server limits: pixels per decoded image, the decoders a request may reach,
        and the largest ``mm_processor_kwargs`` pixel count (default: the checkpoint's
        ``max_pixels``); whether images decoded before are deferred (their encoder
        output is most likely cached); the bytes of processed videos kept for a video
        sent again (0: none); the encoder cache's rows (``--encoder-cache-size``): a
        video whose encoder item would need more is refused before its frames are
        decoded (``None``: the engine refuses it after preprocessing)."""
        self.defer_known_images = defer_known_images
        self.max_item_rows = max_item_rows
        self.video_cache = ProcessedVideoCache(video_cache_bytes) if video_cache_bytes else None
        if video_limits is not None:
            self.video_limits = video_limits
        if max_image_pixels is not None:
            self.max_image_pixels = max_image_pixels
        if formats is not None:
            self.image_formats = tuple(formats)
        if self.native is not None:
            self.native = native_preprocessor_for(
                self.image_processor,
                formats=self.image_formats,
                max_image_pixels=self.max_image_pixels,
                log=False,
                patch_size=self.patch_size,
            )
        if max_processor_pixels is not None:
            low, _ = self.processor_pixel_range
            self.processor_pixel_range = (min(low, max_processor_pixels), max_processor_pixels)

    @classmethod
    def from_pretrained(
        cls,
        directory: Path,
        config: PretrainedConfig,
        *,
        model_id: str = "",
        positions: PositionSpec | None = None,
        spatial_merge_size: int | None = None,
        image_tokens: Callable[[tuple[int, int, int]], int] | None = None,
        video_rule: Callable[[Path, Any], Any] | None = None,
    ) -> InputProcessor:
        """``video_rule`` builds the family's video preprocessing from the checkpoint
        directory and its image processor (``ModelFamily.load_video_rule``)."""
        tokenizer = AutoTokenizer.from_pretrained(directory)
        image_processor = load_image_processor(directory)
        video_token_id = getattr(config, "video_token_id", None)
        return cls(
            tokenizer,
            image_processor,
            image_token_id=int(config.image_token_id),
            spatial_merge_size=int(
                config.vision_config.spatial_merge_size
                if spatial_merge_size is None
                else spatial_merge_size
            ),
            vocab_size=int(config.text_config.vocab_size),
            max_model_len=int(config.text_config.max_position_embeddings),
            model_id=model_id,
            positions=positions,
            patch_size=getattr(config.vision_config, "patch_size", None),
            image_tokens=image_tokens,
            video_token_id=None if video_token_id is None else int(video_token_id),
            video_rule=None if video_rule is None else video_rule(directory, image_processor),
        )

    def _merged_tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * grid[1] * grid[2] // self.spatial_merge_size**2

    @property
    def eos_token_id(self) -> int | None:
        eos: int | None = self.tokenizer.eos_token_id
        return eos

    def process_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        media: Sequence[MediaLike],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        media_io_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """Render ``messages`` (parts ``text`` / ``image`` / ``video`` with
        ``media_index``), tokenize, and expand each image's and video's placeholder.
        Videos are sampled by ``media_io_kwargs["video"]`` (vLLM's). ``tools``
        (OpenAI's function tools) go to the chat template; an assistant message's tool
        call arguments are given to it as objects, as Hugging Face templates expect."""
        order = _image_order(messages, len(media))
        video_order = _image_order(messages, len(media), ("video",))
        if video_order and self.video_token_id is None:
            raise InputError("this model does not take video input", code="unsupported_video")
        size = self._processor_size(mm_processor_kwargs) if order or video_order else None
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise InputError(
                f"chat_template_kwargs may not set {reserved}", code="invalid_template"
            )
        try:
            with self._lock:
                if tools is not None:
                    kwargs["tools"] = list(tools)
                text = self.tokenizer.apply_chat_template(
                    [_template_message(m) for m in messages],
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **kwargs,
                )
        except (TemplateError, TypeError, KeyError, ValueError) as exc:
            raise InputError(f"chat template failed: {exc}", code="invalid_template") from exc
        ids = self._encode(text)
        placeholders = ids.count(self.image_token_id)
        if placeholders != len(order):
            raise InputError(
                f"the prompt has {placeholders} image placeholders but the messages carry "
                f"{len(order)} images (is an image token written in the text?)",
                code="placeholder_mismatch",
            )
        video_token = self.video_token_id
        if video_token is not None and ids.count(video_token) != len(video_order):
            raise InputError(
                f"the prompt has {ids.count(video_token)} video placeholders but the "
                f"messages carry {len(video_order)} videos (is a video token written in "
                "the text?)",
                code="placeholder_mismatch",
            )
        sampling = VideoSampling.from_kwargs(media_io_kwargs)
        videos = iter([self._video(media[i], i, sampling, size) for i in video_order])
        images = iter(self._images(media, order, size))
        out_ids: list[int] = []
        features: list[MultiModalFeature] = []
        time_intervals: dict[int, float] = {}
        for token in ids:
            if token == video_token:
                self._place_video(next(videos), token, out_ids, features, time_intervals)
                continue
            if token != self.image_token_id:
                out_ids.append(token)
                continue
            mm_hash, grid, pixels, deferred = next(images)
            length = self.image_tokens(grid)
            features.append(
                MultiModalFeature(mm_hash, len(out_ids), length, grid, pixels, deferred)
            )
            out_ids.extend([self.image_token_id] * length)
        return self._finish(out_ids, features, text, time_intervals)

    def process_prompt(self, prompt: str | Sequence[int]) -> ProcessedInputs:
        """A text-only completion prompt (a string or token ids)."""
        if isinstance(prompt, str):
            ids = self._encode(prompt)
            text: str | None = prompt
        else:
            ids = self._check_ids(prompt)
            text = None
        if self.image_token_id in ids:
            raise InputError(
                "the prompt contains image placeholder tokens but no images",
                code="placeholder_mismatch",
            )
        return self._finish(ids, [], text)

    def process_generate(
        self, token_ids: Sequence[int], features: Mapping[str, Any] | None
    ) -> ProcessedInputs:
        """Token ids with expanded placeholders plus ``{"mm_hashes", "mm_placeholders",
        "mm_grid_thw"}``; the features get ``pixel_values=None``."""
        ids = self._check_ids(token_ids)
        mm = _generate_features(features, len(ids), self.spatial_merge_size, self.image_tokens)
        covered = 0
        for feat in mm:
            span = ids[feat.offset : feat.offset + feat.length]
            if any(t != self.image_token_id for t in span):
                raise InputError(
                    f"placeholder at offset {feat.offset} (length {feat.length}) is not all "
                    f"image tokens ({self.image_token_id})",
                    code="placeholder_mismatch",
                )
            covered += feat.length
        if ids.count(self.image_token_id) != covered:
            raise InputError(
                "token_ids contain image tokens outside the given mm_placeholders",
                code="placeholder_mismatch",
            )
        return self._finish(ids, mm, None)

    def _finish(
        self,
        ids: list[int],
        features: list[MultiModalFeature],
        text: str | None,
        time_intervals: Mapping[int, float] | None = None,
    ) -> ProcessedInputs:
        """``time_intervals``: the temporal M-RoPE scale of features by offset (default 1)."""
        if not ids:
            raise InputError("the prompt is empty", code="empty_prompt")
        if len(ids) > self.max_model_len:
            raise InputError(
                f"the prompt has {len(ids)} tokens, more than the model's maximum "
                f"context of {self.max_model_len}",
                code="too_many_tokens",
            )
        placements = [(f.offset, f.length, f.image_grid_thw) for f in features]
        intervals = [(time_intervals or {}).get(f.offset, 1.0) for f in features]
        positions, delta = prompt_positions(
            self.positions, len(ids), placements, self.spatial_merge_size, intervals
        )
        return ProcessedInputs(ids, features, positions, delta, text)

    def _encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = list(token_ids)
        for i, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int):
                raise InputError(f"token {i} is not an integer", code="invalid_token_id")
            if not 0 <= token < self.vocab_size:
                raise InputError(
                    f"token {i} ({token}) is outside the vocabulary [0, {self.vocab_size})",
                    code="invalid_token_id",
                )
        return ids

    def _processor_size(self, kwargs: Mapping[str, Any] | None) -> dict[str, int] | None:
        """The image processor's ``size`` for ``mm_processor_kwargs``, checked against the
        checkpoint's pixel range before any image is decoded; ``None`` for the defaults."""
        if not kwargs:
            return None
        unknown = sorted(set(kwargs) - _PROCESSOR_KWARGS)
        if unknown:
            raise InputError(
                f"unsupported mm_processor_kwargs {unknown}; allowed: {sorted(_PROCESSOR_KWARGS)}",
                code="invalid_processor_kwargs",
            )
        low, high = self.processor_pixel_range
        size = dict(self.image_processor.size)
        for key, target in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = kwargs.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InputError(
                    f"mm_processor_kwargs.{key} must be a positive integer",
                    code="invalid_processor_kwargs",
                )
            if not low <= value <= high:
                raise InputError(
                    f"mm_processor_kwargs.{key} is {value}; this model accepts {low} to {high} "
                    "pixels",
                    code="invalid_processor_kwargs",
                )
            size[target] = value
        if size["shortest_edge"] > size["longest_edge"]:
            raise InputError(
                "mm_processor_kwargs: min_pixels exceeds max_pixels",
                code="invalid_processor_kwargs",
            )
        return size

    def _images(
        self, media: Sequence[MediaLike], order: Sequence[int], size: dict[str, int] | None
    ) -> list[tuple[str, tuple[int, int, int], torch.Tensor | None, DeferredImage | None]]:
        """``(mm_hash, grid, pixel_values, deferred)`` of the images ``order`` names:
        inline images through the native path in one parallel call when there is one
        (images it decoded before are deferred, not decoded), else one by one through
        transformers' processor."""
        inline = [i for i in order if getattr(media[i], "image_grid_thw", None) is None]
        native = self.native
        data = {i: b for i in inline if (b := media[i].data) is not None}
        if native is None or not native.covers(size) or not inline or len(data) < len(inline):
            return [(*self._image(media[i], i, size), None) for i in order]
        known = {
            i: native.known(data[i], size) if self.defer_known_images else None for i in inline
        }
        decode = [i for i in inline if known[i] is None]
        done = native.preprocess([data[i] for i in decode], decode, size=size)
        ready: dict[int, tuple[tuple[int, int, int], torch.Tensor | None, DeferredImage | None]] = {
            i: (grid, pixels, None) for i, (grid, pixels) in zip(decode, done, strict=True)
        }
        for i, grid in known.items():
            if grid is not None:
                ready[i] = (grid, None, native.deferred(data[i], size))
        return [
            (media[i].mm_hash, *ready[i]) if i in ready else (*self._image(media[i], i, size), None)
            for i in order
        ]

    def _video(
        self, item: MediaLike, index: int, sampling: VideoSampling, size: dict[str, int] | None
    ) -> _Video:
        """A video item decoded and sampled (bounded by :attr:`video_limits`), then
        through the family's video rule; a ``video_embeds`` reference is sized from its
        grid and has no pixel values."""
        param = getattr(item, "param", None)
        reference = getattr(item, "video_grid_thw", None)
        if reference is not None:
            grid = self._reference_video_grid(reference, index, size)
            seconds = self._reference_seconds(
                getattr(item, "second_per_grid_ts", None), index, param
            )
            times = self._reference_times(getattr(item, "timestamps", None), index, param)
            return _Video(item.mm_hash, grid, None, [], 0, 0.0, seconds, times)
        cache, key = self.video_cache, None
        if cache is not None and item.data is not None:
            pixel_range = None if size is None else tuple(sorted(size.items()))
            # The request's key too: a cache_salt (in it) keeps tenants apart here as
            # in the prefix cache, and the bytes keep a reused uuid from another video.
            key = content_key(item.data, item.mm_hash, sampling, pixel_range)
            hit = cache.get(key)
            if hit is not None:
                VIDEO_CACHE_HITS.inc()
                return hit
        check = None if self.max_item_rows is None else self._rows_check(index, size)
        try:
            decoded = decode_video(
                item.data, index=index, sampling=sampling, limits=self.video_limits, check=check
            )
            grid, pixels = self.video_rule.preprocess(decoded.frames, index=index, size=size)
        except InputError as exc:
            exc.param = param
            raise
        seconds = None
        if self.video_rule.ABSOLUTE_TIME:
            seconds = self.video_rule.second_per_grid_t(
                len(decoded.indices), decoded.total_frames, decoded.fps
            )
        video = _Video(
            item.mm_hash, grid, pixels, decoded.indices, decoded.total_frames, decoded.fps, seconds
        )
        if cache is not None and key is not None and pixels is not None:
            cache.put(key, video, pixels.element_size() * pixels.nelement())
        return video

    def _rows_check(
        self, index: int, size: dict[str, int] | None
    ) -> Callable[[int, int, int], None]:
        """What :func:`decode_video` calls with a video's sampled frame count and frame
        size: a 400 ``video_too_large`` when its largest encoder item would need more
        rows than the encoder cache holds (the engine could never run it), before any
        frame is decoded."""
        limit = self.max_item_rows
        assert limit is not None

        def check(frames: int, height: int, width: int) -> None:
            try:
                grid = self.video_rule.grid_for(frames, height, width, size)
            except ValueError:
                return  # preprocessing refuses these frames, saying why
            rows = self._video_item_rows(grid)
            if rows > limit:
                raise InputError(
                    f"video {index}: {frames} sampled frames of {width}x{height} make an "
                    f"encoder item of {rows} rows; this instance's encoder cache holds {limit} "
                    "(--encoder-cache-size): sample fewer frames "
                    "(media_io_kwargs.video.num_frames or fps) or fewer pixels "
                    "(mm_processor_kwargs.max_pixels)",
                    code="video_too_large",
                )

        return check

    def _video_item_rows(self, grid: tuple[int, int, int]) -> int:
        """The placeholder rows of a video's largest encoder item, from its grid: the
        whole video's, or one temporal patch's where each is an item (Qwen3-VL)."""
        t, h, w = grid
        rows = h * w // self.spatial_merge_size**2
        return rows if self.video_rule.TIMESTAMPS else t * rows

    def _reference_seconds(
        self, seconds: float | None, index: int, param: str | None
    ) -> float | None:
        """The ``second_per_grid_ts`` of a ``video_embeds`` reference, as this model's
        rule needs it: required where positions use absolute time (Qwen2.5-VL, at most
        what a video within ``--max-video-duration`` gives: one sampled frame per
        temporal patch), refused where they do not (Qwen2-VL). 400
        ``invalid_video_embeds`` naming the field otherwise."""
        rule = self.video_rule
        over = None
        if rule.ABSOLUTE_TIME and seconds is not None:
            most = rule.temporal_patch_size * self.video_limits.max_duration_s
            if seconds > most:
                limit = "the most a video within --max-video-duration gives"
                over = f"{seconds} is over {most} seconds, {limit}"
        self._check_reference_field(
            "second_per_grid_ts", seconds, rule.ABSOLUTE_TIME, over, index, param,
            unused="this model's video positions take no frame times",
            needed="this model places a video by its frame times, so a reference needs the "
            "seconds per temporal patch its encoder reported beside video_grid_thw",
        )  # fmt: skip
        return seconds

    def _reference_times(
        self, times: Sequence[float] | None, index: int, param: str | None
    ) -> tuple[float, ...] | None:
        """The ``timestamps`` of a ``video_embeds`` reference (one per temporal patch of
        its grid, checked by the parser), as this model's rule needs them: required
        where the prompt carries each patch's time (Qwen3-VL), each within
        ``--max-video-duration``; refused where it does not. 400
        ``invalid_video_embeds`` naming the field otherwise."""
        most = self.video_limits.max_duration_s
        late = next((t for t in times if t > most), None) if times is not None else None
        over = (
            None if late is None else f"holds {late}, over {most:g} seconds (--max-video-duration)"
        )
        self._check_reference_field(
            "timestamps", times, self.video_rule.TIMESTAMPS, over, index, param,
            unused="this model's prompts take no frame times",
            needed="this model writes each temporal patch's time into the prompt, so a "
            "reference needs the times its encoder reported beside video_grid_thw",
        )  # fmt: skip
        return None if times is None else tuple(float(t) for t in times)

    @staticmethod
    def _check_reference_field(
        name: str,
        value: object,
        takes: bool,
        over: str | None,
        index: int,
        param: str | None,
        *,
        unused: str,
        needed: str,
    ) -> None:
        """400 ``invalid_video_embeds`` naming ``video_embeds.<name>`` when the field is
        given to a model that ``takes`` none (``unused``), missing where it does
        (``needed``), or out of bounds (``over``, said after the field's name)."""
        field = f"video_embeds.{name}"
        if not takes:
            problem = None if value is None else f"{field} is given, but {unused}"
        elif value is None:
            problem = f"{field} is missing: {needed}"
        else:
            problem = None if over is None else f"{field} {over}"
        if problem is not None:
            at = None if param is None else f"{param}.{name}"
            raise InputError(f"video {index}: {problem}", code="invalid_video_embeds", param=at)

    def _place_video(
        self,
        video: _Video,
        token: int,
        out_ids: list[int],
        features: list[MultiModalFeature],
        time_intervals: dict[int, float],
    ) -> None:
        """Append a video's placeholder tokens and features for the family's rule: one
        item of ``t*h*w/merge**2`` tokens; with Qwen2.5-VL's absolute time, its temporal
        M-RoPE scale (``tokens_per_second * second_per_grid_t`` in float32); with
        Qwen3-VL's timestamps, per temporal patch the text ``<{s:.1f} seconds>``, then
        ``<|vision_start|>``, the patch's tokens and ``<|vision_end|>``, each patch
        its own encoder item (:func:`video_patch_hash`)."""
        rule, merge = self.video_rule, self.spatial_merge_size
        t, h, w = video.grid
        if not rule.TIMESTAMPS:
            if video.seconds is not None:
                scale = np.float32(self.positions.time_interval) * np.float32(video.seconds)
                time_intervals[len(out_ids)] = float(scale)
            length = t * h * w // merge**2
            feature = MultiModalFeature(
                video.mm_hash, len(out_ids), length, video.grid, video.pixels, modality="video"
            )
            feature.second_per_grid_ts = video.seconds
            features.append(feature)
            out_ids.extend([token] * length)
            return
        start, end = self._vision_markers()
        rows = h * w
        times = video.times
        if times is None:
            times = tuple(rule.patch_times(video.indices, video.fps))
        for k, seconds in enumerate(times):
            out_ids.extend(self._encode(f"<{seconds:.1f} seconds>"))
            out_ids.append(start)
            pixels = None if video.pixels is None else video.pixels[k * rows : (k + 1) * rows]
            mm_hash = video_patch_hash(video.mm_hash, k)
            feature = MultiModalFeature(mm_hash, len(out_ids), rows // merge**2, (1, h, w), pixels)
            feature.video_patch_of = VideoPatches(video.mm_hash, video.grid, times, k)
            features.append(feature)
            out_ids.extend([token] * (rows // merge**2))
            out_ids.append(end)

    def _vision_markers(self) -> tuple[int, int]:
        """Token ids of ``<|vision_start|>`` and ``<|vision_end|>`` (the tokenizer's own
        names when it has them, as ``Qwen3VLProcessor`` reads them)."""
        tok = self.tokenizer
        names = (
            getattr(tok, "vision_start_token", None) or "<|vision_start|>",
            getattr(tok, "vision_end_token", None) or "<|vision_end|>",
        )
        ids = [tok.convert_tokens_to_ids(name) for name in names]
        if any(not isinstance(i, int) or i == tok.unk_token_id for i in ids):
            raise InputError(
                f"this model's tokenizer has no {names} tokens for video timestamps",
                code="unsupported_video",
            )
        return ids[0], ids[1]

    def _image(
        self, item: MediaLike, index: int, size: dict[str, int] | None
    ) -> tuple[str, tuple[int, int, int], torch.Tensor | None]:
        reference = getattr(item, "image_grid_thw", None)
        if reference is not None:
            return item.mm_hash, self._reference_grid(reference, index, size), None
        image = decode_image(
            item.data, index=index, max_pixels=self.max_image_pixels, formats=self.image_formats
        )
        call_kwargs: dict[str, Any] = {} if size is None else {"size": size}
        try:
            out = self.image_processor(images=[image], return_tensors="pt", **call_kwargs)
        except ValueError as exc:
            raise InputError(
                f"image {index} cannot be processed: {exc}", code="invalid_image"
            ) from exc
        finally:
            image.close()
        count_preprocessed()
        pixels = out["pixel_values"].to(torch.float32)
        if "image_grid_thw" in out:
            t, h, w = (int(v) for v in out["image_grid_thw"][0])
        elif "image_sizes" in out and pixels.ndim == 5:
            # Anyres tiling: [1, tiles, 3, H, W]; the grid is the original size in pixels.
            t, (h, w), pixels = 1, (int(v) for v in out["image_sizes"][0]), pixels[0]
        elif self.patch_size and pixels.ndim == 4:
            t, h, w = 1, pixels.shape[2] // self.patch_size, pixels.shape[3] // self.patch_size
        else:
            raise InputError(
                f"image {index}: the image processor gave no grid", code="invalid_image"
            )
        return item.mm_hash, (t, h, w), pixels

    def _reference_grid(
        self, grid: Sequence[int], index: int, size: dict[str, int] | None
    ) -> tuple[int, int, int]:
        """The grid of a metadata-only image reference (``image_embeds``), checked against
        what this model's processor can produce: one frame, sides that are multiples of
        the merge size, at most the processor's ``max_pixels`` (with the request's
        ``mm_processor_kwargs``). Its placeholder is sized from it; nothing is decoded."""
        t, h, w = (int(v) for v in grid)
        merge = self.spatial_merge_size
        patch = getattr(self.image_processor, "patch_size", None)
        limits = size or self.image_processor.size
        high = limits.get("longest_edge") or self.processor_pixel_range[1]
        problem = None
        if t != 1:
            problem = f"t is {t}; an image has one frame (t = 1)"
        elif h % merge or w % merge:
            problem = f"h and w must be multiples of the merge size {merge}"
        elif isinstance(patch, int) and h * w * patch * patch > high:
            problem = f"{h * patch}x{w * patch} pixels is over this model's max_pixels {high}"
        return _fitting_reference("image", index, (t, h, w), problem)

    def _reference_video_grid(
        self, grid: Sequence[int], index: int, size: dict[str, int] | None
    ) -> tuple[int, int, int]:
        """The grid of a metadata-only video reference (``video_embeds``), checked against
        what this model's video rule can produce from at most ``--max-video-frames``
        frames (``video_rule.reference_problem``). Its placeholder is sized from it."""
        t, h, w = (int(v) for v in grid)
        problem = self.video_rule.reference_problem(
            (t, h, w), size=size, max_frames=self.video_limits.max_frames
        )
        return _fitting_reference("video", index, (t, h, w), problem)


def _fitting_reference(
    kind: str, index: int, grid: tuple[int, int, int], problem: str | None
) -> tuple[int, int, int]:
    """``grid`` of an ``image_embeds`` / ``video_embeds`` reference, or the 400
    ``invalid_<kind>_embeds`` naming its ``problem``."""
    if problem is not None:
        raise InputError(
            f"{kind} {index}: {kind}_embeds.{kind}_grid_thw {list(grid)} does not fit this "
            f"model: {problem}",
            code=f"invalid_{kind}_embeds",
        )
    return grid


@dataclass(frozen=True, slots=True)
class _Video:
    """A preprocessed video and the sampling it came from (indices into the video's
    ``total`` frames at ``fps``), and its seconds per temporal patch where the rule
    places it by absolute time (computed from the sampling, or a reference's)."""

    mm_hash: str
    grid: tuple[int, int, int]
    pixels: torch.Tensor | None
    indices: list[int]
    total: int
    fps: float
    seconds: float | None = None
    #: A reference's time of each temporal patch (Qwen3-VL); else from the sampling.
    times: tuple[float, ...] | None = None


def video_patch_hash(mm_hash: str, patch: int) -> str:
    """The ``mm_hash`` of temporal patch ``patch`` of a video whose patches are separate
    encoder items (Qwen3-VL): lower-case hex, as every ``mm_hash``, a function of the
    video's key (which covers its sampling) and the patch index."""
    return hashlib.sha256(f"qwen3_vl/video-patch/{patch}/{mm_hash}".encode()).hexdigest()


def _template_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """``message`` with its tool calls' JSON ``arguments`` decoded (text that is not
    JSON is left as it is)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    decoded = []
    for call in calls:
        fn = dict(call.get("function") or {})
        with contextlib.suppress(ValueError):
            fn["arguments"] = json.loads(fn.get("arguments") or "{}")
        decoded.append({**call, "function": fn})
    return {**message, "tool_calls": decoded}


def _processor_pixel_range(image_processor: Any) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of the checkpoint's preprocessor config."""
    size = getattr(image_processor, "size", None) or {}
    low = size.get("shortest_edge") or getattr(image_processor, "min_pixels", None)
    high = size.get("longest_edge") or getattr(image_processor, "max_pixels", None)
    crop = getattr(image_processor, "crop_size", None)
    # Values of the checkpoint's transformers processor: whatever its config holds.
    crop_hw: list[Any] = [crop.get(k) if isinstance(crop, Mapping) else getattr(crop, k, None)
                          for k in ("height", "width")]  # fmt: skip
    if not high and not all(crop_hw) and "height" in size:
        # A tiling processor (anyres without a crop): tiles of a fixed size.
        crop_hw = [size.get("height"), size.get("width")]
    if not high and all(crop_hw):
        # A fixed-size processor (resize and center crop): one pixel count.
        area = int(crop_hw[0]) * int(crop_hw[1])
        return area, area
    if not low or not high:
        raise ValueError("the image processor has no min_pixels / max_pixels")
    return int(low), int(high)


def _image_order(
    messages: Sequence[Mapping[str, Any]],
    num_media: int,
    kinds: tuple[str, ...] = ("image", "image_url"),
) -> list[int]:
    """Media indices of the parts of ``kinds`` (images by default), in rendering order."""
    order: list[int] = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") not in kinds:
                continue
            index = part.get("media_index")
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_media:
                raise InputError(
                    f"messages[{m}].content[{p}] refers to media item {index!r}, "
                    f"but the request has {num_media}",
                    code="invalid_media_index",
                )
            order.append(index)
    return order


def _generate_features(
    features: Mapping[str, Any] | None,
    num_tokens: int,
    merge: int,
    image_tokens: Callable[[tuple[int, int, int]], int],
) -> list[MultiModalFeature]:
    if not features:
        return []
    hashes = features.get("mm_hashes") or []
    placeholders = features.get("mm_placeholders") or []
    grids = features.get("mm_grid_thw")
    if grids is None:
        if hashes:
            raise InputError(
                "features.mm_grid_thw is required for Qwen2-VL images", code="invalid_features"
            )
        grids = []
    if not len(hashes) == len(placeholders) == len(grids):
        raise InputError(
            f"features lists differ in length: {len(hashes)} mm_hashes, "
            f"{len(placeholders)} mm_placeholders, {len(grids)} mm_grid_thw",
            code="invalid_features",
        )
    out: list[MultiModalFeature] = []
    for i, (mm_hash, place, grid) in enumerate(zip(hashes, placeholders, grids, strict=True)):
        if not isinstance(mm_hash, str) or not _HASH_RE.fullmatch(mm_hash):
            raise InputError(
                f"features.mm_hashes[{i}] is not lower-case hex", code="invalid_features"
            )
        offset, length = _placeholder(place, i)
        thw = _grid(grid, i, merge)
        expected = image_tokens(thw)
        if length != expected:
            raise InputError(
                f"features.mm_placeholders[{i}].length is {length}, but grid {list(thw)} "
                f"gives {expected} tokens",
                code="placeholder_mismatch",
            )
        if offset + length > num_tokens:
            raise InputError(
                f"features.mm_placeholders[{i}] ends past the prompt ({num_tokens} tokens)",
                code="placeholder_mismatch",
            )
        out.append(MultiModalFeature(mm_hash, offset, length, thw, None))
    out.sort(key=lambda f: f.offset)
    for prev, cur in itertools.pairwise(out):
        if cur.offset < prev.offset + prev.length:
            raise InputError("features.mm_placeholders overlap", code="placeholder_mismatch")
    return out


def _placeholder(place: object, i: int) -> tuple[int, int]:
    if isinstance(place, Mapping):
        offset, length = place.get("offset"), place.get("length")
        if _is_int(offset) and _is_int(length) and offset >= 0 and length > 0:
            return offset, length
    raise InputError(
        f"features.mm_placeholders[{i}] must be {{offset >= 0, length > 0}}",
        code="invalid_features",
    )


def _grid(grid: object, i: int, merge: int) -> tuple[int, int, int]:
    if isinstance(grid, Sequence) and len(grid) == 3 and all(_is_int(v) and v > 0 for v in grid):
        t, h, w = grid
        if h % merge == 0 and w % merge == 0:
            return t, h, w
    raise InputError(
        f"features.mm_grid_thw[{i}] must be three positive integers [t, h, w] with h and w "
        f"multiples of {merge}",
        code="invalid_features",
    )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
