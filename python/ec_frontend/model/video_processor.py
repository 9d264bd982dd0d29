"""Sampled video frames -> ``pixel_values_videos`` and ``video_grid_thw`` by the
family's video rule, equal to transformers' video processor (``Qwen2VLVideoProcessor``
and its successors, ``LlavaOnevisionVideoProcessor``).

Contract of :class:`QwenVideoRule` (values from the checkpoint's
``video_preprocessor_config.json``, else its image processor's, with
transformers' video defaults for the pixel range):

* every frame of a video is resized to one size, ``smart_resize`` of the frame
  size with factor ``patch_size * merge_size`` into ``[min_pixels, max_pixels]``
  (a request's ``mm_processor_kwargs`` override the two); frames that already
  have that size are not resampled (as transformers' resize, which returns
  such frames unchanged); others are resampled bicubically as Pillow does, as
  transformers' PIL image backend does (its torchvision video backend differs
  by a rounding on some pixels: ``docs/video.md``);
* rescale and normalize are fused as transformers fuses them
  (``(x - mean / r) / (std / r)`` in float32);
* the frame count is padded to a multiple of ``temporal_patch_size`` by
  repeating the last frame, and consecutive frames form one temporal patch:
  the grid is ``(frames / temporal_patch_size, h / patch, w / patch)`` and the
  rows are in transformers' order (merge windows contiguous).

The model then reads a video exactly as an image with ``t`` temporal patches.

Two subclasses carry what later Qwen families add (``docs/video.md``):

* :class:`Qwen25VideoRule` (Qwen2.5-VL): the same pixels, and each video's
  ``second_per_grid_ts`` (``temporal_patch_size`` over the rate of the sampled
  frames), which scales the temporal M-RoPE index by absolute time;
* :class:`Qwen3VideoRule` (Qwen3-VL, ``Qwen3VLVideoProcessor``): 16-pixel
  patches, a target size whose pixel budget covers all the frames of the video
  (frames smaller than one merge window are first scaled up, and a video needs
  at least ``temporal_patch_size`` frames), and the time of each temporal patch
  that the prompt writes before the patch's tokens.

:meth:`QwenVideoRule.preprocess` runs the rule in the Rust core (the image
kernels: Pillow's resampling, frames in parallel, one call per video with the GIL
released); :meth:`QwenVideoRule.preprocess_python` is the same rule in Pillow and
torch, the fallback (``EC_FRONTEND_DISABLE_NATIVE_PREPROCESS``, or a rule the
native kernels refuse) and the reference the native path is checked against
(bit-identical, ``tests/media/test_video.py``).

:class:`LlavaOnevisionVideoRule` (LLaVA-OneVision, ``LlavaOnevisionVideoProcessor``)
is not a Qwen rule: each frame is resized to the vision tower's tile and
normalized, with no temporal patches; the tower pools each frame's features
(``model/llava_onevision.py``).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
import torch
from PIL import Image

from ec_frontend import _core
from ec_frontend.model.errors import InputError
from ec_frontend.model.native_preprocess import DISABLE_ENV

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: transformers' ``Qwen2VLVideoProcessor`` pixel range (``size`` of the class).
DEFAULT_MIN_PIXELS = 128 * 28 * 28
DEFAULT_MAX_PIXELS = 28 * 28 * 768
#: Aspect ratios beyond this are refused, as ``smart_resize`` refuses them.
MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The Qwen2-VL target size: both sides multiples of ``factor``, the area within
    ``[min_pixels, max_pixels]``, the aspect ratio kept as far as rounding allows."""
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"the aspect ratio must be below {MAX_ASPECT_RATIO}, got {ratio:g}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class QwenVideoRule:
    """The Qwen2-VL video rule of one checkpoint (module docstring)."""

    #: The pixel range and the patch size of the family's video processor class,
    #: used where the checkpoint's configs give none.
    DEFAULT_PIXELS: ClassVar[tuple[int, int]] = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    DEFAULT_PATCH_SIZE: ClassVar[int] = 14
    #: Whether the temporal M-RoPE index is scaled by ``second_per_grid_t``.
    ABSOLUTE_TIME: ClassVar[bool] = False
    #: Whether the prompt writes each temporal patch's time before its tokens.
    TIMESTAMPS: ClassVar[bool] = False

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float

    @classmethod
    def from_checkpoint(cls, directory: Path, image_processor: Any) -> QwenVideoRule:
        """The rule of ``directory``'s ``video_preprocessor_config.json`` when it has one,
        else of its image processor's values with transformers' video pixel range."""
        path = directory / "video_preprocessor_config.json"
        raw: Mapping[str, Any] = {}
        if path.is_file():
            raw = json.loads(path.read_text(encoding="utf-8"))

        def pick(key: str, default: Any) -> Any:
            value = raw.get(key)
            return default if value is None else value

        size = raw.get("size") or {}
        image = getattr(image_processor, "__dict__", {})
        mean = pick("image_mean", image.get("image_mean", (0.48145466, 0.4578275, 0.40821073)))
        std = pick("image_std", image.get("image_std", (0.26862954, 0.26130258, 0.27577711)))
        low, high = cls.DEFAULT_PIXELS
        return cls(
            min_pixels=int(pick("min_pixels", size.get("shortest_edge", low))),
            max_pixels=int(pick("max_pixels", size.get("longest_edge", high))),
            patch_size=int(pick("patch_size", image.get("patch_size", cls.DEFAULT_PATCH_SIZE))),
            temporal_patch_size=int(
                pick("temporal_patch_size", image.get("temporal_patch_size", 2))
            ),
            merge_size=int(pick("merge_size", image.get("merge_size", 2))),
            image_mean=(float(mean[0]), float(mean[1]), float(mean[2])),
            image_std=(float(std[0]), float(std[1]), float(std[2])),
            rescale_factor=float(pick("rescale_factor", 1 / 255)),
        )

    def target_size(
        self, height: int, width: int, size: Mapping[str, int] | None = None
    ) -> tuple[int, int]:
        low, high = self.min_pixels, self.max_pixels
        if size is not None:
            low = int(size.get("shortest_edge", low))
            high = int(size.get("longest_edge", high))
        return smart_resize(height, width, self.patch_size * self.merge_size, low, high)

    def reference_problem(
        self,
        grid: tuple[int, int, int],
        *,
        size: Mapping[str, int] | None = None,
        max_frames: int,
    ) -> str | None:
        """Why a video grid reported by another instance (a ``video_embeds`` reference)
        cannot come from this rule (``None``: it can): at most ``max_frames`` frames in
        temporal patches, sides that are multiples of the merge size, and at most the
        rule's ``max_pixels`` (or ``size``'s) per frame. (Absolute time, Qwen2.5-VL's,
        comes beside the grid as ``second_per_grid_ts``, and Qwen3-VL's patch times as
        ``timestamps``; the processor checks them.)"""
        t, h, w = grid
        high = self.max_pixels if size is None else int(size.get("longest_edge", self.max_pixels))
        most = -(-max_frames // self.temporal_patch_size)
        if t > most:
            return (
                f"t is {t}; at most {max_frames} frames (--max-video-frames) make "
                f"{most} temporal patches"
            )
        if h % self.merge_size or w % self.merge_size:
            return f"h and w must be multiples of the merge size {self.merge_size}"
        pixels = h * w * self.patch_size * self.patch_size
        if pixels > high:
            return f"{h * self.patch_size}x{w * self.patch_size} pixels is over max_pixels {high}"
        return None

    def video_size(
        self, num_frames: int, height: int, width: int, size: Mapping[str, int] | None = None
    ) -> tuple[int, int]:
        """The size every frame of a video of ``num_frames`` frames is resized to."""
        return self.target_size(height, width, size)

    def grid_for(
        self, num_frames: int, height: int, width: int, size: Mapping[str, int] | None = None
    ) -> tuple[int, int, int]:
        """The ``(t, h, w)`` grid :meth:`preprocess` gives ``num_frames`` frames of
        ``height`` x ``width`` (known before any frame is decoded)."""
        h, w = self.video_size(num_frames, height, width, size)
        t = -(-num_frames // self.temporal_patch_size)
        return t, h // self.patch_size, w // self.patch_size

    def preprocess(
        self, frames: np.ndarray, *, index: int, size: Mapping[str, int] | None = None
    ) -> tuple[tuple[int, int, int], torch.Tensor]:
        """``(grid_thw, pixel_values [t*h*w, 3*temporal*patch*patch] float32)`` of
        ``frames`` (``[n, H, W, 3]`` uint8 RGB), by the native kernels when they take
        this rule, else by :meth:`preprocess_python`. The native kernels size each
        frame alone (Qwen2-VL's ``smart_resize``); a rule that sizes frames otherwise
        (Qwen3-VL's budget for the whole video) runs in Python."""
        per_frame = type(self).video_size is QwenVideoRule.video_size
        native = _native_kernels(self) if per_frame else None
        if native is None:
            return self.preprocess_python(frames, index=index, size=size)
        pixels: dict[str, int] = {}
        if size is not None:
            pixels["min_pixels"] = int(size.get("shortest_edge", self.min_pixels))
            pixels["max_pixels"] = int(size.get("longest_edge", self.max_pixels))
        # An ndarray exports the buffer protocol; numpy's stubs do not say so to mypy.
        contiguous = cast("Buffer", np.ascontiguousarray(frames, dtype=np.uint8))
        try:
            buf, shape, grid = native.preprocess_video(contiguous, index=index, **pixels)
        except _core.ImageError as exc:
            raise InputError(f"video {index} {exc.message}", code="invalid_video") from exc
        values = np.frombuffer(memoryview(buf), dtype=np.float32).reshape(shape)
        return grid, torch.from_numpy(values)

    def preprocess_python(
        self, frames: np.ndarray, *, index: int, size: Mapping[str, int] | None = None
    ) -> tuple[tuple[int, int, int], torch.Tensor]:
        """:meth:`preprocess` in Pillow and torch (the fallback and the reference)."""
        count, height, width, _ = frames.shape
        try:
            th, tw = self.video_size(count, height, width, size)
        except ValueError as exc:
            raise InputError(
                f"video {index} cannot be processed: {exc}", code="invalid_video"
            ) from exc
        if (th, tw) != (height, width):
            frames = np.stack(
                [
                    np.asarray(Image.fromarray(f).resize((tw, th), Image.Resampling.BICUBIC))
                    for f in frames
                ]
            )
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # n, 3, H, W
        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        video = video.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])
        return self._patchify(video)

    def _patchify(self, video: torch.Tensor) -> tuple[tuple[int, int, int], torch.Tensor]:
        temporal, patch, merge = self.temporal_patch_size, self.patch_size, self.merge_size
        n, channels, height, width = video.shape
        if pad := -n % temporal:
            video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)), dim=0)
            n += pad
        gt, gh, gw = n // temporal, height // patch, width // patch
        patches = video.view(
            gt, temporal, channels, gh // merge, merge, patch, gw // merge, merge, patch
        )
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(gt * gh * gw, channels * temporal * patch * patch)
        return (gt, gh, gw), flat.contiguous()


@dataclass(frozen=True, slots=True)
class Qwen25VideoRule(QwenVideoRule):
    """Qwen2.5-VL: Qwen2-VL's pixels, and the seconds each temporal patch spans."""

    ABSOLUTE_TIME: ClassVar[bool] = True

    def second_per_grid_t(self, sampled: int, total: int, fps: float) -> float:
        """``temporal_patch_size / sampled_fps``, as ``Qwen2_5_VLProcessor`` computes it:
        the rate of the sampled frames is ``sampled / total * fps`` (``fps`` the
        video's own rate), as transformers' ``VideoMetadata.sampled_fps`` has it."""
        return self.temporal_patch_size / (sampled / total * fps)


def qwen3_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Qwen3-VL's video target size: frames smaller than ``factor`` are scaled up to
    it first, then the sides are rounded to multiples of ``factor`` with the pixels of
    all ``num_frames`` frames (rounded to whole temporal patches) within
    ``[min_pixels, max_pixels]``."""
    if num_frames < temporal_factor:
        raise ValueError(
            f"a video needs at least {temporal_factor} frames (one temporal patch), got "
            f"{num_frames}; ask for more with media_io_kwargs.video.num_frames"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"the aspect ratio must be below {MAX_ASPECT_RATIO}, got {ratio:g}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class Qwen3VideoRule(QwenVideoRule):
    """Qwen3-VL (``Qwen3VLVideoProcessor`` without its per-frame pixel cap, transformers'
    default): the pixel range bounds a whole video, and each temporal patch is
    preceded in the prompt by its time."""

    DEFAULT_PIXELS: ClassVar[tuple[int, int]] = (128 * 32 * 32, 32 * 32 * 768)
    DEFAULT_PATCH_SIZE: ClassVar[int] = 16
    TIMESTAMPS: ClassVar[bool] = True

    def video_size(
        self, num_frames: int, height: int, width: int, size: Mapping[str, int] | None = None
    ) -> tuple[int, int]:
        low, high = self.min_pixels, self.max_pixels
        if size is not None:
            low = int(size.get("shortest_edge", low))
            high = int(size.get("longest_edge", high))
        return qwen3_smart_resize(
            num_frames,
            height,
            width,
            temporal_factor=self.temporal_patch_size,
            factor=self.patch_size * self.merge_size,
            min_pixels=low,
            max_pixels=high,
        )

    def patch_times(self, indices: list[int], fps: float) -> list[float]:
        """Seconds of each temporal patch, as ``Qwen3VLProcessor`` writes them: the
        sampled indices padded like the frames (the last repeated), each over the
        video's rate, the mean of the first and last frame of each patch."""
        temporal = self.temporal_patch_size
        padded = list(indices) + [indices[-1]] * (-len(indices) % temporal)
        seconds = [i / fps for i in padded]
        return [
            (seconds[k] + seconds[k + temporal - 1]) / 2 for k in range(0, len(seconds), temporal)
        ]


@functools.lru_cache(maxsize=16)
def _native_kernels(rule: QwenVideoRule) -> _core.QwenVlPreprocessor | None:
    """The Rust core's Qwen2-VL kernels with ``rule``'s values (bicubic, as the Python
    path resamples), or ``None`` when disabled (``EC_FRONTEND_DISABLE_NATIVE_PREPROCESS``)
    or refused (settings the core cannot honour)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    try:
        return _core.QwenVlPreprocessor(
            min_pixels=rule.min_pixels,
            max_pixels=rule.max_pixels,
            patch_size=rule.patch_size,
            merge_size=rule.merge_size,
            temporal_patch_size=rule.temporal_patch_size,
            rescale_factor=rule.rescale_factor,
            image_mean=list(rule.image_mean),
            image_std=list(rule.image_std),
            resample=int(Image.Resampling.BICUBIC),
        )
    except ValueError:
        return None


#: The first grid entry of a LLaVA-OneVision video item (images use 1 and 2:
#: ``llava_onevision.ALONE`` and ``ONE_OF_SEVERAL``).
ONEVISION_VIDEO = 3


@dataclass(frozen=True, slots=True)
class LlavaOnevisionVideoRule:
    """LLaVA-OneVision (``LlavaOnevisionVideoProcessor``): every frame resized to the
    vision tower's tile (``size`` height x width, no anyres tiling), rescaled and
    normalized as transformers fuses it; no temporal patches. The item's grid is
    ``(ONEVISION_VIDEO, frames, 1)`` and its pixels ``[frames, 3, height, width]``; a
    reference to it carries ``(frames, height, width)`` (:meth:`reference_grid`)."""

    ABSOLUTE_TIME: ClassVar[bool] = False
    TIMESTAMPS: ClassVar[bool] = False

    height: int
    width: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float

    @classmethod
    def from_checkpoint(cls, directory: Path, image_processor: Any) -> LlavaOnevisionVideoRule:
        """The rule of ``directory``'s ``video_preprocessor_config.json`` (its missing
        keys at ``LlavaOnevisionVideoProcessor``'s defaults: 384x384, CLIP's mean and
        std); without one, of its image processor's values, as transformers then
        reads the image processor's config."""
        path = directory / "video_preprocessor_config.json"
        if path.is_file():
            raw: Mapping[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        else:
            keys = ("size", "image_mean", "image_std", "rescale_factor")
            raw = {key: getattr(image_processor, key, None) for key in keys}
        size = dict(raw.get("size") or {})
        mean = raw.get("image_mean") or (0.48145466, 0.4578275, 0.40821073)
        std = raw.get("image_std") or (0.26862954, 0.26130258, 0.27577711)
        return cls(
            height=int(size.get("height") or 384),
            width=int(size.get("width") or 384),
            image_mean=(float(mean[0]), float(mean[1]), float(mean[2])),
            image_std=(float(std[0]), float(std[1]), float(std[2])),
            rescale_factor=float(raw.get("rescale_factor") or 1 / 255),
        )

    def grid_for(
        self, num_frames: int, height: int, width: int, size: Mapping[str, int] | None = None
    ) -> tuple[int, int, int]:
        """The item grid :meth:`preprocess` gives ``num_frames`` frames (any size: every
        frame becomes one tile)."""
        return ONEVISION_VIDEO, num_frames, 1

    def reference_grid(self, frames: int) -> tuple[int, int, int]:
        """The ``video_grid_thw`` an encoder publishes for a video of ``frames`` sampled
        frames: ``(frames, height, width)``, the tile every frame was resized to, in
        pixels (as this family's image grids give pixel sizes). Its placeholder,
        ``frames * ceil(n / 2)**2 + 1`` tokens, follows from it."""
        return frames, self.height, self.width

    def reference_problem(
        self,
        grid: tuple[int, int, int],
        *,
        size: Mapping[str, int] | None = None,
        max_frames: int,
    ) -> str | None:
        """Why a ``video_embeds`` grid cannot be one :meth:`reference_grid` gives
        (``None``: it can): at most ``max_frames`` frames, at this rule's tile size
        (``size`` is unused: the tile is fixed)."""
        frames, height, width = grid
        if frames > max_frames:
            return f"{frames} frames is over --max-video-frames {max_frames}"
        if (height, width) != (self.height, self.width):
            return (
                f"h and w must be this model's video tile, {self.height}x{self.width} "
                f"pixels (every frame is resized to it), got {height}x{width}"
            )
        return None

    def item_grid(self, reference: tuple[int, int, int]) -> tuple[int, int, int]:
        """The encoder item's grid, ``(ONEVISION_VIDEO, frames, 1)``, of a
        :meth:`reference_grid`."""
        return ONEVISION_VIDEO, reference[0], 1

    def preprocess(
        self, frames: np.ndarray, *, index: int, size: Mapping[str, int] | None = None
    ) -> tuple[tuple[int, int, int], torch.Tensor]:
        """``(grid, pixel_values [frames, 3, height, width] float32)`` of ``frames``
        (``[n, H, W, 3]`` uint8 RGB); ``size`` is unused (the tile is fixed)."""
        count, height, width, _ = frames.shape
        if (height, width) != (self.height, self.width):
            frames = np.stack(
                [
                    np.asarray(
                        Image.fromarray(f).resize(
                            (self.width, self.height), Image.Resampling.BICUBIC
                        )
                    )
                    for f in frames
                ]
            )
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        video = video.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])
        return (ONEVISION_VIDEO, count, 1), video.contiguous()
