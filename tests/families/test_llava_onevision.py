"""LLaVA-OneVision against ``transformers``' own classes, then served end to end.

The checkpoint is a tiny random one written by ``LlavaOnevisionForConditionalGeneration``
and ``LlavaOnevisionProcessor`` (``conftest.write_llava_onevision``: a SigLIP tower on
56-pixel tiles, 1 to 6 tiles a side, ``anyres_max_9``). An image alone in its prompt
is tiled; the images of a prompt with several are one padded tile each, as
``transformers`` does for a sample's images (``batch_num_images``): the reference is
the processor given the prompt's images as one sample. Ours must give the same ids,
placeholder counts and tile pixels, the encoder output of ``get_image_features``, and
served greedy tokens equal to ``generate(do_sample=False)``, aggregated, E+PD and
E+P+D, where the encoder gets each image alone from the proxy and must still encode
an image of a two-image prompt as one of several.
"""

from __future__ import annotations

from dataclasses import dataclass
from io import BytesIO
from typing import Any

import openai
import pytest
import torch
from ec_frontend.model.errors import InputError
from ec_frontend.model.llava_onevision import (
    ONE_OF_SEVERAL,
    image_tokens,
    several_images_hash,
)
from ec_frontend.model.loader import load_config, load_model
from PIL import Image
from transformers import LlavaOnevisionForConditionalGeneration

from .conftest import data_url, image_bytes, load_hf_llava_onevision_processor
from .flows import (
    CASES,
    Media,
    ServedInEveryTopology,
    chat_messages,
    family_fixtures,
    hf_inputs,
    media,
    prefill_kv_params,
)

TILE = 56
#: SigLIP features per tile side (56 px / 14 px patches).
N = 4


ours, hf, dep = family_fixtures(
    "llava_onevision_dir",
    LlavaOnevisionForConditionalGeneration,
    load_hf_llava_onevision_processor,
)


@dataclass(frozen=True, slots=True)
class Reference:
    """An ``image_embeds`` reference as the native parser gives it (no bytes, a grid)."""

    mm_hash: str
    image_grid_thw: tuple[int, int, int]
    data: bytes | None = None


def user(num_images: int, text: str = "What is this?") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image", "media_index": i} for i in range(num_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.mark.parametrize("case", CASES)
def test_processor_matches_transformers(ours, hf, case):
    hf_processor, hf_model = hf
    items = media(case)
    mine = ours.process_chat(chat_messages(case, urls=False), items)
    ref = hf_inputs(hf_processor, case, nested=True)
    ids = ref["input_ids"][0]
    assert mine.prompt_token_ids == ids.tolist()
    image_token = hf_model.config.image_token_id
    assert sum(f.length for f in mine.mm_features) == int((ids == image_token).sum())
    sizes = ref.get("image_sizes", torch.zeros(0, 2, dtype=torch.int64)).tolist()
    mode = 1 if len(items) == 1 else ONE_OF_SEVERAL
    assert [list(f.image_grid_thw) for f in mine.mm_features] == [[mode, h, w] for h, w in sizes]
    # The mode is part of the item's key: an image among several is not the item it is alone.
    want_hashes = [m.mm_hash if mode == 1 else several_images_hash(m.mm_hash) for m in items]
    assert [f.mm_hash for f in mine.mm_features] == want_hashes
    for i, f in enumerate(mine.mm_features):
        assert ids[f.offset : f.offset + f.length].eq(image_token).all()
        tiles = f.pixel_values.shape[0]
        if mode == ONE_OF_SEVERAL:
            assert tiles == 1
        torch.testing.assert_close(f.pixel_values, ref["pixel_values"][i, :tiles], atol=0, rtol=0)
        assert not ref["pixel_values"][i, tiles:].any()
    n = len(ids)
    assert torch.equal(mine.mrope_positions, torch.arange(n).expand(3, n))
    assert mine.mrope_position_delta == 0


@pytest.mark.parametrize(
    ("height", "width"),
    # Small maps, thin ones, and maps over 9 tiles (300x300: 6x6 tiles, shrunk by 2).
    [(56, 84), (84, 112), (140, 56), (1, 1), (1000, 50), (50, 1000), (300, 300), (57, 113),
     (2000, 2000), (129, 333)],
)  # fmt: skip
def test_placeholder_count_equals_the_processor_for_any_size(
    llava_onevision_dir, hf, height, width
):
    hf_processor, _ = hf
    config = load_config(llava_onevision_dir)
    alone = hf_processor._get_number_of_features(height, width, TILE, TILE)
    assert image_tokens(config, (1, height, width)) == alone
    # One of several: one tile and its newline, whatever the size.
    assert image_tokens(config, (ONE_OF_SEVERAL, height, width)) == N * N + 1
    with pytest.raises(InputError, match="starts with"):
        image_tokens(config, (4, height, width))


def test_same_picture_alone_and_among_several_are_different_items(ours, hf):
    png = image_bytes(120, 70, seed=5)
    alone = ours.process_chat(user(1), [Media(png, "ab")]).mm_features
    twice = ours.process_chat(user(2), [Media(png, "ab"), Media(png, "ab")]).mm_features
    assert [f.mm_hash for f in alone] == ["ab"]
    assert [f.mm_hash for f in twice] == [several_images_hash("ab")] * 2
    assert alone[0].image_grid_thw == (1, 70, 120)
    assert [f.image_grid_thw for f in twice] == [(ONE_OF_SEVERAL, 70, 120)] * 2
    assert alone[0].length > N * N + 1 == twice[0].length == twice[1].length
    assert alone[0].pixel_values.shape[0] > 1 == twice[0].pixel_values.shape[0]
    # transformers, given the picture twice as one sample: one padded tile each.
    hf_processor, _ = hf
    ref = hf_processor.image_processor(images=[[Image.open(BytesIO(png))] * 2], return_tensors="pt")
    for f in twice:
        torch.testing.assert_close(f.pixel_values, ref["pixel_values"][0], atol=0, rtol=0)


def test_a_reference_must_carry_the_mode_of_its_prompt(ours):
    png = image_bytes(70, 42, seed=9)
    several = Reference("cd", (ONE_OF_SEVERAL, 42, 70))
    got = ours.process_chat(user(2), [Media(png, "ab"), several]).mm_features
    assert [(f.mm_hash, f.length, f.pixel_values is None) for f in got] == [
        (several_images_hash("ab"), N * N + 1, False),
        (several_images_hash("cd"), N * N + 1, True),
    ]
    with pytest.raises(InputError, match="one of several in its prompt, but this prompt has 1"):
        ours.process_chat(user(1), [several])
    with pytest.raises(InputError, match="alone in its prompt, but this prompt has 2"):
        ours.process_chat(user(2), [Media(png, "ab"), Reference("cd", (1, 42, 70))])
    with pytest.raises(InputError, match="mm_processor_kwargs"):
        ours.process_chat(user(1), [Media(png, "ab")], mm_processor_kwargs={"max_pixels": 9})
    ids = ours.process_chat(user(1), [Media(png, "ab")]).prompt_token_ids
    features = {"mm_hashes": ["ab"], "mm_placeholders": [{"offset": 2, "length": 17}],
                "mm_grid_thw": [[4, 42, 70]]}  # fmt: skip
    with pytest.raises(InputError, match="starts with"):
        ours.process_generate(ids, features)


@pytest.mark.parametrize(("case", "size"), [("one-image", (300, 300)), ("two-images", None)])
def test_encoder_output_equals_transformers_image_features(
    llava_onevision_dir, hf, ours, case, size
):
    hf_processor, hf_model = hf
    model = load_model(llava_onevision_dir, device="cpu", dtype="float32", load_language=False)
    if size is None:
        items = media(case)
        ref = hf_inputs(hf_processor, case, nested=True)
    else:
        # 300x300: a 6x6-tile map, 24x24 features, shrunk to 12x12 (anyres_max_9).
        items = [Media(image_bytes(*size), "ab")]
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
        text = hf_processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ref = hf_processor(
            text=[text], images=[Image.open(BytesIO(items[0].data))], return_tensors="pt"
        )
    mine = ours.process_chat(user(len(items)), items)
    pixels = torch.cat([f.pixel_values for f in mine.mm_features])
    grids = torch.tensor([f.image_grid_thw for f in mine.mm_features])
    got = model.encode_images(pixels, grids)
    with torch.no_grad():
        want = hf_model.model.get_image_features(
            pixel_values=ref["pixel_values"],
            image_sizes=ref["image_sizes"],
            batch_num_images=ref["batch_num_images"],
        ).pooler_output
    hidden = hf_model.config.text_config.hidden_size
    assert [tuple(t.shape) for t in got] == [(f.length, hidden) for f in mine.mm_features]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="tiles"):
        model.encode_images(pixels[:-1], grids)


class TestServed(ServedInEveryTopology):
    nested = True


@pytest.mark.slow
def test_images_of_a_two_image_prompt_are_encoded_as_such_on_the_encoder(dep):
    """Through E+P+D, two fresh images of one prompt are encoded on E (in the mode of
    a two-image prompt, or prefill could not load them under its keys), none on
    prefill; aggregated gives the same tokens."""
    names = ("e", "pd")
    before = {n: dep[n].metrics() for n in names}
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(w, h, seed))}}
        for seed, (w, h) in ((303, (90, 60)), (404, (50, 120)))
    ]
    msgs = [{"role": "user", "content": [*content, {"type": "text", "text": "Compare."}]}]
    tokens = {}
    for name in ("E+P+D", "agg"):
        with openai.OpenAI(base_url=dep[name].url + "/v1", api_key="x", max_retries=0) as c:
            r = c.chat.completions.create(
                model="tiny",
                messages=msgs,
                max_tokens=6,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
        tokens[name] = (r.choices[0].model_extra or {})["token_ids"]
    assert tokens["E+P+D"] == tokens["agg"] and len(tokens["agg"]) >= 2

    def delta(name: str, metric: str) -> float:
        key = "ec_frontend_" + metric
        return dep[name].metrics().get(key, 0.0) - before[name].get(key, 0.0)

    assert delta("e", "encoder_items_computed_total") == 2
    assert delta("pd", "encoder_items_computed_total") == 0
    assert delta("pd", "ec_items_loaded_total") == 2


@pytest.mark.slow
def test_kv_wire_has_no_mrope_delta_for_a_1d_rope_family(dep):
    for case in CASES:
        assert "mrope_position_delta" not in prefill_kv_params(dep["pd"], case), case
