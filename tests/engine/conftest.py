"""Fixtures of the engine tests.

Bookkeeping tests (scheduler, caches) use small fake requests and a fake runner
that "samples" fixed tokens; model tests load the built-in model once per session
and build in-process engines around it.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ec_frontend.config import (
    CacheConfig,
    ECTransferConfig,
    EngineConfig,
    SchedulerConfig,
)
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.outputs import ModelRunnerOutput, RequestOutput
from ec_frontend.engine.request import Request
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.scheduler_output import SchedulerOutput
from ec_frontend.model.interface import AttentionMetadata, KVCacheSpec, VisionLanguageModel
from ec_frontend.model.loader import load_model, load_processor
from ec_frontend.model.processor import InputProcessor, MultiModalFeature, ProcessedInputs
from PIL import Image

IMAGE_TOKEN = 7


def fake_hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def fake_feature(name: str, offset: int, length: int, *, pixels: bool = True) -> MultiModalFeature:
    pv = torch.zeros(length * 4, 8) if pixels else None
    return MultiModalFeature(fake_hash(name), offset, length, (1, 2, 2 * length), pv)


def fake_request(
    rid: str,
    num_prompt: int,
    *,
    images: Sequence[tuple[str, int, int]] = (),
    max_tokens: int | None = 4,
    pixels: bool = True,
    **params: Any,
) -> Request:
    """A request of ``num_prompt`` tokens with images ``(name, offset, length)``."""
    ids = [1] * num_prompt
    feats = [fake_feature(n, off, ln, pixels=pixels) for n, off, ln in images]
    for f in feats:
        ids[f.offset : f.offset + f.length] = [IMAGE_TOKEN] * f.length
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, **params), mm_features=feats)


def fake_runner_output(so: SchedulerOutput, token: int = 5) -> ModelRunnerOutput:
    """What a runner would return: one token for every request that samples."""
    return ModelRunnerOutput(
        sampled_token_ids={s.request_id: [token] for s in so.scheduled if s.sample}
    )


# ---- the built-in model -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Media:
    """Stands in for the native ``MediaItem``: the processor reads ``data`` and ``mm_hash``."""

    data: bytes
    mm_hash: str


def image_media(seed: int, size: int = 112) -> Media:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    data = buf.getvalue()
    return Media(data, hashlib.blake2b(data, digest_size=16).hexdigest())


class CountingModel(VisionLanguageModel):
    """Delegates to a real model and counts calls (and can fail or slow on demand)."""

    def __init__(self, inner: VisionLanguageModel) -> None:
        self.inner = inner
        self.image_token_id = inner.image_token_id
        self.vocab_size = inner.vocab_size
        self.hidden_size = inner.hidden_size
        self.device = inner.device
        self.dtype = inner.dtype
        self.calls: dict[str, int] = {"encode": 0, "embed": 0, "forward": 0, "logits": 0}
        self.forward_batch_sizes: list[int] = []
        self.on_forward: Callable[[], None] | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.inner.kv_cache_spec()

    def encode_images(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        self.calls["encode"] += 1
        return self.inner.encode_images(pixel_values, grid)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.calls["embed"] += 1
        if self.on_forward is not None:
            self.on_forward()
        return self.inner.embed_tokens(input_ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        self.calls["forward"] += 1
        self.forward_batch_sizes.append(attn_metadata.num_requests)
        return self.inner.forward(inputs_embeds, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.calls["logits"] += 1
        return self.inner.compute_logits(hidden_states)


@pytest.fixture(scope="session")
def vlm(builtin_model_dir: Path) -> VisionLanguageModel:
    return load_model(builtin_model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def processor(builtin_model_dir: Path) -> InputProcessor:
    return load_processor(builtin_model_dir)


def engine_config(
    *,
    ec: dict[str, Any] | None = None,
    max_model_len: int = 512,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    num_kv_blocks: int | None = 256,
    encoder_cache_size: int = 1024,
    encoder_compute_budget: int | None = None,
    enable_prefix_caching: bool = True,
) -> EngineConfig:
    return EngineConfig(
        device="cpu",
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            encoder_compute_budget=encoder_compute_budget,
        ),
        cache=CacheConfig(
            block_size=16,
            num_kv_blocks=num_kv_blocks,
            encoder_cache_size=encoder_cache_size,
            enable_prefix_caching=enable_prefix_caching,
        ),
        ec_transfer=ECTransferConfig.from_json(ec) if ec is not None else None,
    )


@pytest.fixture
def make_engine(
    vlm: VisionLanguageModel, processor: InputProcessor
) -> Callable[..., tuple[EngineCore, CountingModel]]:
    """``make_engine(**engine_config kwargs)`` -> (core, counting model)."""

    def make(**kwargs: Any) -> tuple[EngineCore, CountingModel]:
        model = CountingModel(vlm)
        core = EngineCore(
            engine_config(**kwargs), model, tokenizer=processor.tokenizer,
            eos_token_id=processor.eos_token_id,
        )  # fmt: skip
        return core, model

    return make


def chat_inputs(processor: InputProcessor, text: str, images: Sequence[Media]) -> ProcessedInputs:
    content: list[dict[str, Any]] = [
        {"type": "image", "media_index": i} for i in range(len(images))
    ]
    content.append({"type": "text", "text": text})
    return processor.process_chat([{"role": "user", "content": content}], list(images))


def run_to_completion(
    core: EngineCore,
    max_steps: int = 10_000,
    before_step: Callable[[int], object] | None = None,
) -> dict[str, RequestOutput]:
    """Step until idle; the accumulated output of every request.

    ``before_step(i)`` runs before step ``i`` (counted from 0) while work remains.
    """
    results: dict[str, RequestOutput] = {}
    for step in range(max_steps):
        if not core.has_work():
            return results
        if before_step is not None:
            before_step(step)
        for out in core.step():
            if out.request_id in results:
                results[out.request_id].add(out)
            else:
                results[out.request_id] = out
    raise AssertionError("engine did not become idle")


def assert_no_leaks(core: EngineCore) -> None:
    if core.kv_cache is not None:
        assert core.kv_cache.num_used_blocks == 0
    assert core.encoder_cache.num_references() == 0
    assert not core.scheduler.requests


@pytest.fixture
def greedy() -> Iterator[Callable[..., SamplingParams]]:
    def make(max_tokens: int = 6, **kwargs: Any) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)

    yield make


class Helpers:
    """The helpers above, for test modules (conftest is not importable by name)."""

    fake_hash = staticmethod(fake_hash)
    fake_feature = staticmethod(fake_feature)
    fake_request = staticmethod(fake_request)
    fake_runner_output = staticmethod(fake_runner_output)
    image_media = staticmethod(image_media)
    Media = Media
    chat_inputs = staticmethod(chat_inputs)
    run_to_completion = staticmethod(run_to_completion)
    assert_no_leaks = staticmethod(assert_no_leaks)
    engine_config = staticmethod(engine_config)
    CountingModel = CountingModel
    IMAGE_TOKEN = IMAGE_TOKEN


@pytest.fixture(scope="session")
def h() -> type[Helpers]:
    return Helpers
