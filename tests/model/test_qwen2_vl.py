"""The paged Qwen2-VL forward against transformers' own Qwen2-VL forward."""

from __future__ import annotations

import pytest
import torch
from ec_frontend.model.processor import ProcessedInputs

ATOL = 1e-4


def chat(processor, media, make_image, images: list[tuple[int, int]], text: str) -> ProcessedInputs:
    parts = [{"type": "image", "media_index": i} for i in range(len(images))]
    parts.append({"type": "text", "text": text})
    items = [media(make_image(w, h, seed=i), f"{i:x}") for i, (w, h) in enumerate(images)]
    return processor.process_chat([{"role": "user", "content": parts}], items)


def hf_prefill(hf_model, processor, inputs: ProcessedInputs):
    hf_model.model.rope_deltas = None  # transformers keeps the last prompt's delta here
    ids = torch.tensor([inputs.prompt_token_ids])
    kwargs = {}
    if inputs.mm_features:
        kwargs = {
            "pixel_values": torch.cat([f.pixel_values for f in inputs.mm_features]),
            "image_grid_thw": torch.tensor([f.image_grid_thw for f in inputs.mm_features]),
            "mm_token_type_ids": (ids == processor.image_token_id).int(),
        }
    with torch.no_grad():
        return hf_model(input_ids=ids, use_cache=True, **kwargs)


CASES = [
    pytest.param([], "Hello there, describe a red square.", id="text"),
    pytest.param([(56, 56)], "What is in the image?", id="one-image-56"),
    pytest.param([(112, 84)], "Describe it.", id="one-image-112x84"),
    pytest.param([(84, 140), (56, 112)], "Compare the two pictures.", id="two-images"),
]


@pytest.mark.parametrize(("images", "text"), CASES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_then_decode_matches_transformers(
    model, processor, hf_model, media, make_image, driver, embed, images, text, block_size
):
    inputs = chat(processor, media, make_image, images, text)
    ref = hf_prefill(hf_model, processor, inputs)
    paged = driver(model, block_size=block_size, num_blocks=64)
    (logits,) = paged.step([("r", embed(model, inputs), inputs.mrope_positions)])
    torch.testing.assert_close(logits, ref.logits[0], atol=ATOL, rtol=0)

    cache = ref.cache
    n = len(inputs.prompt_token_ids)
    token = int(logits[-1].argmax())
    for i in range(4):
        pos = torch.full((3, 1), n + i + inputs.mrope_position_delta)
        (step_logits,) = paged.step([("r", model.embed_tokens(torch.tensor([token])), pos)])
        with torch.no_grad():
            ref = hf_model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        cache = ref.cache
        torch.testing.assert_close(step_logits[0], ref.logits[0, -1], atol=ATOL, rtol=0)
        token = int(step_logits[0].argmax())


def test_batched_varlen_step_equals_each_request_alone(
    model, processor, media, make_image, driver, embed
):
    """A step holding a fresh prefill, a prefill continuation and a decode gives
    each request the logits it gets when run alone."""
    a = chat(processor, media, make_image, [(56, 56)], "first request")
    b = chat(processor, media, make_image, [], "second request, with a much longer text body here")
    c = chat(processor, media, make_image, [(112, 56)], "third")
    ea, eb, ec = embed(model, a), embed(model, b), embed(model, c)
    split = 9
    tok = model.embed_tokens(torch.tensor([5]))
    c_pos = torch.full((3, 1), len(c.prompt_token_ids) + c.mrope_position_delta)

    alone = []
    for rid, steps in [
        ("a", [[(ea, a.mrope_positions)]]),
        (
            "b",
            [
                [(eb[:split], b.mrope_positions[:, :split])],
                [(eb[split:], b.mrope_positions[:, split:])],
            ],
        ),
        ("c", [[(ec, c.mrope_positions)], [(tok, c_pos)]]),
    ]:
        solo = driver(model, block_size=8, num_blocks=64)
        for step in steps:
            (out,) = solo.step([(rid, *step[0])])
        alone.append(out)

    batched = driver(model, block_size=8, num_blocks=64)
    batched.step([("b", eb[:split], b.mrope_positions[:, :split]), ("c", ec, c.mrope_positions)])
    outs = batched.step(
        [
            ("a", ea, a.mrope_positions),
            ("b", eb[split:], b.mrope_positions[:, split:]),
            ("c", tok, c_pos),
        ]
    )
    assert [o.shape[0] for o in outs] == [len(a.prompt_token_ids), len(eb) - split, 1]
    for got, want in zip(outs, alone, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [[7], [7, 1, 30], [1] * 5])
def test_chunked_prefill_equals_single_prefill(
    model, processor, media, make_image, driver, embed, chunks
):
    inputs = chat(processor, media, make_image, [(84, 84)], "chunk me")
    embeds, pos = embed(model, inputs), inputs.mrope_positions
    (whole,) = driver(model, block_size=4, num_blocks=64).step([("r", embeds, pos)])
    paged = driver(model, block_size=4, num_blocks=64)
    start, outs = 0, []
    for size in [*chunks, len(embeds)]:
        end = min(start + size, len(embeds))
        if end > start:
            outs.extend(paged.step([("r", embeds[start:end], pos[:, start:end])]))
        start = end
    torch.testing.assert_close(torch.cat(outs), whole, atol=ATOL, rtol=0)


def test_encode_images_is_batched_and_split_per_image(model, processor, media, make_image):
    inputs = chat(processor, media, make_image, [(56, 56), (112, 84), (56, 112)], "x")
    feats = inputs.mm_features
    together = model.encode_images(
        torch.cat([f.pixel_values for f in feats]), torch.tensor([f.image_grid_thw for f in feats])
    )
    assert [t.shape for t in together] == [(f.length, model.hidden_size) for f in feats]
    for feat, out in zip(feats, together, strict=True):
        (alone,) = model.encode_images(feat.pixel_values, torch.tensor([feat.image_grid_thw]))
        torch.testing.assert_close(out, alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("pixels_shape", "grid", "match"),
    [
        ((16, 1176), [[1, 4, 8]], "grids hold 32 patches"),
        ((16, 1176), [[1, 4]], r"\[num_images, 3\]"),
        ((16, 1176), [[1, 0, 4]], "positive"),
        ((12, 1176), [[1, 3, 4]], "multiples of 2"),
    ],
)
def test_encode_images_rejects_inconsistent_inputs(model, pixels_shape, grid, match):
    with pytest.raises(ValueError, match=match):
        model.encode_images(torch.zeros(pixels_shape), torch.tensor(grid))


@pytest.mark.parametrize("ids", [[-1], [0, 10**6], [576]])
def test_embed_tokens_rejects_out_of_vocab_ids(model, ids):
    with pytest.raises(ValueError, match="token ids must lie"):
        model.embed_tokens(torch.tensor(ids))


def test_kv_cache_spec(model):
    spec = model.kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (
        2,
        2,
        16,
        torch.float32,
    )
    assert spec.bytes_per_block(16) == 2 * 2 * 16 * 2 * 16 * 4


def test_decodes_of_different_lengths_share_one_step(
    model, processor, media, make_image, driver, embed
):
    prompts = [
        chat(processor, media, make_image, [], "short"),
        chat(processor, media, make_image, [(56, 112)], "an image and more words to make it long"),
        chat(processor, media, make_image, [], "a medium sized text prompt"),
    ]
    tokens = [torch.tensor([7]), torch.tensor([42]), torch.tensor([300])]

    def decode_pos(p: ProcessedInputs) -> torch.Tensor:
        return torch.full((3, 1), len(p.prompt_token_ids) + p.mrope_position_delta)

    alone = []
    for i, p in enumerate(prompts):
        solo = driver(model, block_size=4, num_blocks=64)
        solo.step([(str(i), embed(model, p), p.mrope_positions)])
        (out,) = solo.step([(str(i), model.embed_tokens(tokens[i]), decode_pos(p))])
        alone.append(out)

    together = driver(model, block_size=4, num_blocks=64)
    for i, p in enumerate(prompts):
        together.step([(str(i), embed(model, p), p.mrope_positions)])
    outs = together.step(
        [(str(i), model.embed_tokens(tokens[i]), decode_pos(p)) for i, p in enumerate(prompts)]
    )
    for got, want in zip(outs, alone, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
