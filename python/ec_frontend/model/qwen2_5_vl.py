"""Qwen2.5-VL: the window-attention vision tower of ``transformers`` and the
Qwen2 decoder on the paged KV cache (:class:`~ec_frontend.model.qwen2_vl.Qwen2VLModel`).

Its M-RoPE is Qwen2-VL's, except that the temporal index of a video's frames is
scaled by ``vision_config.tokens_per_second`` (the ``time_interval`` of its
:class:`~ec_frontend.model.registry.PositionSpec`); an image has one frame, so
image positions are Qwen2-VL's. A video's interval is ``tokens_per_second``
times its ``second_per_grid_t`` (:class:`~ec_frontend.model.video_processor.Qwen25VideoRule`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_frontend.model.qwen2_text import qwen2_text_config
from ec_frontend.model.qwen2_vl import QWEN_VL_WEIGHT_PREFIXES
from ec_frontend.model.registry import ModelFamily, PositionSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def positions(config: PretrainedConfig) -> PositionSpec:
    section = qwen2_text_config(config).mrope_section
    interval = float(getattr(config.vision_config, "tokens_per_second", 1) or 1)
    return PositionSpec("mrope", section, time_interval=interval)


FAMILY = ModelFamily(
    name="Qwen2.5-VL",
    model_types=("qwen2_5_vl",),
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    vision_tower="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:"
    "Qwen2_5_VisionTransformerPretrainedModel",
    weight_prefixes=QWEN_VL_WEIGHT_PREFIXES,
    text_config=qwen2_text_config,
    positions=positions,
    video_rule="ec_frontend.model.video_processor:Qwen25VideoRule",
)
