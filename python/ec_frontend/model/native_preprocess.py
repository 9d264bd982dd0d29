"""Image bytes -> ``pixel_values`` in the Rust core (``ec_frontend._core``), off the GIL.

:func:`native_preprocessor_for` looks at a checkpoint's transformers image processor
and returns a :class:`NativeImagePreprocessor` when a native rule reproduces it
(Qwen2-VL's image processor and its subclasses; CLIP's, as LLaVA-1.5 uses it, with
a centre crop no larger than the resized image; bicubic or bilinear resampling and
the usual rescale / normalize / RGB steps), else ``None``; the caller then keeps
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
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ec_frontend import _core
from ec_frontend.metrics import IMAGES_PREPROCESSED
from ec_frontend.model.errors import InputError
from ec_frontend.model.image_settings import (
    QWEN_VL_TYPES,
    processor_class_names,
    processor_name,
)

if TYPE_CHECKING:
    from ec_frontend.model.processor import MultiModalFeature

__all__ = [
    "DISABLE_ENV",
    "DeferredImage",
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


#: transformers image processor classes whose rule the native path implements
#: (Qwen2-VL's: ``image_settings.QWEN_VL_TYPES``).
_CLIP_CLASSES = ("CLIPImageProcessor", "CLIPImageProcessorPil", "CLIPImageProcessorFast")


#: A plain value of a native rule (a keyword argument of ``_core``'s preprocessors).
RuleValue = str | int | float | tuple[float, ...] | tuple[str, ...] | None
#: A deferred image: its bytes and its rule's values, sorted by name.
DeferredImage = tuple[bytes, tuple[tuple[str, RuleValue], ...]]

#: Images (content digest and pixel range) remembered as decoded, per preprocessor.
KNOWN_IMAGES = 4096


class NativeImagePreprocessor:
    """One checkpoint's image rule (``spec["rule"]``: ``"qwen_vl"`` or ``"clip"``) in the
    Rust core."""

    def __init__(self, spec: dict[str, Any]) -> None:
        #: The rule's name, the native class's keyword arguments and, for CLIP, the
        #: vision patch size (``grid_patch``); plain values, as they travel with
        #: deferred images to the engine, maybe in another process.
        self.spec = spec
        self.rule = spec["rule"]
        kwargs = {k: v for k, v in spec.items() if k not in ("rule", "grid_patch")}
        self._inner: _core.ClipPreprocessor | _core.QwenVlPreprocessor
        if self.rule == "clip":
            self._inner = _core.ClipPreprocessor(**kwargs)
        else:
            self._inner = _core.QwenVlPreprocessor(**kwargs)
        self._known: OrderedDict[tuple[str, tuple[int, int] | None], tuple[int, int, int]]
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

    def deferred(self, data: bytes, size: dict[str, int] | None) -> DeferredImage:
        """What a feature carries instead of pixels: the bytes and the rule's values
        (with ``size``'s pixel range), for :func:`decode_deferred`."""
        spec = dict(self.spec, **_pixels(size))
        return data, tuple(sorted((k, _plain(v)) for k, v in spec.items()))

    def covers(self, size: dict[str, int] | None) -> bool:
        """Whether the native rule serves a request with this processor ``size`` (CLIP:
        only the checkpoint's own)."""
        return size is None or self.rule == "qwen_vl"

    def _remember(
        self,
        images: Sequence[bytes],
        size: dict[str, int] | None,
        grids: Sequence[tuple[int, int, int]],
    ) -> None:
        with self._known_lock:
            for data, grid in zip(images, grids, strict=True):
                self._known[_known_key(data, size)] = grid
            while len(self._known) > KNOWN_IMAGES:
                self._known.popitem(last=False)

    def grid(
        self, width: int, height: int, *, size: dict[str, int] | None = None, index: int = 0
    ) -> tuple[int, int, int]:
        """``(t, h, w)`` of a ``width`` x ``height`` image from its size alone."""
        if isinstance(self._inner, _core.ClipPreprocessor):
            patch: int = self.spec["grid_patch"]
            crop_height: int = self.spec["crop_height"]
            crop_width: int = self.spec["crop_width"]
            return 1, crop_height // patch, crop_width // patch
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
        out: list[tuple[_core.PixelBuffer, tuple[int, ...], tuple[int, int, int]]]
        try:
            if isinstance(self._inner, _core.ClipPreprocessor):
                grid = self.grid(0, 0)
                out = [(buf, shape, grid) for buf, shape in self._inner.preprocess(list(images))]
            else:
                out = list(self._inner.preprocess(list(images), **_pixels(size)))
        except _core.ImageError as exc:
            raise _input_error(exc, indices[exc.index]) from exc
        count_preprocessed(len(out))
        result = [(grid, _tensor(buf, shape)) for buf, shape, grid in out]
        self._remember(images, size, [grid for grid, _ in result])
        return result


def _tensor(buf: _core.PixelBuffer, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(memoryview(buf), dtype=np.float32).reshape(shape))


def _known_key(data: bytes, size: dict[str, int] | None) -> tuple[str, tuple[int, int] | None]:
    pixels = _pixels(size)
    limits = (pixels["min_pixels"], pixels["max_pixels"]) if pixels else None
    # blake3 in the native core: a seventh of blake2b's time on a 1280x720 JPEG.
    return _core.compute_mm_hash(data), limits


def _plain(value: Any) -> RuleValue:
    return tuple(value) if isinstance(value, list | tuple) else value


@functools.lru_cache(maxsize=8)
def _rule(spec: tuple[tuple[str, RuleValue], ...]) -> NativeImagePreprocessor:
    return NativeImagePreprocessor({k: list(v) if isinstance(v, tuple) else v for k, v in spec})


def decode_deferred(feature: MultiModalFeature) -> bool:
    """Give ``feature`` (a ``MultiModalFeature`` whose image was deferred) its
    ``pixel_values`` now, because the encoder must run on it. False when it has no
    deferred image or the result does not fit its placeholder (logged)."""
    deferred = getattr(feature, "deferred", None)
    if deferred is None:
        return False
    data, spec = deferred
    try:
        rule = _rule(tuple((k, _plain(v)) for k, v in spec))
        ((grid, pixels),) = rule.preprocess([data], [0])
    except (InputError, ValueError, TypeError, KeyError, MemoryError) as exc:
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
    feature.pixel_values = pixels
    feature.deferred = None
    return True


def _pixels(size: dict[str, int] | None) -> dict[str, int]:
    if not size:
        return {}
    return {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}


def _input_error(exc: _core.ImageError, index: int) -> InputError:
    return InputError(f"image {index} {exc.message}", code=exc.code)


def native_preprocessor_for(
    image_processor: Any,
    *,
    formats: Sequence[str] | None = None,
    max_image_pixels: int = 64_000_000,
    log: bool = True,
    patch_size: int | None = None,
) -> NativeImagePreprocessor | None:
    """The native equivalent of ``image_processor``, or ``None`` when its class or
    settings are not covered; ``log`` says at INFO which path is used and why.
    ``patch_size`` (the vision tower's) sizes a CLIP image's grid."""
    name = processor_name(image_processor)
    rule, reason = _rule_of(image_processor, name, patch_size)
    if reason is None and os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        reason = f"disabled by {DISABLE_ENV}"
    if reason is not None:
        if log:
            logger.info("image preprocessing: transformers %s (native path: %s)", name, reason)
        return None
    ip = image_processor
    size = ip.size
    try:
        spec: dict[str, Any] = {
            "rule": rule,
            "rescale_factor": float(ip.rescale_factor),
            "image_mean": [float(v) for v in ip.image_mean],
            "image_std": [float(v) for v in ip.image_std],
            "resample": int(ip.resample),
            "formats": list(formats) if formats is not None else None,
            "max_image_pixels": max_image_pixels,
        }
        if rule == "clip":
            spec.update(
                shortest_edge=int(size["shortest_edge"]),
                crop_height=int(ip.crop_size["height"]),
                crop_width=int(ip.crop_size["width"]),
                grid_patch=int(patch_size or 0),
            )
        else:
            spec.update(
                min_pixels=int(size["shortest_edge"]),
                max_pixels=int(size["longest_edge"]),
                patch_size=int(ip.patch_size),
                merge_size=int(ip.merge_size),
                temporal_patch_size=int(ip.temporal_patch_size),
            )
        native = NativeImagePreprocessor(spec)
    except (ValueError, TypeError, KeyError) as exc:
        if log:
            logger.info("image preprocessing: transformers %s (native path: %s)", name, exc)
        return None
    if log:
        rule_name = "CLIP" if rule == "clip" else "Qwen2-VL"
        logger.info("image preprocessing: native (Rust) %s rule for %s", rule_name, name)
    return native


def _rule_of(ip: Any, name: str, patch_size: int | None) -> tuple[str, str | None]:
    """The native rule for ``ip`` and ``None``, or a reason it has none."""
    classes = processor_class_names(ip)
    if classes & QWEN_VL_TYPES:
        rule = "qwen_vl"
    elif classes & set(_CLIP_CLASSES):
        rule = "clip"
    else:
        return "", f"no native rule for {name}"
    checks = [
        ("do_resize", True),
        ("do_rescale", True),
        ("do_normalize", True),
        ("do_convert_rgb", True),
        ("do_center_crop", rule == "clip"),
        ("do_pad", False),
    ]
    for attr, want in checks:
        if bool(getattr(ip, attr, want)) != want:
            return rule, f"{attr} is {getattr(ip, attr)!r}"
    size = getattr(ip, "size", None) or {}
    if rule == "qwen_vl" and (not size.get("shortest_edge") or not size.get("longest_edge")):
        return rule, "size has no shortest_edge / longest_edge"
    if rule == "clip":
        crop = getattr(ip, "crop_size", None) or {}
        if not size.get("shortest_edge") or size.get("longest_edge") or size.get("height"):
            return rule, "size is not a shortest_edge alone"
        if not crop.get("height") or not crop.get("width"):
            return rule, "crop_size has no height / width"
        if not patch_size or crop["height"] % patch_size or crop["width"] % patch_size:
            return rule, f"the crop is not a whole number of patches of {patch_size}"
    if int(getattr(ip, "resample", 3)) not in (2, 3):
        return rule, f"resample {ip.resample} (native: bilinear, bicubic)"
    mean, std = getattr(ip, "image_mean", None), getattr(ip, "image_std", None)
    if not isinstance(mean, list | tuple) or not isinstance(std, list | tuple):
        return rule, "image_mean / image_std are not per-channel lists"
    if len(mean) != 3 or len(std) != 3:
        return rule, "image_mean / image_std do not have 3 channels"
    return rule, None
