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

No pixels where none are needed: an image whose bytes this preprocessor has already
turned into pixels (same content, same pixel range) is most likely in the engine's
encoder cache (or its KV in the prefix cache), so :meth:`NativeImagePreprocessor.known`
gives its grid without decoding, and the feature carries the bytes instead
(:meth:`NativeImagePreprocessor.deferred`). The scheduler decodes them only if the
encoder must run after all (:func:`decode_deferred`, e.g. the entry was evicted); those
bytes decoded before, so that late decode cannot fail on the image.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from collections import OrderedDict
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
    "decode_deferred",
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


#: Images (content digest and pixel range) remembered as decoded, per preprocessor.
KNOWN_IMAGES = 4096


class NativeImagePreprocessor:
    """The Qwen2-VL image rule with one checkpoint's values, in the Rust core."""

    def __init__(self, spec: dict[str, Any], merge_size: int) -> None:
        #: ``QwenVlPreprocessor`` keyword arguments (plain values: they travel with
        #: deferred images to the engine, maybe in another process).
        self.spec = spec
        self._inner = _core.QwenVlPreprocessor(**spec)
        self.merge_size = merge_size
        self._known: OrderedDict[tuple[bytes, tuple[int, int] | None], tuple[int, int, int]]
        self._known = OrderedDict()
        self._known_lock = threading.Lock()

    def known(self, data: bytes, size: dict[str, int] | None) -> tuple[int, int, int] | None:
        """The grid of ``data`` if this preprocessor decoded the same bytes with the same
        pixel range before (then they decode without error), else ``None``."""
        key = _known_key(data, size)
        with self._known_lock:
            grid = self._known.get(key)
            if grid is not None:
                self._known.move_to_end(key)
            return grid

    def deferred(self, data: bytes, size: dict[str, int] | None) -> tuple[bytes, tuple[Any, ...]]:
        """What a feature carries instead of pixels: the bytes and the rule's values
        (with ``size``'s pixel range), for :func:`decode_deferred`."""
        spec = dict(self.spec, **_pixels(size))
        return data, tuple(sorted((k, _plain(v)) for k, v in spec.items()))

    def _remember(self, images: Sequence[bytes], size: dict[str, int] | None, grids: Any) -> None:
        with self._known_lock:
            for data, grid in zip(images, grids, strict=True):
                self._known[_known_key(data, size)] = grid
            while len(self._known) > KNOWN_IMAGES:
                self._known.popitem(last=False)

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
        if not images:
            return []
        try:
            out = self._inner.preprocess(list(images), **_pixels(size))
        except _core.ImageError as exc:
            raise _input_error(exc, indices[exc.index]) from exc
        count_preprocessed(len(out))
        result = [(tuple(grid), _tensor(buf, shape)) for buf, shape, grid in out]
        self._remember(images, size, [grid for grid, _ in result])
        return result


def _tensor(buf: Any, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(buf, dtype=np.float32).reshape(shape))


def _known_key(data: bytes, size: dict[str, int] | None) -> tuple[bytes, tuple[int, int] | None]:
    pixels = _pixels(size)
    limits = (pixels["min_pixels"], pixels["max_pixels"]) if pixels else None
    return hashlib.blake2b(data, digest_size=20).digest(), limits


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value


@functools.lru_cache(maxsize=8)
def _rule(spec: tuple[tuple[str, Any], ...]) -> Any:
    return _core.QwenVlPreprocessor(**{k: list(v) if isinstance(v, tuple) else v for k, v in spec})


def decode_deferred(feature: Any) -> bool:
    """Give ``feature`` (a ``MultiModalFeature`` whose image was deferred) its
    ``pixel_values`` now, because the encoder must run on it. False when it has no
    deferred image or the result does not fit its placeholder (logged)."""
    deferred = getattr(feature, "deferred", None)
    if deferred is None:
        return False
    data, spec = deferred
    try:
        rule = _rule(tuple((k, _plain(v)) for k, v in spec))
        ((buf, shape, grid),) = rule.preprocess([data])
    except (ValueError, TypeError, MemoryError) as exc:
        logger.warning("deferred image %s could not be decoded: %s", feature.mm_hash, exc)
        return False
    if tuple(grid) != tuple(feature.image_grid_thw):
        logger.warning(
            "deferred image %s decoded to grid %s, not %s",
            feature.mm_hash,
            tuple(grid),
            tuple(feature.image_grid_thw),
        )
        return False
    count_preprocessed()
    feature.pixel_values = _tensor(buf, shape)
    feature.deferred = None
    return True


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
        spec = {
            "min_pixels": int(size["shortest_edge"]),
            "max_pixels": int(size["longest_edge"]),
            "patch_size": int(image_processor.patch_size),
            "merge_size": int(image_processor.merge_size),
            "temporal_patch_size": int(image_processor.temporal_patch_size),
            "rescale_factor": float(image_processor.rescale_factor),
            "image_mean": [float(v) for v in image_processor.image_mean],
            "image_std": [float(v) for v in image_processor.image_std],
            "resample": int(image_processor.resample),
            "formats": list(formats) if formats is not None else None,
            "max_image_pixels": max_image_pixels,
        }
        native = NativeImagePreprocessor(spec, int(image_processor.merge_size))
    except (ValueError, TypeError, KeyError) as exc:
        if log:
            logger.info("image preprocessing: transformers %s (native path: %s)", name, exc)
        return None
    if log:
        logger.info("image preprocessing: native (Rust) Qwen2-VL rule for %s", name)
    return native


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
