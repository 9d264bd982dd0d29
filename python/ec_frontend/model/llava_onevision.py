"""LLaVA-OneVision: a SigLIP tower and the LLaVA projector over anyres tiles, a Qwen2
decoder on the paged KV cache (q/k/v biases, 1-D RoPE).

How an image is encoded depends on its prompt, as in ``transformers``
(``batch_num_images``):

* **alone** in its prompt, it is tiled as LLaVA-NeXT tiles (base tile, then the
  tiles of the best of ``image_grid_pinpoints``, their feature map unpadded); a
  map larger than ``anyres_max_N`` tiles (``vision_aspect_ratio``) is shrunk
  bilinearly by ``ratio = sqrt(rows * cols / (N * n * n))`` when ``ratio > 1.1``;
  then ``image_newline`` closes each row. Its grid is ``(1, height, width)`` in
  pixels (the original size: the placeholder count follows from it);
* **one of several** images of a prompt, it is padded to a square (with the mean
  colour), resized to one tile, and gives that tile's ``n * n`` features and one
  ``image_newline``. Its grid is ``(2, height, width)``: ``2`` marks this mode.

The two encodings of the same picture are different encoder outputs, so they must
be different items everywhere an item is keyed by ``mm_hash`` (the encoder cache,
the EC connectors, ``ec_transfer_params``, prefix-cache keys): the input processor
folds the mode into the ``mm_hash`` of an image that is one of several
(:func:`several_images_hash`). Every instance decides the mode from its own
request: an image part of a chat with more than one image part is one of several.
The proxy sends an encoder such an item twice in one chat (the same ``uuid``, one
encoding), so the encoder picks the mode prefill and decode will pick, and
prefill and decode check the mode an ``image_embeds`` reference's grid carries
against their prompt.

A **video** (``video_processor.LlavaOnevisionVideoRule``) is one item of grid
``(3, frames, 1)``: each frame resized to one tile goes through the tower and the
projector alone, its ``n * n`` features are pooled bilinearly to ``ceil(n / 2)``
a side (transformers' ``apply_pooling``), the frames' features follow each other,
and one ``image_newline`` closes the video: ``frames * ceil(n / 2)**2 + 1``
``<video>`` tokens. Its encoding does not depend on the prompt, so it keeps the
video's own ``mm_hash``. Its encoder publishes ``video_grid_thw = (frames, height,
width)`` (the tile in pixels), from which prefill and decode size a ``video_embeds``
reference's placeholder without the video.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ec_frontend.model.errors import InputError, ModelLoadError
from ec_frontend.model.llava import LlavaVisionTower
from ec_frontend.model.llava_next import FAMILY as LLAVA_NEXT
from ec_frontend.model.llava_next import LlavaNextVisionTower, unpadded_feature_map
from ec_frontend.model.media import decode_image
from ec_frontend.model.native_preprocess import DeferredImage, count_preprocessed
from ec_frontend.model.processor import InputProcessor, MediaLike, MultiModalFeature
from ec_frontend.model.qwen2_text import TextModelConfig, decoder_config
from ec_frontend.model.qwen2_vl import Qwen2VLModel
from ec_frontend.model.registry import ModelFamily, PositionSpec
from ec_frontend.model.video_processor import ONEVISION_VIDEO

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: The grid's first entry of an image encoded alone (anyres tiles).
ALONE = 1
#: The grid's first entry of an image that is one of several in its prompt (one tile).
ONE_OF_SEVERAL = 2
#: The grid's first entry of a video (``(VIDEO, frames, 1)``).
VIDEO = ONEVISION_VIDEO


def several_images_hash(mm_hash: str) -> str:
    """The item key of an image encoded as one of several (the alone encoding keeps
    the image's own ``mm_hash``). Lower-case hex, as every ``mm_hash``."""
    return hashlib.sha256(b"llava_onevision/one-of-several/" + mm_hash.encode()).hexdigest()


def max_tiles(config: PretrainedConfig) -> int:
    """``N`` of ``vision_aspect_ratio = "anyres_max_N"``."""
    value = str(config.vision_aspect_ratio)
    digits = value.removeprefix("anyres_max_")
    if digits == value or not digits.isdigit() or int(digits) <= 0:
        raise ModelLoadError(
            f"LLaVA-OneVision: unsupported vision_aspect_ratio {value!r} (expected anyres_max_N)"
        )
    return int(digits)


def _pooled(rows: int, cols: int, n: int, most: int) -> tuple[int, int]:
    """The feature map's shape after the ``anyres_max`` shrink (unchanged when small)."""
    ratio = math.sqrt(rows * cols / (most * n * n))
    if ratio > 1.1:
        return int(rows // ratio), int(cols // ratio)
    return rows, cols


def image_tokens(config: PretrainedConfig, grid_thw: tuple[int, int, int]) -> int:
    """Placeholder tokens (= encoder output rows) of an image of grid ``(mode, height,
    width)`` or of a video of grid ``(VIDEO, frames, 1)``; :class:`InputError` for a
    mode that is none of them."""
    mode, height, width = grid_thw
    n = int(config.vision_config.image_size) // int(config.vision_config.patch_size)
    if mode == ONE_OF_SEVERAL:
        return n * n + 1
    if mode == VIDEO:
        return height * math.ceil(n / 2) ** 2 + 1
    if mode != ALONE:
        raise InputError(
            f"grid {list(grid_thw)}: a LLaVA-OneVision image grid starts with {ALONE} (an "
            f"image alone in its prompt) or {ONE_OF_SEVERAL} (one of several), a video "
            f"grid with {VIDEO}",
            code="invalid_features",
        )
    rows, cols = _pooled(*unpadded_feature_map(config, height, width), n, max_tiles(config))
    return n * n + rows * cols + rows


def qwen2_text_config(config: PretrainedConfig) -> TextModelConfig:
    """The Qwen2 decoder of a LLaVA-OneVision config (q/k/v biases, 1-D RoPE)."""
    text = config.text_config
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ModelLoadError(
            f"LLaVA-OneVision: rope_type {rope.get('rope_type')!r} is not supported"
        )
    if getattr(text, "use_sliding_window", False):
        raise ModelLoadError("LLaVA-OneVision: sliding-window attention is not supported")
    head_dim = text.hidden_size // text.num_attention_heads
    if getattr(text, "head_dim", head_dim) not in (None, head_dim):
        raise ModelLoadError(
            "LLaVA-OneVision: head_dim other than hidden_size / heads is not supported"
        )
    return decoder_config(
        config,
        rope_theta=float(rope.get("rope_theta", 1_000_000.0)),
        mrope_section=(head_dim // 2, 0, 0),
        attention_bias=True,
    )


class LlavaOnevisionVisionTower(LlavaNextVisionTower):
    """SigLIP + projector per tile (all tokens: the ``full`` strategy), then per image
    the anyres layout with the ``anyres_max`` shrink, or one tile and one newline;
    per video each frame's features pooled 2x2 bilinearly, then one newline.
    ``forward(tiles, sizes, tiles per item, modes)`` gives one ``[tokens, hidden]``
    tensor per item (a video's tiles are its frames)."""

    def __init__(self, config: Any) -> None:
        if config.vision_feature_select_strategy != "full":
            raise ModelLoadError(
                "LLaVA-OneVision: only the 'full' vision_feature_select_strategy is supported"
            )
        LlavaVisionTower.__init__(self, config)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))
        self.tile_size = int(config.vision_config.image_size)
        self.tokens_per_side = self.tile_size // int(config.vision_config.patch_size)
        self.pinpoints = [(int(h), int(w)) for h, w in config.image_grid_pinpoints]
        self.max_tiles = max_tiles(config)

    def forward(  # type: ignore[override]
        self,
        pixel_values: torch.Tensor,
        sizes: list[tuple[int, int]],
        tiles: list[int],
        modes: list[int],
    ) -> list[torch.Tensor]:
        features = LlavaVisionTower.forward(self, pixel_values)
        out = []
        for f, size, mode in zip(torch.split(features, tiles), sizes, modes, strict=True):
            if mode == ONE_OF_SEVERAL:
                out.append(torch.cat((f[0], self.image_newline[None].to(f.dtype))))
            elif mode == VIDEO:
                frames = self._pool_frames(f).flatten(0, 1)
                out.append(torch.cat((frames, self.image_newline[None].to(f.dtype))))
            else:
                out.append(self._pack(f, size))
        return out

    def _pool_frames(self, features: torch.Tensor) -> torch.Tensor:
        """``[frames, n * n, dim]`` -> ``[frames, ceil(n / 2)**2, dim]``: each frame's
        feature map halved (rounded up) bilinearly, as transformers' ``apply_pooling``."""
        frames, _, dim = features.shape
        n = self.tokens_per_side
        maps = features.view(frames, n, n, dim).permute(0, 3, 1, 2)
        half = math.ceil(n / 2)
        pooled = nn.functional.interpolate(maps, size=[half, half], mode="bilinear")
        return pooled.permute(0, 2, 3, 1).reshape(frames, half * half, dim)

    def _pool(self, grid: torch.Tensor) -> torch.Tensor:
        _, rows, cols = grid.shape
        pooled = _pooled(rows, cols, self.tokens_per_side, self.max_tiles)
        if pooled == (rows, cols):
            return grid
        return nn.functional.interpolate(grid[None], list(pooled), mode="bilinear")[0]


class LlavaOnevisionModel(Qwen2VLModel):
    """A loaded LLaVA-OneVision checkpoint; image grids are ``(mode, height, width)``,
    video grids ``(VIDEO, frames, 1)``."""

    @torch.no_grad()
    def encode_images(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> list[torch.Tensor]:
        vision: LlavaOnevisionVisionTower = self._vision()  # type: ignore[assignment]
        grid = image_grid_thw.to(dtype=torch.int64, device="cpu")
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or bool((grid <= 0).any()):
            raise ValueError(f"image_grid_thw must be [num_images, 3] of positive ints, got {grid}")
        modes = [int(m) for m in grid[:, 0]]
        if any(m not in (ALONE, ONE_OF_SEVERAL, VIDEO) for m in modes):
            raise ValueError(
                f"grids start with {ALONE} or {ONE_OF_SEVERAL} (images) or {VIDEO} (videos), "
                f"got {grid}"
            )
        sizes = [(int(h), int(w)) for _, h, w in grid.tolist()]
        tiles = [
            1 if mode == ONE_OF_SEVERAL else h if mode == VIDEO else vision.num_tiles(h, w)
            for mode, (h, w) in zip(modes, sizes, strict=True)
        ]
        if pixel_values.ndim != 4 or pixel_values.shape[0] != sum(tiles):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}; the images' grids make "
                f"{sum(tiles)} tiles"
            )
        features: list[torch.Tensor] = vision(
            pixel_values.to(device=self.device, dtype=self.dtype), sizes, tiles, modes
        )
        return features


class LlavaOnevisionInputProcessor(InputProcessor):
    """The input processor with LLaVA-OneVision's two image modes: an image alone in its
    prompt goes through the image processor alone (anyres tiles, the item's own
    ``mm_hash``); the images of a prompt with several go through it together (one
    square tile each, as ``transformers`` processes a sample's images) and get the
    mode's item key (:func:`several_images_hash`). A video is one item of its frames
    (``video_processor.LlavaOnevisionVideoRule``) with ``frames * ceil(n / 2)**2 + 1``
    ``<video>`` tokens; images beside it keep their mode (a video is not an image)."""

    def _processor_size(self, kwargs: Any) -> dict[str, int] | None:
        if kwargs:
            raise InputError(
                "mm_processor_kwargs are not supported by LLaVA-OneVision (its tiles have "
                "a fixed size)",
                code="invalid_processor_kwargs",
            )
        return None

    def _images(
        self, media: Sequence[MediaLike], order: Sequence[int], size: dict[str, int] | None
    ) -> list[tuple[str, tuple[int, int, int], torch.Tensor | None, DeferredImage | None]]:
        if len(order) < 2:
            return super()._images(media, order, size)
        return self._several(media, order)

    def _video_item_rows(self, grid: tuple[int, int, int]) -> int:
        return self.image_tokens(grid)

    def _place_video(
        self,
        video: Any,
        token: int,
        out_ids: list[int],
        features: list[MultiModalFeature],
        time_intervals: dict[int, float],
    ) -> None:
        length = self.image_tokens(video.grid)
        feature = MultiModalFeature(
            video.mm_hash, len(out_ids), length, video.grid, video.pixels, modality="video"
        )
        feature.reference_grid = self.video_rule.reference_grid(video.grid[1])
        features.append(feature)
        out_ids.extend([token] * length)

    def _reference_video_grid(
        self, grid: Sequence[int], index: int, size: dict[str, int] | None
    ) -> tuple[int, int, int]:
        """A ``video_embeds`` reference's ``(frames, height, width)`` (checked by the
        video rule: at most ``--max-video-frames`` frames of this model's tile) as the
        item's grid ``(VIDEO, frames, 1)``, which sizes its placeholder."""
        checked = super()._reference_video_grid(grid, index, size)
        item: tuple[int, int, int] = self.video_rule.item_grid(checked)
        return item

    def _reference_grid(
        self, grid: Sequence[int], index: int, size: dict[str, int] | None
    ) -> tuple[int, int, int]:
        """An ``image_embeds`` reference of an image alone in its prompt."""
        _check_mode(grid, index, 1)
        return super()._reference_grid(grid, index, size)

    def _several(
        self, media: Sequence[MediaLike], order: Sequence[int]
    ) -> list[tuple[str, tuple[int, int, int], torch.Tensor | None, DeferredImage | None]]:
        """The images of a prompt with several, through the image processor in one call
        (each distinct image once, however often the prompt shows it)."""
        first: dict[str, int] = {}
        for i in order:
            if getattr(media[i], "image_grid_thw", None) is None:
                first.setdefault(media[i].mm_hash, i)
        decoded = [
            decode_image(
                media[i].data,
                index=i,
                max_pixels=self.max_image_pixels,
                formats=self.image_formats,
            )
            for i in first.values()
        ]
        pixels: dict[str, tuple[tuple[int, int, int], torch.Tensor]] = {}
        if decoded:
            # A nested list is one sample: with two images or more, transformers' mode of
            # several images (each image on its own: one shown twice is processed twice).
            sample = decoded * 2 if len(decoded) == 1 else decoded
            try:
                processed = self.image_processor(images=[sample], return_tensors="pt")
            except ValueError as exc:
                raise InputError(
                    f"images {list(first.values())} cannot be processed: {exc}",
                    code="invalid_image",
                ) from exc
            finally:
                for image in decoded:
                    image.close()
            count_preprocessed(len(decoded))
            values = processed["pixel_values"].to(torch.float32)
            sizes = processed["image_sizes"].tolist()[: len(decoded)]
            for k, (mm_hash, (h, w)) in enumerate(zip(first, sizes, strict=True)):
                pixels[mm_hash] = (ONE_OF_SEVERAL, int(h), int(w)), values[k, :1]
        out: list[tuple[str, tuple[int, int, int], torch.Tensor | None, DeferredImage | None]] = []
        for i in order:
            item = media[i]
            reference = getattr(item, "image_grid_thw", None)
            if reference is not None:
                grid = _check_mode(reference, i, len(order))
                out.append((several_images_hash(item.mm_hash), grid, None, None))
            else:
                grid, tile = pixels[item.mm_hash]
                out.append((several_images_hash(item.mm_hash), grid, tile, None))
        return out


def _check_mode(grid: Sequence[int], index: int, num_images: int) -> tuple[int, int, int]:
    """The grid of an ``image_embeds`` reference, if its mode is the one of a prompt
    with ``num_images`` images (the encoder encoded it for such a prompt)."""
    t, h, w = (int(v) for v in grid)
    want = ALONE if num_images < 2 else ONE_OF_SEVERAL
    if t != want:
        encoded = {ALONE: "alone", ONE_OF_SEVERAL: "one of several"}.get(t, "in no known mode")
        raise InputError(
            f"image {index}: image_embeds.image_grid_thw {[t, h, w]} is the encoding of an "
            f"image {encoded} in its prompt, but this prompt has {num_images} image(s)",
            code="invalid_image_embeds",
        )
    return t, h, w


FAMILY = ModelFamily(
    name="LLaVA-OneVision",
    model_types=("llava_onevision",),
    architectures=("LlavaOnevisionForConditionalGeneration",),
    vision_tower="ec_frontend.model.llava_onevision:LlavaOnevisionVisionTower",
    # LLaVA-NeXT's names (transformers 5 and Hub layouts).
    weight_prefixes=LLAVA_NEXT.weight_prefixes,
    text_config=qwen2_text_config,
    positions=lambda config: PositionSpec("rope"),
    vision_builder=LlavaOnevisionVisionTower,
    model_class="ec_frontend.model.llava_onevision:LlavaOnevisionModel",
    merge_size=lambda config: 1,
    image_tokens=image_tokens,
    input_processor="ec_frontend.model.llava_onevision:LlavaOnevisionInputProcessor",
    video_rule="ec_frontend.model.video_processor:LlavaOnevisionVideoRule",
)
