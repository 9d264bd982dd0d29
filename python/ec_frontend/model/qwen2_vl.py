"""Qwen2-VL as a :class:`VisionLanguageModel`: vision tower + paged language model.

The vision tower is :class:`~ec_frontend.model.qwen2_vl_vision.Qwen2VisionTower`
(``transformers``' Qwen2-VL vision transformer for a config it does not cover),
holding the checkpoint's weights; the language model is :class:`Qwen2TextModel`, which runs
on the runner's paged KV cache. :class:`Qwen2VLModel` serves every family built
the same way (a Qwen-style vision tower whose ``pooler_output`` holds the
merged tokens, a Qwen2 decoder): Qwen2.5-VL reuses it with its own tower.
Either part may be absent: an encoder-only instance loads no language model, a
prefill/decode instance may skip the vision tower; calling a missing part
raises :class:`ComponentNotLoadedError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ec_frontend.model.interface import AttentionMetadata, KVCacheSpec, VisionLanguageModel
from ec_frontend.model.qwen2_text import Qwen2TextModel, TextShape, qwen2_text_config
from ec_frontend.model.qwen2_vl_vision import build_vision
from ec_frontend.model.registry import ModelFamily, PositionSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: Checkpoint name prefixes of Qwen-VL families: the Hub layout (``visual.*``,
#: ``model.layers.*``) and the layout of ``transformers`` 5 (``model.visual.*``,
#: ``model.language_model.*``).
QWEN_VL_WEIGHT_PREFIXES = (
    ("model.visual.", "vision", ""),
    ("visual.", "vision", ""),
    ("model.language_model.", "language", ""),
    ("lm_head.", "language", "lm_head."),
    ("model.", "language", ""),
)


def qwen_mrope_positions(config: PretrainedConfig) -> PositionSpec:
    """Contiguous M-RoPE sections of a Qwen-VL text config."""
    return PositionSpec("mrope", qwen2_text_config(config).mrope_section)


FAMILY = ModelFamily(
    name="Qwen2-VL",
    model_types=("qwen2_vl",),
    architectures=("Qwen2VLForConditionalGeneration",),
    vision_tower="ec_frontend.model.qwen2_vl_vision:Qwen2VisionTower",
    weight_prefixes=QWEN_VL_WEIGHT_PREFIXES,
    text_config=qwen2_text_config,
    positions=qwen_mrope_positions,
    vision_builder=build_vision,
    video_rule="ec_frontend.model.video_processor:QwenVideoRule",
)


class ComponentNotLoadedError(RuntimeError):
    """A call needs the vision tower or the language model, which was not loaded."""


class Qwen2VLModel(VisionLanguageModel):
    """A loaded Qwen2-VL checkpoint. Built by :func:`ec_frontend.model.loader.load_model`."""

    def __init__(
        self,
        *,
        text_config: TextShape,
        image_token_id: int,
        spatial_merge_size: int,
        vision: nn.Module | None,
        language: Qwen2TextModel | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.text_config = text_config
        self.image_token_id = image_token_id
        self.vocab_size = text_config.vocab_size
        self.hidden_size = text_config.hidden_size
        self.spatial_merge_size = spatial_merge_size
        self.device = device
        self.dtype = dtype
        self.vision = vision
        self.language = language

    @property
    def has_vision(self) -> bool:
        return self.vision is not None

    @property
    def has_language(self) -> bool:
        return self.language is not None

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.text_config
        return KVCacheSpec(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
        )

    @torch.no_grad()
    def encode_images(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> list[torch.Tensor]:
        vision = self._vision()
        grid = image_grid_thw.to(dtype=torch.int64, device="cpu")
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or bool((grid <= 0).any()):
            raise ValueError(f"image_grid_thw must be [num_images, 3] of positive ints, got {grid}")
        merge = self.spatial_merge_size
        if bool((grid[:, 1:] % merge).any()):
            raise ValueError(f"image grid heights and widths must be multiples of {merge}")
        patches = grid.prod(-1)
        if pixel_values.ndim != 2 or pixel_values.shape[0] != int(patches.sum()):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, but the grids hold "
                f"{int(patches.sum())} patches"
            )
        out = vision(
            pixel_values.to(device=self.device, dtype=self.dtype),
            grid_thw=grid.to(self.device),
        )
        return list(torch.split(self._encoder_rows(out), (patches // merge**2).tolist()))

    def _encoder_rows(self, out: Any) -> torch.Tensor:
        """The ``[tokens, encoder_output_size]`` rows of all images from the tower's output
        (the rows themselves, or a ``transformers`` output holding them as ``pooler_output``)."""
        rows: torch.Tensor = out if isinstance(out, torch.Tensor) else out.pooler_output
        return rows

    @torch.no_grad()
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        language = self._language()
        # Ids already on an accelerator come from the engine, which checks them once
        # at admission; checking them here would wait for the device every step.
        if (
            input_ids.device.type == "cpu"
            and input_ids.numel()
            and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size)
        ):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        embeds = language.embed_tokens(input_ids.to(self.device))
        extra = self.encoder_output_size - embeds.shape[-1]
        return torch.nn.functional.pad(embeds, (0, extra)) if extra else embeds

    @torch.no_grad()
    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden: torch.Tensor = self._language()(inputs_embeds, positions, kv_caches, attn_metadata)
        return hidden

    def decode_graphs_supported(self) -> bool:
        # The triton backend reads each decode's context through its block table up to
        # its device-side length; the others size tensors from the host lengths.
        return self.language is not None and self.language.attention_backend == "triton"

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._language().logits(hidden_states)

    def _vision(self) -> nn.Module:
        if self.vision is None:
            raise ComponentNotLoadedError(
                "this instance was loaded without the vision tower (load_vision=False); "
                "image embeddings must come from an encoder instance"
            )
        return self.vision

    def _language(self) -> Qwen2TextModel:
        if self.language is None:
            raise ComponentNotLoadedError(
                "this instance was loaded without the language model (load_language=False)"
            )
        return self.language
