"""Image bytes -> ``pixel_values`` in the Rust core (``ec_frontend._core``), off the GIL.

:func:`native_preprocessor_for` looks at a checkpoint's transformers image processor
and returns a :class:`NativeImagePreprocessor` when the native rule reproduces it
(Qwen2-VL's image processor and its subclasses with bicubic or bilinear resampling
and the usual rescale / normalize / RGB steps), else ``None``; the caller then keeps
transformers' processor. The native path decodes with the decoders Pillow uses (or
bit-identical ones), resamples as Pillow does and patchifies in transformers' layout:
its output equals transformers' PIL backend (``tests/preprocess``).

:func:`images_preprocessed` counts the images this process decoded and preprocessed,
on either path (``ec_frontend_images_preprocessed_total`` on ``/metrics``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ec_frontend import _core
from ec_frontend.metrics import IMAGES_PREPROCESSED
from ec_frontend.model.errors import InputError

__all__ = [
    "DISABLE_ENV",
    "NativeImagePreprocessor",
    "count_preprocessed",
    "images_preprocessed",
    "native_preprocessor_for",
]

logger = logging.getLogger(__name__)

#: Set (to anything but ``0``) to keep transformers' processor even where the native
#: rule applies (benchmarks and parity tests compare the two paths).
DISABLE_ENV = "EC_FRONTEND_DISABLE_NATIVE_PREPROCESS"

_count_lock = threading.Lock()


def count_preprocessed(n: int = 1) -> None:
    """Record ``n`` images decoded and preprocessed (native or transformers path)."""
    with _count_lock:
        IMAGES_PREPROCESSED.inc(amount=n)


def images_preprocessed() -> int:
    """Images decoded and preprocessed by this process so far."""
    return int(IMAGES_PREPROCESSED.get())


#: transformers image processor classes whose rule the native path implements.
_QWEN_VL_CLASSES = (
    "Qwen2VLImageProcessor",
    "Qwen2VLImageProcessorPil",
    "Qwen2VLImageProcessorFast",
)


class NativeImagePreprocessor:
    """The Qwen2-VL image rule with one checkpoint's values, in the Rust core."""

    def __init__(self, inner: Any, merge_size: int) -> None:
        self._inner = inner
        self.merge_size = merge_size

    def grid(
        self, width: int, height: int, *, size: dict[str, int] | None = None, index: int = 0
    ) -> tuple[int, int, int]:
        """``(t, h, w)`` of a ``width`` x ``height`` image from its size alone."""
        try:
            return self._inner.grid(width, height, **_pixels(size))
        except _core.ImageError as exc:
            raise _input_error(exc, index) from exc

    def preprocess(
        self,
        images: Sequence[bytes],
        indices: Sequence[int],
        *,
        size: dict[str, int] | None = None,
    ) -> list[tuple[tuple[int, int, int], torch.Tensor]]:
        """Decode and preprocess ``images`` (in parallel, without the GIL): per image its
        grid and ``pixel_values`` (``[t*h*w, patch_dim]`` float32, sharing the native
        buffer). ``indices`` name the images in errors (their request positions)."""
        try:
            out = self._inner.preprocess(list(images), **_pixels(size))
        except _core.ImageError as exc:
            raise _input_error(exc, indices[exc.index]) from exc
        count_preprocessed(len(out))
        result = []
        for buf, shape, grid in out:
            array = np.frombuffer(buf, dtype=np.float32).reshape(shape)
            result.append((tuple(grid), torch.from_numpy(array)))
        return result


def _pixels(size: dict[str, int] | None) -> dict[str, int]:
    if not size:
        return {}
    return {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}


def _input_error(exc: Any, index: int) -> InputError:
    return InputError(f"image {index} {exc.message}", code=exc.code)


def native_preprocessor_for(
    image_processor: Any,
    *,
    formats: Sequence[str] | None = None,
    max_image_pixels: int = 64_000_000,
    log: bool = True,
) -> NativeImagePreprocessor | None:
    """The native equivalent of ``image_processor``, or ``None`` when its class or
    settings are not covered; ``log`` says at INFO which path is used and why."""
    name = type(image_processor).__name__
    reason = _unsupported(image_processor, name)
    if reason is None and os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        reason = f"disabled by {DISABLE_ENV}"
    if reason is not None:
        if log:
            logger.info("image preprocessing: transformers %s (native path: %s)", name, reason)
        return None
    size = image_processor.size
    try:
        inner = _core.QwenVlPreprocessor(
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            temporal_patch_size=int(image_processor.temporal_patch_size),
            rescale_factor=float(image_processor.rescale_factor),
            image_mean=[float(v) for v in image_processor.image_mean],
            image_std=[float(v) for v in image_processor.image_std],
            resample=int(image_processor.resample),
            formats=list(formats) if formats is not None else None,
            max_image_pixels=max_image_pixels,
        )
    except (ValueError, TypeError, KeyError) as exc:
        if log:
            logger.info("image preprocessing: transformers %s (native path: %s)", name, exc)
        return None
    if log:
        logger.info("image preprocessing: native (Rust) Qwen2-VL rule for %s", name)
    return NativeImagePreprocessor(inner, int(image_processor.merge_size))


def _unsupported(ip: Any, name: str) -> str | None:
    if not any(c.__name__ in _QWEN_VL_CLASSES for c in type(ip).__mro__):
        return f"no native rule for {name}"
    checks = (
        ("do_resize", True),
        ("do_rescale", True),
        ("do_normalize", True),
        ("do_convert_rgb", True),
    )
    for attr, want in checks:
        if bool(getattr(ip, attr, want)) != want:
            return f"{attr} is {getattr(ip, attr)!r}"
    size = getattr(ip, "size", None) or {}
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        return "size has no shortest_edge / longest_edge"
    if int(getattr(ip, "resample", 3)) not in (2, 3):
        return f"resample {ip.resample} (native: bilinear, bicubic)"
    mean, std = getattr(ip, "image_mean", None), getattr(ip, "image_std", None)
    if not isinstance(mean, list | tuple) or not isinstance(std, list | tuple):
        return "image_mean / image_std are not per-channel lists"
    if len(mean) != 3 or len(std) != 3:
        return "image_mean / image_std do not have 3 channels"
    return None
