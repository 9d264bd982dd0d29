"""A checkpoint's image processor, read without importing transformers' image
processing where the checkpoint's config allows.

Importing any of transformers' image processor classes imports its modeling code and,
with it, ``torch._dynamo``: about 1.7 CPU-seconds of every API server's start, for
settings that are a dozen plain values. :func:`load_image_processor` reads those
values itself for the Qwen2-VL image processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and
the built-in model), as transformers resolves them: the class defaults, then the
config's keys, ``min_pixels`` / ``max_pixels`` folded into ``size``. It does so only
for a config whose every key it knows, with values of the expected types; any other
config, and every other processor class, loads transformers' processor as before.

The object it returns answers the attributes the native rules and the processor read
(:data:`SETTINGS`); anything else, and a call (transformers' preprocessing path),
builds transformers' processor once and hands over to it.
``tests/model/test_image_settings.py`` checks every attribute against transformers
over a matrix of configs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "QWEN_VL_TYPES",
    "SETTINGS",
    "QwenVLImageSettings",
    "load_image_processor",
    "processor_class_names",
    "processor_name",
]

#: The ``image_processor_type`` values read here: transformers' Qwen2-VL image
#: processor and its backends (one set of settings).
QWEN_VL_TYPES = frozenset(
    {"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil"}
)

#: transformers' defaults for the Qwen2-VL image processor: its class attributes
#: (``image_processing_qwen2_vl.py``) over the backend's (``rescale_factor``; the
#: flags it leaves unset are ``None``).
_QWEN_DEFAULTS: dict[str, Any] = {
    "do_resize": True,
    "resample": 3,  # bicubic
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),
    "image_std": (0.26862954, 0.26130258, 0.27577711),
    "do_convert_rgb": True,
    "do_center_crop": None,
    "do_pad": None,
    "crop_size": None,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}

#: The attributes this object answers without transformers.
SETTINGS = frozenset(_QWEN_DEFAULTS)

_FLAGS = frozenset({"do_resize", "do_rescale", "do_normalize", "do_convert_rgb"})
_INTS = frozenset({"resample", "patch_size", "temporal_patch_size", "merge_size"})
_TRIPLES = frozenset({"image_mean", "image_std"})
#: Keys that name the class and its processor, not settings.
_NAMES = frozenset({"image_processor_type", "processor_class"})


class QwenVLImageSettings:
    """The settings of a Qwen2-VL image processor config (:data:`SETTINGS`, as
    attributes); any other attribute, or a call, goes to transformers' processor of
    the same directory, built on first use."""

    def __init__(self, directory: Path, type_name: str, settings: Mapping[str, Any]) -> None:
        # Instance attributes, as transformers keeps them (``QwenVideoRule`` reads
        # the instance's ``__dict__``).
        self.__dict__.update(settings)
        self.image_processor_type = type_name
        self._directory = directory
        self._lock = threading.Lock()
        self._processor: Any = None

    def transformers_processor(self) -> Any:
        """transformers' processor of this directory (built once)."""
        with self._lock:
            if self._processor is None:
                from transformers import AutoImageProcessor

                self._processor = AutoImageProcessor.from_pretrained(self._directory)
            return self._processor

    def __getattr__(self, name: str) -> Any:
        # Only for names not set above.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.transformers_processor(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.transformers_processor()(*args, **kwargs)

    def __repr__(self) -> str:
        shown = {k: self.__dict__[k] for k in sorted(SETTINGS)}
        return f"QwenVLImageSettings({self.image_processor_type}, {shown})"


def processor_name(image_processor: Any) -> str:
    """The class name of ``image_processor`` (the config's for settings read here)."""
    if isinstance(image_processor, QwenVLImageSettings):
        return image_processor.image_processor_type
    return type(image_processor).__name__


def processor_class_names(image_processor: Any) -> frozenset[str]:
    """The names of ``image_processor``'s class and its bases (for settings read here:
    the Qwen2-VL processor's names)."""
    if isinstance(image_processor, QwenVLImageSettings):
        return QWEN_VL_TYPES
    return frozenset(c.__name__ for c in type(image_processor).__mro__)


def load_image_processor(directory: Path) -> Any:
    """``directory``'s image processor: its settings read here where the config is a
    Qwen2-VL one of known keys, else transformers' ``AutoImageProcessor``."""
    settings = _qwen_settings(directory / "preprocessor_config.json")
    if settings is not None:
        type_name, values = settings
        return QwenVLImageSettings(directory, type_name, values)
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(directory)


def _qwen_settings(path: Path) -> tuple[str, dict[str, Any]] | None:
    """``(image_processor_type, settings)`` of a Qwen2-VL config at ``path`` with
    nothing but known keys of the expected types; ``None`` for anything else."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("image_processor_type") not in QWEN_VL_TYPES:
        return None
    values = {k: (dict(v) if isinstance(v, dict) else v) for k, v in _QWEN_DEFAULTS.items()}
    size: dict[str, Any] = values["size"]
    pixels: dict[str, int] = {}
    for key, value in raw.items():
        if key in _NAMES:
            continue
        if _is_plain(key, value):
            values[key] = value
        elif key in _TRIPLES and _is_triple(value):
            values[key] = tuple(value)
        elif key in ("min_pixels", "max_pixels") and _is_int(value):
            pixels[key] = value
        elif key == "size" and _is_edges(value):
            values["size"] = size = dict(value)
        else:
            return None
    if "min_pixels" in pixels:
        size["shortest_edge"] = pixels["min_pixels"]
    if "max_pixels" in pixels:
        size["longest_edge"] = pixels["max_pixels"]
    if set(size) != {"shortest_edge", "longest_edge"}:
        return None
    return str(raw["image_processor_type"]), values


def _is_plain(key: str, value: object) -> bool:
    """Whether ``key`` is a flag, an integer or the rescale factor, of its type."""
    if key in _FLAGS:
        return isinstance(value, bool)
    if key in _INTS:
        return _is_int(value)
    return key == "rescale_factor" and _is_number(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_triple(value: object) -> bool:
    return isinstance(value, list) and len(value) == 3 and all(_is_number(v) for v in value)


def _is_edges(value: object) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and set(value) <= {"shortest_edge", "longest_edge"}
        and all(_is_int(v) for v in value.values())
    )
