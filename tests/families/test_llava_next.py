"""LLaVA-NeXT (anyres tiling) against ``transformers``' own classes, then served end to end.

The checkpoint is a tiny random one written by ``LlavaNextForConditionalGeneration``
and ``LlavaNextProcessor`` (``conftest.write_llava_next``: 56-pixel tiles over the
five LLaVA-NeXT resolutions). An image's placeholder count depends on its size
(base tile, unpadded tile map, one newline per row); ours must equal the
processor's, with its pixels tile for tile; the encoder output must equal
``get_image_features``; a served greedy chat must produce the tokens of
``generate(do_sample=False)``, aggregated, E+PD and E+P+D (where prefill and
decode size each placeholder from the item's grid, its size in pixels).
"""

from __future__ import annotations

import pytest
import torch
from ec_frontend.model.llava_next import anyres_image_tokens
from ec_frontend.model.loader import load_config, load_model
from transformers import LlavaNextForConditionalGeneration

from .conftest import load_hf_llava_next_processor
from .flows import (
    CASES,
    ServedInEveryTopology,
    chat_messages,
    family_fixtures,
    hf_inputs,
    media,
    prefill_kv_params,
)

ours, hf, dep = family_fixtures(
    "llava_next_dir", LlavaNextForConditionalGeneration, load_hf_llava_next_processor
)


@pytest.mark.parametrize("case", CASES)
def test_processor_matches_transformers(ours, hf, case):
    hf_processor, hf_model = hf
    mine = ours.process_chat(chat_messages(case, urls=False), media(case))
    ref = hf_inputs(hf_processor, case)
    ids = ref["input_ids"][0]
    assert mine.prompt_token_ids == ids.tolist()
    image_token = hf_model.config.image_token_id
    assert sum(f.length for f in mine.mm_features) == int((ids == image_token).sum())
    sizes = ref.get("image_sizes", torch.zeros(0, 2, dtype=torch.int64)).tolist()
    assert [list(f.image_grid_thw) for f in mine.mm_features] == [[1, h, w] for h, w in sizes]
    for i, f in enumerate(mine.mm_features):
        assert ids[f.offset : f.offset + f.length].eq(image_token).all()
        # transformers pads every image's tiles to the batch's most; ours carry their own.
        tiles = f.pixel_values.shape[0]
        torch.testing.assert_close(f.pixel_values, ref["pixel_values"][i, :tiles], atol=0, rtol=0)
        assert not ref["pixel_values"][i, tiles:].any()
    n = len(ids)
    assert torch.equal(mine.mrope_positions, torch.arange(n).expand(3, n))
    assert mine.mrope_position_delta == 0


@pytest.mark.parametrize(
    ("height", "width"),
    [(56, 84), (84, 112), (140, 56), (1, 1), (1000, 50), (50, 1000), (300, 300), (57, 113)],
)
def test_placeholder_count_equals_the_processor_for_any_size(llava_next_dir, hf, height, width):
    hf_processor, _ = hf
    want = hf_processor._get_number_of_features(height, width, 56, 56) - 1
    assert anyres_image_tokens(load_config(llava_next_dir), (1, height, width)) == want


def test_encoder_output_equals_transformers_image_features(llava_next_dir, hf, ours):
    hf_processor, hf_model = hf
    model = load_model(llava_next_dir, device="cpu", dtype="float32", load_language=False)
    mine = ours.process_chat(chat_messages("two-images", urls=False), media("two-images"))
    pixels = torch.cat([f.pixel_values for f in mine.mm_features])
    grids = torch.tensor([f.image_grid_thw for f in mine.mm_features])
    got = model.encode_images(pixels, grids)
    ref = hf_inputs(hf_processor, "two-images")
    with torch.no_grad():
        want = hf_model.model.get_image_features(
            pixel_values=ref["pixel_values"], image_sizes=ref["image_sizes"]
        ).pooler_output
    hidden = hf_model.config.text_config.hidden_size
    assert [tuple(t.shape) for t in got] == [(f.length, hidden) for f in mine.mm_features]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="tiles"):
        model.encode_images(pixels[:-1], grids)


class TestServed(ServedInEveryTopology):
    pass


@pytest.mark.slow
def test_kv_wire_has_no_mrope_delta_for_a_1d_rope_family(dep):
    for case in CASES:
        assert "mrope_position_delta" not in prefill_kv_params(dep["pd"], case), case
