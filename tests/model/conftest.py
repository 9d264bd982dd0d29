"""Fixtures of the model-layer tests: the loaded built-in model, transformers'
reference model, test images and a small paged-KV driver."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from ec_frontend.model.interface import AttentionMetadata, VisionLanguageModel
from ec_frontend.model.loader import load_model, load_processor
from ec_frontend.model.processor import InputProcessor, ProcessedInputs
from ec_frontend.model.qwen2_vl import Qwen2VLModel
from PIL import Image
from transformers import Qwen2VLForConditionalGeneration


@dataclass(frozen=True, slots=True)
class Media:
    """Stands in for the native ``MediaItem``: the processor reads ``data`` and ``mm_hash``."""

    data: bytes | None
    mm_hash: str
    mime_type: str | None = "image/png"


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A deterministic noise image encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


class PagedDriver:
    """Drives a model step by step over a paged KV cache, like a minimal runner.

    Blocks are handed out in a shuffled order so block tables are not contiguous.
    """

    def __init__(self, model: VisionLanguageModel, *, block_size: int, num_blocks: int) -> None:
        spec = model.kv_cache_spec()
        self.model = model
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            for _ in range(spec.num_layers)
        ]
        gen = torch.Generator().manual_seed(7)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, batch: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """One forward over ``(request_id, embeds [n, H], positions [3, n])`` entries;
        returns each request's logits ``[n, vocab]``."""
        starts, seq_lens, query_lens, tables, slots = [0], [], [], [], []
        for rid, embeds, _ in batch:
            cached = self.lens.get(rid, 0)
            n = embeds.shape[0]
            total = cached + n
            blocks = self.blocks.setdefault(rid, [])
            while len(blocks) * self.block_size < total:
                blocks.append(self.free.pop())
            for pos in range(cached, total):
                slots.append(
                    blocks[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            self.lens[rid] = total
            starts.append(starts[-1] + n)
            seq_lens.append(total)
            query_lens.append(n)
            tables.append(list(blocks))
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            query_lens=torch.tensor(query_lens),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            slot_mapping=torch.tensor(slots),
            block_size=self.block_size,
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
        )
        embeds = torch.cat([e for _, e, _ in batch])
        positions = torch.cat([p for _, _, p in batch], dim=1)
        logits = self.model.compute_logits(
            self.model.forward(embeds, positions, self.kv_caches, meta)
        )
        return list(torch.split(logits, query_lens))


def prompt_embeds(model: VisionLanguageModel, inputs: ProcessedInputs) -> torch.Tensor:
    """Token embeddings of a processed prompt with its images' encoder outputs merged in."""
    embeds = model.embed_tokens(torch.tensor(inputs.prompt_token_ids))
    features = [f for f in inputs.mm_features if f.pixel_values is not None]
    if features:
        pixels = torch.cat([f.pixel_values for f in features])
        grids = torch.tensor([f.image_grid_thw for f in features])
        for feat, out in zip(features, model.encode_images(pixels, grids), strict=True):
            embeds[feat.offset : feat.offset + feat.length] = out
    return embeds


@pytest.fixture(scope="session")
def model(builtin_model_dir: Path) -> Qwen2VLModel:
    return load_model(builtin_model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def processor(builtin_model_dir: Path) -> InputProcessor:
    return load_processor(builtin_model_dir, model_id="builtin")


@pytest.fixture(scope="session")
def hf_model(builtin_model_dir: Path) -> Qwen2VLForConditionalGeneration:
    return Qwen2VLForConditionalGeneration.from_pretrained(
        builtin_model_dir, dtype=torch.float32
    ).eval()


@pytest.fixture
def driver() -> Callable[..., PagedDriver]:
    return PagedDriver


@pytest.fixture
def embed() -> Callable[[VisionLanguageModel, ProcessedInputs], torch.Tensor]:
    return prompt_embeds


@pytest.fixture
def make_image() -> Callable[..., bytes]:
    return image_bytes


@pytest.fixture
def media() -> type[Media]:
    return Media
