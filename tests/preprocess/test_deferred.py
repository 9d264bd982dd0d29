"""Deferred images: the processor of the built-in checkpoint decodes an image's bytes
once; a later prompt carrying the same bytes (and pixel range) gets the same grid and
placeholders with no pixels, only the bytes, and the scheduler's encoder planner
decodes them when the encoder has to run after all (its cache entry is gone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.engine.encoder_cache import EncoderCacheManager
from ec_frontend.engine.encoder_planner import EncoderInputPlanner
from ec_frontend.engine.request import Request
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.wire import Codec, pack_dataclass, unpack_fields
from ec_frontend.model.loader import load_processor
from ec_frontend.model.native_preprocess import decode_deferred, images_preprocessed
from ec_frontend.model.processor import InputProcessor, MultiModalFeature, ProcessedInputs
from PIL import Image

from .corpus import encode, pixels


class Media:
    """An inline image as the Rust parser hands it over."""

    def __init__(self, data: bytes, mm_hash: str) -> None:
        self.data = data
        self.mm_hash = mm_hash


@pytest.fixture(scope="module")
def processor(builtin_model_dir: Path) -> InputProcessor:
    proc = load_processor(builtin_model_dir)
    assert proc.native is not None
    proc.configure_media()
    return proc


def chat(proc: InputProcessor, data: bytes, **kwargs: Any) -> ProcessedInputs:
    messages = [{"role": "user", "content": [{"type": "image", "media_index": 0},
                                             {"type": "text", "text": "what is it"}]}]  # fmt: skip
    return proc.process_chat(messages, [Media(data, "a" * 32)], **kwargs)


def image(seed: int) -> bytes:
    return encode(Image.fromarray(pixels(120, 170, 3, seed=seed)), "JPEG", quality=90)


def test_direct_callers_always_get_pixels(builtin_model_dir: Path) -> None:
    proc = load_processor(builtin_model_dir)
    data = image(8)
    for _ in range(2):
        (feature,) = chat(proc, data).mm_features
        assert feature.pixel_values is not None and feature.deferred is None


def test_known_bytes_are_deferred_with_the_same_placeholders(processor: InputProcessor) -> None:
    data = image(1)
    count = images_preprocessed()
    first = chat(processor, data)
    assert images_preprocessed() == count + 1
    (decoded,) = first.mm_features
    assert decoded.pixel_values is not None and decoded.deferred is None

    second = chat(processor, data)
    assert images_preprocessed() == count + 1
    (deferred,) = second.mm_features
    assert deferred.pixel_values is None and deferred.deferred is not None
    assert second.prompt_token_ids == first.prompt_token_ids
    assert (deferred.offset, deferred.length) == (decoded.offset, decoded.length)
    assert deferred.image_grid_thw == decoded.image_grid_thw
    assert torch.equal(second.mrope_positions, first.mrope_positions)

    assert decode_deferred(deferred)
    assert images_preprocessed() == count + 2
    assert deferred.deferred is None
    assert torch.equal(deferred.pixel_values, decoded.pixel_values)


def test_another_pixel_range_or_other_bytes_decode_again(processor: InputProcessor) -> None:
    data = image(2)
    chat(processor, data)
    count = images_preprocessed()
    small = chat(processor, data, mm_processor_kwargs={"max_pixels": 56 * 56 * 2})
    assert small.mm_features[0].pixel_values is not None
    other = chat(processor, image(3))
    assert other.mm_features[0].pixel_values is not None
    assert images_preprocessed() == count + 2
    again = chat(processor, data, mm_processor_kwargs={"max_pixels": 56 * 56 * 2})
    assert again.mm_features[0].deferred is not None
    assert again.mm_features[0].image_grid_thw == small.mm_features[0].image_grid_thw


def request(inputs: ProcessedInputs, rid: str) -> Request:
    return Request.from_inputs(rid, inputs, SamplingParams(max_tokens=1), eos_token_id=None)


def test_the_planner_decodes_a_deferred_image_that_is_not_cached(processor: InputProcessor) -> None:
    data = image(4)
    want = chat(processor, data).mm_features[0].pixel_values
    inputs = chat(processor, data)
    planner = EncoderInputPlanner(EncoderCacheManager(4096), None, 4096)
    req = request(inputs, "r1")
    plan = planner.plan(req, 0, len(inputs.prompt_token_ids), 4096)
    assert plan.error is None and plan.encode == [0]
    assert torch.equal(req.mm_features[0].pixel_values, want)


def test_a_cached_deferred_image_is_never_decoded(processor: InputProcessor) -> None:
    data = image(5)
    chat(processor, data)
    cache = EncoderCacheManager(4096)
    planner = EncoderInputPlanner(cache, None, 4096)
    first = request(chat(processor, data), "r1")
    first.mm_features[0].pixel_values = torch.zeros(1)
    planner.commit(first, planner.plan(first, 0, first.num_prompt_tokens, 4096))
    count = images_preprocessed()
    second = request(chat(processor, data), "r2")
    plan = planner.plan(second, 0, second.num_prompt_tokens, 4096)
    assert plan.error is None and plan.encode == [] and plan.hits == 1
    assert second.mm_features[0].pixel_values is None
    assert images_preprocessed() == count


def test_a_deferred_image_that_no_longer_fits_its_placeholder_fails_the_plan(
    processor: InputProcessor,
) -> None:
    data = image(6)
    chat(processor, data)
    inputs = chat(processor, data)
    feature = inputs.mm_features[0]
    spec = dict(feature.deferred[1])
    spec["max_pixels"] = spec["min_pixels"]
    feature.deferred = (data, tuple(spec.items()))
    planner = EncoderInputPlanner(EncoderCacheManager(4096), None, 4096)
    plan = planner.plan(request(inputs, "r1"), 0, len(inputs.prompt_token_ids), 4096)
    assert plan.error is not None and "could not be decoded again" in plan.error
    assert feature.pixel_values is None


def test_a_deferred_image_crosses_the_engine_wire(processor: InputProcessor) -> None:
    """The engine may run in its own process: the bytes and the rule's values travel
    with the feature (msgpack over ZMQ) and decode there to the same pixels."""
    data = image(7)
    want = chat(processor, data).mm_features[0].pixel_values
    inputs = chat(processor, data)
    frames = Codec().encode(("add", pack_dataclass(inputs)))
    _, packed = Codec().decode(frames)
    kwargs = unpack_fields(packed)
    kwargs["mm_features"] = [MultiModalFeature(**unpack_fields(f)) for f in kwargs["mm_features"]]
    (feature,) = ProcessedInputs(**kwargs).mm_features
    assert feature.pixel_values is None and feature.deferred is not None
    assert decode_deferred(feature)
    assert torch.equal(feature.pixel_values, want)
