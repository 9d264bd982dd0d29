"""LLaVA-NeXT: anyres tiling over LLaVA-1.5's CLIP tower and projector, a Llama decoder
on the paged KV cache (as :mod:`ec_frontend.model.llava`, 1-D RoPE).

An image is resized to the best of ``image_grid_pinpoints`` for its aspect ratio
(``select_best_resolution``), padded, and cut into ``rows x cols`` tiles of the
tower's ``image_size``; a base tile (the whole image, resized) comes first. Each
tile gives ``n x n`` features (``n = image_size / patch_size``). The item's
encoder output is the base tile's ``n * n`` rows, then the tiles' features laid
out as one ``rows * n`` by ``cols * n`` map with the padding rows or columns cut
off again (``unpad_image``), row by row, each row followed by the checkpoint's
``image_newline`` vector. Its placeholder count thus depends on the original
image size, which is what the item's grid carries: ``(1, height, width)`` in
pixels (merge size 1), in ``ec_transfer_params`` and ``image_embeds`` references too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ec_frontend.model.errors import ModelLoadError
from ec_frontend.model.llava import LlavaVisionTower, llama_text_config
from ec_frontend.model.qwen2_vl import Qwen2VLModel
from ec_frontend.model.registry import ModelFamily, PositionSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _pinpoints(config: PretrainedConfig) -> list[tuple[int, int]]:
    return [(int(h), int(w)) for h, w in config.image_grid_pinpoints]


def anyres_image_tokens(config: PretrainedConfig, grid_thw: tuple[int, int, int]) -> int:
    """Placeholder tokens of an image of ``grid_thw = (1, height, width)`` pixels: the
    base tile, the unpadded tile map and one newline per row of it."""
    _, height, width = grid_thw
    n = int(config.vision_config.image_size) // int(config.vision_config.patch_size)
    rows, cols = unpadded_feature_map(config, height, width)
    return n * n + rows * cols + rows


def unpadded_feature_map(config: PretrainedConfig, height: int, width: int) -> tuple[int, int]:
    """``(rows, cols)`` of the tiles' feature map of an image of this size once its
    padding is cut off (``unpad_image``)."""
    from transformers.image_processing_utils import select_best_resolution

    size = int(config.vision_config.image_size)
    n = size // int(config.vision_config.patch_size)
    best_h, best_w = select_best_resolution((height, width), _pinpoints(config))
    rows, cols = n * (best_h // size), n * (best_w // size)
    if width / height > cols / rows:
        kept = int(round(height * (cols / width), 7))
        rows -= (rows - kept) // 2 * 2
    else:
        kept = int(round(width * (rows / height), 7))
        cols -= (cols - kept) // 2 * 2
    return rows, cols


class LlavaNextVisionTower(LlavaVisionTower):
    """LLaVA-1.5's tower and projector per tile, then the anyres layout and newlines.
    ``forward(tiles [sum of tiles, 3, S, S], sizes [(h, w), ...])`` gives one
    ``[tokens, text hidden]`` tensor per image."""

    def __init__(self, config: Any) -> None:
        if config.vision_feature_select_strategy != "default":
            raise ModelLoadError(
                "LLaVA-NeXT: only the 'default' vision_feature_select_strategy is supported"
            )
        super().__init__(config)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))
        self.tile_size = int(config.vision_config.image_size)
        self.tokens_per_side = self.tile_size // int(config.vision_config.patch_size)
        self.pinpoints = _pinpoints(config)

    def num_tiles(self, height: int, width: int) -> int:
        """Tiles (with the base tile) the image processor cuts an image of this size into."""
        from transformers.image_processing_utils import select_best_resolution

        best_h, best_w = select_best_resolution((height, width), self.pinpoints)
        tiles: int = (best_h // self.tile_size) * (best_w // self.tile_size) + 1
        return tiles

    def forward(  # type: ignore[override]
        self, pixel_values: torch.Tensor, sizes: list[tuple[int, int]], tiles: list[int]
    ) -> list[torch.Tensor]:
        features = super().forward(pixel_values)
        return [
            self._pack(f, size) for f, size in zip(torch.split(features, tiles), sizes, strict=True)
        ]

    def _pack(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        from transformers.models.llava_next.modeling_llava_next import (
            get_anyres_image_grid_shape,
            unpad_image,
        )

        n = self.tokens_per_side
        rows, cols = get_anyres_image_grid_shape(list(size), self.pinpoints, self.tile_size)
        dim = features.shape[-1]
        grid = features[1:].view(rows, cols, n, n, dim).permute(4, 0, 2, 1, 3)
        grid = self._pool(unpad_image(grid.flatten(1, 2).flatten(2, 3), list(size)))
        newline = self.image_newline.to(grid.dtype)[:, None, None].expand(dim, grid.shape[1], 1)
        grid = torch.cat((grid, newline), dim=-1)
        return torch.cat((features[0], grid.flatten(1, 2).transpose(0, 1)))

    def _pool(self, grid: torch.Tensor) -> torch.Tensor:
        """The unpadded feature map ``[dim, rows, cols]`` as the decoder takes it (here:
        as it is; LLaVA-OneVision shrinks a large one)."""
        return grid


class LlavaNextModel(Qwen2VLModel):
    """A loaded LLaVA-NeXT checkpoint; image grids are ``(1, height, width)`` in pixels."""

    @torch.no_grad()
    def encode_images(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> list[torch.Tensor]:
        vision: LlavaNextVisionTower = self._vision()  # type: ignore[assignment]
        grid = image_grid_thw.to(dtype=torch.int64, device="cpu")
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or bool((grid <= 0).any()):
            raise ValueError(f"image_grid_thw must be [num_images, 3] of positive ints, got {grid}")
        sizes = [(int(h), int(w)) for _, h, w in grid.tolist()]
        tiles = [vision.num_tiles(h, w) for h, w in sizes]
        if pixel_values.ndim != 4 or pixel_values.shape[0] != sum(tiles):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}; the images' sizes make "
                f"{sum(tiles)} tiles"
            )
        features: list[torch.Tensor] = vision(
            pixel_values.to(device=self.device, dtype=self.dtype), sizes, tiles
        )
        return features


FAMILY = ModelFamily(
    name="LLaVA-NeXT",
    model_types=("llava_next",),
    architectures=("LlavaNextForConditionalGeneration",),
    vision_tower="ec_frontend.model.llava_next:LlavaNextVisionTower",
    # transformers 5 layout, then the Hub (llava-hf) layout.
    weight_prefixes=(
        ("model.vision_tower.", "vision", "vision_tower."),
        ("model.multi_modal_projector.", "vision", "multi_modal_projector."),
        ("model.image_newline", "vision", "image_newline"),
        ("model.language_model.", "language", ""),
        ("vision_tower.", "vision", "vision_tower."),
        ("multi_modal_projector.", "vision", "multi_modal_projector."),
        ("image_newline", "vision", "image_newline"),
        ("language_model.model.", "language", ""),
        ("language_model.lm_head.", "language", "lm_head."),
        ("lm_head.", "language", "lm_head."),
    ),
    text_config=llama_text_config,
    positions=lambda config: PositionSpec("rope"),
    vision_builder=LlavaNextVisionTower,
    model_class="ec_frontend.model.llava_next:LlavaNextModel",
    merge_size=lambda config: 1,
    image_tokens=anyres_image_tokens,
)
