"""Model families, keyed by a checkpoint's ``architectures`` and ``model_type``.

A family is one module under :mod:`ec_frontend.model` exporting ``FAMILY``, a
:class:`ModelFamily`, and one line in :data:`FAMILIES` naming that module. The
entry is imported only when a checkpoint of the family is loaded. A family kept
outside this package registers with :func:`register_family` from a plugin module
(``EC_FRONTEND_PLUGINS``, imported by the server and the engine process alike). The engine
never branches on a family name: it asks the family (or the loaded model) for
capabilities instead:

* :class:`PositionSpec`: 1-D RoPE or M-RoPE (its sections, contiguous or
  interleaved, the time scaling of video frames) and whether the KV wire must
  carry an M-RoPE position delta;
* the vision tower class and the prefixes of its weights in a checkpoint;
* :meth:`ModelFamily.num_image_tokens`: placeholder tokens per image grid, which
  is also the row count of the item's encoder output ``[tokens, hidden_size]``
  that the EC connectors and ``ec_transfer_params`` carry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from ec_frontend.model.errors import ModelLoadError

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn
    from transformers import PretrainedConfig

    from ec_frontend.model.processor import InputProcessor
    from ec_frontend.model.qwen2_text import Qwen2TextModel, TextShape
    from ec_frontend.model.qwen2_vl import Qwen2VLModel

__all__ = [
    "FAMILIES",
    "ModelFamily",
    "PositionSpec",
    "UnsupportedModelError",
    "family_for",
    "register_family",
    "supported_model_types",
]

#: model_type -> module holding its ``FAMILY``. One line per family.
_FAMILIES: dict[str, str] = {
    "qwen2_vl": "ec_frontend.model.qwen2_vl",
    "qwen2_5_vl": "ec_frontend.model.qwen2_5_vl",
    "llava": "ec_frontend.model.llava",
    "qwen3_vl": "ec_frontend.model.qwen3_vl",
    "llava_next": "ec_frontend.model.llava_next",
    "llava_onevision": "ec_frontend.model.llava_onevision",
}
#: Read-only view of the registered families (:func:`register_family` adds to it).
FAMILIES: Mapping[str, str] = MappingProxyType(_FAMILIES)


def register_family(model_type: str, module: str) -> None:
    """Serve checkpoints of ``model_type`` with the ``FAMILY`` of ``module`` (imported
    when such a checkpoint loads). A ``model_type`` already registered is a
    ``ValueError``, as vLLM refuses to re-register a connector name: a plugin cannot
    silently replace a family."""
    if not model_type or not module:
        raise ValueError("register_family needs a model_type and a module name")
    if model_type in _FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} is already registered (by {_FAMILIES[model_type]})"
        )
    _FAMILIES[model_type] = module


class UnsupportedModelError(ModelLoadError):
    """A checkpoint whose ``architectures`` / ``model_type`` no family serves."""


@dataclass(frozen=True, slots=True)
class PositionSpec:
    """How a family's language model positions tokens.

    ``kind`` is ``"mrope"`` (three position rows: temporal, height, width; the
    rotary frequencies split into ``mrope_section``) or ``"rope"`` (one position
    per token; the runner's ``[3, T]`` positions then carry three equal rows).
    ``interleaved`` M-RoPE assigns frequencies to the three rows round-robin
    instead of in contiguous sections. ``time_interval`` multiplies the temporal
    index of an item's frames (Qwen2.5-VL's ``tokens_per_second`` for videos);
    a still image has one frame, so it never changes an image's positions.
    """

    kind: Literal["mrope", "rope"]
    mrope_section: tuple[int, int, int] | None = None
    interleaved: bool = False
    time_interval: float = 1.0

    @property
    def uses_mrope_delta(self) -> bool:
        """Whether decode positions are offset from token indices (then the KV wire
        carries ``mrope_position_delta`` from prefill to decode)."""
        return self.kind == "mrope"


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """What the loader, the processor and the engine need to know about a family.

    ``vision_tower`` is ``"module:Class"`` of the vision module (built from
    ``config.vision_config``, called as ``tower(pixel_values, grid_thw=...)`` and
    returning the projected per-token features as ``pooler_output``).
    ``weight_prefixes`` maps checkpoint names to parts: ``(prefix, part, inner
    prefix)``, first match wins. ``text_config`` reads the language model's shape,
    ``positions`` the position scheme, from the checkpoint config. A family whose
    tower is more than one ``transformers`` module gives ``vision_builder`` (the
    whole config -> the vision part) and its own ``model_class`` (``"module:Class"``
    of the :class:`~ec_frontend.model.interface.VisionLanguageModel`);
    ``merge_size`` reads how many patches per side one placeholder token merges
    (default: ``vision_config.spatial_merge_size``). ``language_model`` is
    ``"module:Class"`` of the paged decoder, built from what ``text_config`` returns
    (default: the Qwen2 decoder). ``image_tokens`` counts an image's placeholder
    tokens from its grid where that is not ``t * h * w / merge**2`` (anyres tiling).
    ``input_processor`` is ``"module:Class"`` of the input processor, for a family whose
    images depend on their prompt (LLaVA-OneVision). ``video_rule`` is ``"module:Class"``
    of the family's video preprocessing (a class with ``from_checkpoint(directory,
    image_processor)``); ``None``: the family serves no video (video parts are a 400).
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    vision_tower: str
    weight_prefixes: tuple[tuple[str, str, str], ...]
    text_config: Callable[[PretrainedConfig], TextShape]
    positions: Callable[[PretrainedConfig], PositionSpec]
    vision_builder: Callable[[PretrainedConfig], nn.Module] | None = None
    model_class: str = "ec_frontend.model.qwen2_vl:Qwen2VLModel"
    merge_size: Callable[[PretrainedConfig], int] | None = None
    language_model: str = "ec_frontend.model.qwen2_text:Qwen2TextModel"
    image_tokens: Callable[[PretrainedConfig, tuple[int, int, int]], int] | None = None
    input_processor: str = "ec_frontend.model.processor:InputProcessor"
    video_rule: str | None = None

    def build_vision(self, config: PretrainedConfig) -> nn.Module:
        """The vision part, built from the checkpoint config (float32 buffers)."""
        if self.vision_builder is not None:
            return self.vision_builder(config)
        import torch

        tower: nn.Module = _import(self.vision_tower)._from_config(
            config.vision_config, dtype=torch.float32
        )
        return tower

    def build_language(self, text_config: TextShape) -> Qwen2TextModel:
        """The paged decoder of the family for ``text_config`` (from :attr:`text_config`)."""
        decoder: type[Qwen2TextModel] = _import(self.language_model)
        return decoder(text_config)

    def model_type(self) -> type[Qwen2VLModel]:
        model_class: type[Qwen2VLModel] = _import(self.model_class)
        return model_class

    def processor_type(self) -> type[InputProcessor]:
        """The :class:`~ec_frontend.model.processor.InputProcessor` class of the family."""
        processor: type[InputProcessor] = _import(self.input_processor)
        return processor

    def load_video_rule(self, directory: Path, image_processor: Any) -> Any:
        """The family's video preprocessing for a checkpoint, ``None`` without one."""
        if self.video_rule is None:
            return None
        return _import(self.video_rule).from_checkpoint(directory, image_processor)

    def spatial_merge_size(self, config: PretrainedConfig) -> int:
        if self.merge_size is not None:
            return self.merge_size(config)
        return int(config.vision_config.spatial_merge_size)

    def num_image_tokens(self, config: PretrainedConfig, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens (= encoder output rows) of an image with patch grid ``grid_thw``."""
        if self.image_tokens is not None:
            return self.image_tokens(config, grid_thw)
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size(config) ** 2

    def weight_part(self, name: str) -> tuple[str, str] | None:
        """``(part, name inside the part)`` of a checkpoint tensor, ``None`` if no part has it."""
        for prefix, part, inner in self.weight_prefixes:
            if name.startswith(prefix):
                return part, inner + name[len(prefix) :]
        return None


def supported_model_types() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family_for(config: PretrainedConfig | Mapping[str, Any]) -> ModelFamily:
    """The family of a checkpoint config: its ``model_type``, or its ``architectures``
    when it has no ``model_type``. Raises :class:`UnsupportedModelError` naming both
    and the supported families."""
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    model_type = get("model_type")
    architectures = list(get("architectures") or ())
    module = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if module is None:
        if model_type is None:
            for candidate in FAMILIES.values():
                family = _load(candidate)
                if any(a in family.architectures for a in architectures):
                    return family
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} (architectures {architectures}); "
            f"supported: {', '.join(f'{t} ({_load(m).name})' for t, m in FAMILIES.items())}"
        )
    return _load(module)


def _import(target: str) -> Any:
    """The object ``"module:attr"`` names (its type is the caller's to declare)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _load(module: str) -> ModelFamily:
    family = importlib.import_module(module).FAMILY
    if not isinstance(family, ModelFamily):
        raise TypeError(f"{module}.FAMILY is a {type(family).__name__}, not a ModelFamily")
    return family
