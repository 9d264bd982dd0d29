"""LLaVA-1.5 against ``transformers``' own classes, then served end to end.

The checkpoint is a tiny random one written by ``LlavaForConditionalGeneration``
(Llama decoder, CLIP tower, projector) and ``LlavaProcessor``
(``conftest.write_llava``). Our processor must give ``transformers``' token ids
(each ``<image>`` expanded to the tower's 16 tokens) and pixels, with 1-D
positions; a served greedy chat must produce the tokens of
``generate(do_sample=False)``, aggregated, E+PD and E+P+D.
"""

from __future__ import annotations

import pytest
import torch
from ec_frontend.model.loader import load_model
from transformers import LlavaForConditionalGeneration

from .conftest import LLAVA_IMAGE_SIZE, load_hf_llava_processor
from .flows import (
    CASES,
    ServedInEveryTopology,
    chat_messages,
    family_fixtures,
    hf_inputs,
    media,
)

TOKENS_PER_IMAGE = (LLAVA_IMAGE_SIZE // 14) ** 2


ours, hf, dep = family_fixtures("llava_dir", LlavaForConditionalGeneration, load_hf_llava_processor)


@pytest.mark.parametrize("case", CASES)
def test_processor_matches_transformers(ours, hf, case):
    hf_processor, hf_model = hf
    mine = ours.process_chat(chat_messages(case, urls=False), media(case))
    ref = hf_inputs(hf_processor, case)
    ids = ref["input_ids"][0]
    assert mine.prompt_token_ids == ids.tolist()
    image_token = hf_model.config.image_token_id
    assert [f.length for f in mine.mm_features] == [TOKENS_PER_IMAGE] * len(CASES[case][0])
    assert sum(f.length for f in mine.mm_features) == int((ids == image_token).sum())
    for f in mine.mm_features:
        assert ids[f.offset : f.offset + f.length].eq(image_token).all()
        assert f.image_grid_thw == (1, LLAVA_IMAGE_SIZE // 14, LLAVA_IMAGE_SIZE // 14)
    if mine.mm_features:
        pixels = torch.cat([f.pixel_values for f in mine.mm_features])
        torch.testing.assert_close(pixels, ref["pixel_values"], atol=0, rtol=0)
    n = len(ids)
    assert torch.equal(mine.mrope_positions, torch.arange(n).expand(3, n))
    assert mine.mrope_position_delta == 0


def test_encoder_output_equals_transformers_image_features(llava_dir, hf, ours):
    _, hf_model = hf
    model = load_model(llava_dir, device="cpu", dtype="float32", load_language=False)
    mine = ours.process_chat(chat_messages("two-images", urls=False), media("two-images"))
    pixels = torch.cat([f.pixel_values for f in mine.mm_features])
    grids = torch.tensor([f.image_grid_thw for f in mine.mm_features])
    got = model.encode_images(pixels, grids)
    with torch.no_grad():
        want = hf_model.model.get_image_features(pixel_values=pixels).pooler_output
    hidden = hf_model.config.text_config.hidden_size
    assert [t.shape for t in got] == [(TOKENS_PER_IMAGE, hidden)] * 2
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


class TestServed(ServedInEveryTopology):
    pass
