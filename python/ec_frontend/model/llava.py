"""LLaVA-1.5: ``transformers``' CLIP vision tower and LLaVA projector, and a Llama
decoder on the paged KV cache (our :class:`~ec_frontend.model.qwen2_text.Qwen2TextModel`
without q/k/v biases, under 1-D RoPE).

An image is resized and center-cropped to the tower's fixed size, so it always
takes ``(image_size / patch_size) ** 2`` placeholder tokens (the CLS token is
dropped under the ``default`` feature strategy); its grid is ``(1, h, w)`` in
patches with a merge size of 1. Features come from hidden layer
``vision_feature_layer`` of the tower, then the two-layer projector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ec_frontend.model.errors import ModelLoadError
from ec_frontend.model.qwen2_text import TextModelConfig, decoder_config
from ec_frontend.model.qwen2_vl import Qwen2VLModel
from ec_frontend.model.registry import ModelFamily, PositionSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LlavaVisionTower(nn.Module):
    """CLIP vision model + LLaVA projector; ``forward(pixels [N, 3, H, W])`` gives
    ``[N, tokens, text hidden]``. Parameter names follow the checkpoint
    (``vision_tower.*``, ``multi_modal_projector.*``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        if not isinstance(config.vision_feature_layer, int):
            raise ModelLoadError("LLaVA: only a single vision_feature_layer is supported")
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ModelLoadError(
                f"LLaVA: unsupported vision_feature_select_strategy "
                f"{config.vision_feature_select_strategy!r}"
            )
        self.vision_tower = AutoModel.from_config(config.vision_config, dtype=torch.float32)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.feature_layer = int(config.vision_feature_layer)
        self.drop_cls = config.vision_feature_select_strategy == "default"

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        features = out.hidden_states[self.feature_layer]
        if self.drop_cls:
            features = features[:, 1:]
        projected: torch.Tensor = self.multi_modal_projector(features)
        return projected


class LlavaModel(Qwen2VLModel):
    """A loaded LLaVA checkpoint: :class:`Qwen2VLModel`'s language side, its own tower."""

    @torch.no_grad()
    def encode_images(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> list[torch.Tensor]:
        vision = self._vision()
        grid = image_grid_thw.to(dtype=torch.int64, device="cpu")
        if pixel_values.ndim != 4 or grid.ndim != 2 or grid.shape != (pixel_values.shape[0], 3):
            raise ValueError(
                f"pixel_values must be [num_images, 3, H, W] with one grid row each, got "
                f"{tuple(pixel_values.shape)} and grids {tuple(grid.shape)}"
            )
        out = vision(pixel_values.to(device=self.device, dtype=self.dtype))
        if out.shape[1] != int(grid[0].prod()) or bool((grid.prod(-1) != out.shape[1]).any()):
            raise ValueError(f"the tower gives {out.shape[1]} tokens per image, grids say {grid}")
        return list(out)


def llama_text_config(config: PretrainedConfig) -> TextModelConfig:
    """The Llama decoder of a LLaVA config; :class:`ModelLoadError` for what it cannot run."""
    text = config.text_config
    rope = dict(text.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise ModelLoadError(f"LLaVA: rope_type {rope.get('rope_type')!r} is not supported")
    if getattr(text, "mlp_bias", False):
        raise ModelLoadError("LLaVA: mlp_bias is not supported")
    head_dim = text.hidden_size // text.num_attention_heads
    if getattr(text, "head_dim", head_dim) not in (None, head_dim):
        raise ModelLoadError("LLaVA: head_dim other than hidden_size / heads is not supported")
    return decoder_config(
        config,
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        # One rotary row over every frequency: with three equal position rows, 1-D RoPE.
        mrope_section=(head_dim // 2, 0, 0),
        attention_bias=bool(getattr(text, "attention_bias", False)),
    )


FAMILY = ModelFamily(
    name="LLaVA-1.5",
    model_types=("llava",),
    architectures=("LlavaForConditionalGeneration",),
    vision_tower="ec_frontend.model.llava:LlavaVisionTower",
    # transformers 5 layout, then the Hub (llava-hf) layout.
    weight_prefixes=(
        ("model.vision_tower.", "vision", "vision_tower."),
        ("model.multi_modal_projector.", "vision", "multi_modal_projector."),
        ("model.language_model.", "language", ""),
        ("vision_tower.", "vision", "vision_tower."),
        ("multi_modal_projector.", "vision", "multi_modal_projector."),
        ("language_model.model.", "language", ""),
        ("language_model.lm_head.", "language", "lm_head."),
        ("lm_head.", "language", "lm_head."),
    ),
    text_config=llama_text_config,
    positions=lambda config: PositionSpec("rope"),
    vision_builder=LlavaVisionTower,
    model_class="ec_frontend.model.llava:LlavaModel",
    merge_size=lambda config: 1,
)
