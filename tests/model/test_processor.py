"""InputProcessor: placeholders, M-RoPE positions, the three request shapes, errors."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from ec_frontend.model.processor import InputError
from PIL import Image


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def img(i: int) -> dict:
    return {"type": "image", "media_index": i}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


@pytest.mark.parametrize(
    ("sizes", "expected_tokens"),
    [
        ([(56, 56)], [4]),
        ([(112, 112)], [16]),
        ([(112, 84)], [12]),
        ([(20, 20)], [4]),  # upscaled to the minimum pixels
        ([(640, 480)], [54]),  # downscaled to 168x252 under the maximum pixels
        ([(56, 56), (112, 112), (84, 168)], [4, 16, 18]),
    ],
)
def test_placeholders_and_positions_match_transformers(
    processor, hf_model, media, make_image, sizes, expected_tokens
):
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    items = [media(data, f"{i + 10:x}") for i, data in enumerate(images)]
    parts = [p for i in range(len(sizes)) for p in (text(f"image {i}:"), img(i))]
    out = processor.process_chat(user(*parts, text("Compare.")), items)

    assert [f.length for f in out.mm_features] == expected_tokens
    ref = processor.image_processor(
        images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
    )
    grids = ref["image_grid_thw"]
    assert [f.image_grid_thw for f in out.mm_features] == [tuple(g) for g in grids.tolist()]
    assert [f.length for f in out.mm_features] == (grids.prod(-1) // 4).tolist()
    torch.testing.assert_close(
        torch.cat([f.pixel_values for f in out.mm_features]), ref["pixel_values"]
    )
    assert [f.mm_hash for f in out.mm_features] == [it.mm_hash for it in items]

    ids = torch.tensor([out.prompt_token_ids])
    is_image = ids == processor.image_token_id
    assert int(is_image.sum()) == sum(expected_tokens)
    for f in out.mm_features:
        assert bool(is_image[0, f.offset : f.offset + f.length].all())
        assert out.prompt_token_ids[f.offset - 1] == processor.tokenizer.convert_tokens_to_ids(
            "<|vision_start|>"
        )
    positions, delta = hf_model.model.get_rope_index(ids, is_image.int(), image_grid_thw=grids)
    assert torch.equal(out.mrope_positions, positions[:, 0])
    assert out.mrope_position_delta == int(delta)


def test_images_follow_their_media_index(processor, media, make_image):
    items = [media(make_image(56, 56, seed=0), "aa"), media(make_image(112, 112, seed=1), "bb")]
    out = processor.process_chat(user(img(1), text("then"), img(0)), items)
    assert [(f.mm_hash, f.length) for f in out.mm_features] == [("bb", 16), ("aa", 4)]
    assert out.mm_features[0].offset < out.mm_features[1].offset


def test_chat_template_rendering(processor, media, make_image):
    out = processor.process_chat(
        [
            {"role": "system", "content": [text("Be brief.")]},
            {"role": "user", "content": [img(0), text("What?")]},
        ],
        [media(make_image(56, 56), "ab")],
    )
    assert out.prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>What?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = processor.process_chat(user(text("hi")), [], add_generation_prompt=False)
    assert no_gen.prompt.endswith("hi<|im_end|>\n")
    assert no_gen.prompt.startswith("<|im_start|>system\nYou are a helpful assistant.")
    vision_id = processor.process_chat(
        user(img(0)),
        [media(make_image(56, 56), "ab")],
        chat_template_kwargs={"add_vision_id": True},
    )
    assert "Picture 1: <|vision_start|>" in vision_id.prompt


def test_text_only_positions_are_sequential(processor):
    out = processor.process_chat(user(text("hello world")), [])
    n = len(out.prompt_token_ids)
    assert out.mm_features == []
    assert torch.equal(out.mrope_positions, torch.arange(n).expand(3, n))
    assert out.mrope_position_delta == 0


@pytest.mark.parametrize("prompt", ["Tell me a story about a cat.", [1, 2, 3, 100, 500]])
def test_process_prompt(processor, prompt):
    out = processor.process_prompt(prompt)
    if isinstance(prompt, str):
        assert processor.tokenizer.decode(out.prompt_token_ids) == prompt
        assert out.prompt == prompt
    else:
        assert out.prompt_token_ids == prompt
    n = len(out.prompt_token_ids)
    assert torch.equal(out.mrope_positions, torch.arange(n).expand(3, n))
    assert (out.mm_features, out.mrope_position_delta) == ([], 0)


def test_process_generate_reproduces_chat_processing(processor, media, make_image):
    items = [
        media(make_image(84, 56, seed=3), "c0ffee"),
        media(make_image(56, 112, seed=4), "beef"),
    ]
    chat = processor.process_chat(user(img(0), text("and"), img(1), text("?")), items)
    features = {
        "mm_hashes": [f.mm_hash for f in chat.mm_features],
        "mm_placeholders": [{"offset": f.offset, "length": f.length} for f in chat.mm_features],
        "mm_grid_thw": [list(f.image_grid_thw) for f in chat.mm_features],
    }
    gen = processor.process_generate(chat.prompt_token_ids, features)
    assert gen.prompt_token_ids == chat.prompt_token_ids
    assert torch.equal(gen.mrope_positions, chat.mrope_positions)
    assert gen.mrope_position_delta == chat.mrope_position_delta
    assert [(f.mm_hash, f.offset, f.length, f.image_grid_thw) for f in gen.mm_features] == [
        (f.mm_hash, f.offset, f.length, f.image_grid_thw) for f in chat.mm_features
    ]
    assert all(f.pixel_values is None for f in gen.mm_features)


@pytest.mark.parametrize("features", [None, {}, {"mm_hashes": [], "mm_placeholders": []}])
def test_process_generate_without_images(processor, features):
    out = processor.process_generate([10, 20, 30], features)
    assert out.prompt_token_ids == [10, 20, 30] and out.mm_features == []


PAD = 516  # <|image_pad|> of the built-in tokenizer
GOOD = {
    "mm_hashes": ["ab"],
    "mm_placeholders": [{"offset": 1, "length": 4}],
    "mm_grid_thw": [[1, 4, 4]],
}


@pytest.mark.parametrize(
    ("token_ids", "features", "code"),
    [
        ([1, PAD, PAD, PAD, PAD, 2], {**GOOD, "mm_grid_thw": None}, "invalid_features"),
        ([1, PAD, PAD, PAD, PAD, 2], {**GOOD, "mm_hashes": ["AB"]}, "invalid_features"),
        ([1, PAD, PAD, PAD, PAD, 2], {**GOOD, "mm_hashes": ["ab", "cd"]}, "invalid_features"),
        ([1, PAD, PAD, PAD, PAD, 2], {**GOOD, "mm_grid_thw": [[1, 4, 8]]}, "placeholder_mismatch"),
        ([1, PAD, PAD, PAD, PAD, 2], {**GOOD, "mm_grid_thw": [[1, 3, 4]]}, "invalid_features"),
        ([1, PAD, PAD, PAD, 7, 2], GOOD, "placeholder_mismatch"),
        ([1, PAD, PAD, PAD, PAD, PAD], GOOD, "placeholder_mismatch"),
        ([1, PAD, PAD], GOOD, "placeholder_mismatch"),
        (
            [1, PAD, PAD, PAD, PAD, 2],
            {**GOOD, "mm_placeholders": [{"offset": -1, "length": 4}]},
            "invalid_features",
        ),
        (
            [PAD] * 8,
            {
                "mm_hashes": ["ab", "cd"],
                "mm_placeholders": [{"offset": 0, "length": 4}, {"offset": 2, "length": 4}],
                "mm_grid_thw": [[1, 4, 4], [1, 4, 4]],
            },
            "placeholder_mismatch",
        ),
        ([1, 2, 10**6], None, "invalid_token_id"),
        ([1, -3], None, "invalid_token_id"),
        ([1, True], None, "invalid_token_id"),
        ([], None, "empty_prompt"),
    ],
)
def test_process_generate_errors(processor, token_ids, features, code):
    with pytest.raises(InputError) as err:
        processor.process_generate(token_ids, features)
    assert err.value.code == code


def bad_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    return buf.getvalue()[:40]


@pytest.mark.parametrize(
    ("messages", "data", "kwargs", "code"),
    [
        (user(img(0)), b"not an image at all", {}, "invalid_image"),
        (user(img(0)), bad_png(), {}, "invalid_image"),
        (user(img(0)), b"", {}, "invalid_image"),
        (user(img(0)), None, {}, "invalid_image"),
        (user(img(1)), "png", {}, "invalid_media_index"),
        (user(img(0), img(0), text("<|image_pad|>")), "png", {}, "placeholder_mismatch"),
        (user(text("sneaky <|image_pad|>")), "png", {}, "placeholder_mismatch"),
        (
            user(img(0)),
            "png",
            {"mm_processor_kwargs": {"do_resize": False}},
            "invalid_processor_kwargs",
        ),
        (
            user(img(0)),
            "png",
            {"mm_processor_kwargs": {"min_pixels": 10**6, "max_pixels": 10}},
            "invalid_processor_kwargs",
        ),
        (user(img(0)), "png", {"chat_template_kwargs": {"tokenize": True}}, "invalid_template"),
    ],
)
def test_process_chat_errors(processor, media, make_image, messages, data, kwargs, code):
    if data == "png":
        data = make_image(56, 56)
    with pytest.raises(InputError) as err:
        processor.process_chat(messages, [media(data, "ab")], **kwargs)
    assert err.value.code == code
    assert str(err.value)


def test_extreme_aspect_ratio_is_an_input_error(processor, media, make_image):
    with pytest.raises(InputError, match="cannot be processed"):
        processor.process_chat(user(img(0)), [media(make_image(3000, 10), "ab")])


def test_mm_processor_kwargs_change_the_resolution(processor, media, make_image):
    items = [media(make_image(224, 224), "ab")]
    small = processor.process_chat(user(img(0)), items, mm_processor_kwargs={"max_pixels": 56 * 56})
    assert small.mm_features[0].length == 4
    assert processor.process_chat(user(img(0)), items).mm_features[0].length == 64


@pytest.mark.parametrize("method", ["chat", "prompt"])
def test_too_many_tokens(processor, method):
    long_text = "hello " * (processor.max_model_len + 10)
    with pytest.raises(InputError) as err:
        if method == "chat":
            processor.process_chat(user(text(long_text)), [])
        else:
            processor.process_prompt(long_text)
    assert err.value.code == "too_many_tokens"


def test_prompt_with_image_tokens_but_no_images(processor):
    with pytest.raises(InputError) as err:
        processor.process_prompt("look: <|image_pad|>")
    assert err.value.code == "placeholder_mismatch"


def test_oversized_image_is_rejected_before_decoding(processor, media):
    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, "PNG")
    with pytest.raises(InputError) as err:
        processor.process_chat(user(img(0)), [media(buf.getvalue(), "ab")])
    assert err.value.code == "image_too_large"


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "LA", "CMYK"])
def test_image_modes_are_converted(processor, media, mode):
    buf = io.BytesIO()
    Image.new(mode, (56, 56)).save(buf, "PNG" if mode != "CMYK" else "JPEG")
    out = processor.process_chat(user(img(0)), [media(buf.getvalue(), "ab")])
    assert out.mm_features[0].pixel_values.shape == (16, 1176)


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (
            [{"role": "user", "content": "plain string"}],
            "<|im_start|>user\nplain string<|im_end|>\n",
        ),
        (
            [{"role": "user", "content": [text("hi")]}, {"role": "assistant", "content": None}],
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n",
        ),
        (
            [{"role": "user", "content": [text("a"), {"type": "audio"}, text("b")]}],
            "<|im_start|>user\nab<|im_end|>\n",
        ),
    ],
)
def test_template_content_shapes(processor, messages, expected):
    out = processor.process_chat(messages, [], add_generation_prompt=False)
    assert out.prompt.endswith(expected)


def test_processor_is_thread_safe(processor, media, make_image):
    items = [media(make_image(112, 56, seed=9), "ab")]
    messages = user(text("same request " * 20), img(0))
    want = processor.process_chat(messages, items)
    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(lambda _: processor.process_chat(messages, items), range(32)))
    for out in outs:
        assert out.prompt_token_ids == want.prompt_token_ids
        assert torch.equal(out.mm_features[0].pixel_values, want.mm_features[0].pixel_values)
