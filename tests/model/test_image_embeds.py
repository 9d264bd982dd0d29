"""Metadata-only image references (vLLM's ``image_embeds`` parts) in InputProcessor.

A reference parsed by ``_core`` from a chat body is sized from its grid alone: the
prompt (tokens, M-RoPE positions) equals the one the image's own bytes give, with no
pixel values, and a grid the model's processor could not have produced is refused.
"""

from __future__ import annotations

import base64
import json

import pytest
import torch
from ec_frontend._core import parse_request
from ec_frontend.model.processor import InputError


def chat_body(part: dict) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]}
    )


def parse(part: dict):
    return parse_request("chat", chat_body(part), model_id="m")


@pytest.mark.parametrize("size", [(56, 56), (112, 84), (640, 480)])
def test_reference_gives_the_prompt_of_the_image_without_pixels(processor, make_image, size):
    data = make_image(*size)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    image = parse({"type": "image_url", "image_url": {"url": url}, "uuid": "u"})
    real = processor.process_chat(image.messages, image.media)
    grid = list(real.mm_features[0].image_grid_thw)
    ref = parse({"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": "u"})
    got = processor.process_chat(ref.messages, ref.media)

    assert got.prompt_token_ids == real.prompt_token_ids
    assert torch.equal(got.mrope_positions, real.mrope_positions)
    assert got.mrope_position_delta == real.mrope_position_delta
    [feature] = got.mm_features
    assert feature.pixel_values is None
    assert feature.mm_hash == real.mm_features[0].mm_hash == ref.media[0].mm_hash
    assert (feature.offset, feature.length) == (
        real.mm_features[0].offset,
        real.mm_features[0].length,
    )


@pytest.mark.parametrize(
    ("grid", "kwargs", "reason"),
    [
        ([2, 4, 4], None, "one frame"),
        ([1, 4, 5], None, "multiples of the merge size"),
        ([1, 2000, 2000], None, "max_pixels"),
        ([1, 16, 16], {"max_pixels": 40000}, "max_pixels 40000"),
    ],
)
def test_a_grid_the_model_cannot_produce_is_refused(processor, grid, kwargs, reason):
    part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": "u"}
    ref = parse(part)
    with pytest.raises(InputError, match=reason) as exc:
        processor.process_chat(ref.messages, ref.media, mm_processor_kwargs=kwargs)
    assert exc.value.code == "invalid_image_embeds"
