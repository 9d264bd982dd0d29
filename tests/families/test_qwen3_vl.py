"""Qwen3-VL against ``transformers``' own classes, then served end to end.

The checkpoint is a tiny random one written by ``Qwen3VLForConditionalGeneration``
and Qwen3-VL's processor (``conftest.write_qwen3_vl``): a Qwen3 decoder with its
own head_dim, q/k norms and interleaved M-RoPE, and a tower whose DeepStack
features are added after the first decoder layers. Our processor must give the
token ids, pixels, grids and positions of ``transformers``' processor and
``get_rope_index``; the encoder output must carry the DeepStack features; a served
greedy chat must produce the tokens of ``generate(do_sample=False)``, aggregated,
E+PD and E+P+D (where the features reach the prefill instance over the EC side
channel).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.model.interface import AttentionMetadata
from ec_frontend.model.loader import load_model, load_processor
from ec_frontend.model.qwen3_vl import interleaved_components
from transformers import Qwen3VLForConditionalGeneration

from .conftest import ImageOnlyQwen3VLProcessor, load_hf_processor
from .flows import (
    CASES,
    ServedInEveryTopology,
    chat_messages,
    check_qwen_processor,
    family_fixtures,
    hf_inputs,
    media,
    prefill_kv_params,
)

ours, hf, dep = family_fixtures(
    "qwen3_vl_dir",
    Qwen3VLForConditionalGeneration,
    lambda d: load_hf_processor(d, ImageOnlyQwen3VLProcessor),
)


@pytest.fixture(scope="module")
def model(qwen3_vl_dir: Path) -> Any:
    return load_model(qwen3_vl_dir, device="cpu", dtype="float32")


@pytest.mark.parametrize(
    ("section", "rows"),
    [
        # transformers' layout: H at 1, 4, ... and W at 2, 5, ... below 3 * section, else T.
        ((2, 1, 1), [0, 1, 2, 0]),
        ((4, 6, 6), [0, 1, 2] * 5 + [0]),
        ((24, 20, 20), [0, 1, 2] * 20 + [0] * 4),
    ],
)
def test_interleaved_mrope_assigns_rows_round_robin(section, rows):
    assert interleaved_components(section).tolist() == rows


@pytest.mark.parametrize("case", CASES)
def test_processor_and_rope_index_match_transformers(ours, hf, case):
    check_qwen_processor(ours, hf, case, lambda ids, image_token, ref: ref["mm_token_type_ids"])


def decoded_inputs(directory: Path, case: str) -> Any:
    """The case through a fresh processor: one that has not seen its images, so it
    decodes them (a processor defers pixels of images it decoded before)."""
    return load_processor(directory).process_chat(chat_messages(case, urls=False), media(case))


def test_encoder_output_carries_merged_tokens_then_deepstack_features(qwen3_vl_dir, hf, model):
    _, hf_model = hf
    mine = decoded_inputs(qwen3_vl_dir, "two-images")
    pixels = torch.cat([f.pixel_values for f in mine.mm_features])
    grids = torch.tensor([f.image_grid_thw for f in mine.mm_features])
    got = model.encode_images(pixels, grids)
    with torch.no_grad():
        want = hf_model.model.get_image_features(pixel_values=pixels, image_grid_thw=grids)
    hidden = hf_model.config.text_config.hidden_size
    assert model.encoder_output_size == hidden * 3
    assert [tuple(t.shape) for t in got] == [(f.length, hidden * 3) for f in mine.mm_features]
    for i, rows in enumerate(got):
        parts = [want.pooler_output[i]] + [feature[i] for feature in want.deepstack_features]
        for j, part in enumerate(parts):
            columns = rows[:, j * hidden : (j + 1) * hidden]
            torch.testing.assert_close(columns, part, atol=1e-5, rtol=0)


def _prefill_logits(model: Any, inputs: Any, rows: list[torch.Tensor]) -> torch.Tensor:
    """Last-token logits of one whole-prompt prefill on a fresh paged KV cache, image
    placeholders replaced by ``rows``."""
    n, block = len(inputs.prompt_token_ids), 16
    blocks = n // block + 2
    spec = model.kv_cache_spec()
    kv = [torch.zeros(2, blocks, block, spec.num_kv_heads, spec.head_dim)] * spec.num_layers
    kv = [t.clone() for t in kv]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        query_lens=torch.tensor([n]),
        block_tables=torch.tensor([list(range(1, blocks))]),
        slot_mapping=torch.arange(block, block + n),
        block_size=block,
        seq_lens_cpu=[n],
        query_lens_cpu=[n],
    )
    embeds = model.embed_tokens(torch.tensor(inputs.prompt_token_ids))
    for f, r in zip(inputs.mm_features, rows, strict=True):
        embeds[f.offset : f.offset + f.length] = r
    hidden = model.forward(embeds, inputs.mrope_positions, kv, meta)
    return model.compute_logits(hidden[-1:])[0]


def test_prefill_logits_equal_transformers_and_need_the_deepstack_features(qwen3_vl_dir, hf, model):
    hf_processor, hf_model = hf
    case = "two-images"
    mine = decoded_inputs(qwen3_vl_dir, case)
    pixels = torch.cat([f.pixel_values for f in mine.mm_features])
    grids = torch.tensor([f.image_grid_thw for f in mine.mm_features])
    rows = model.encode_images(pixels, grids)
    with torch.no_grad():
        want = hf_model(**hf_inputs(hf_processor, case)).logits[0, -1]
    got = _prefill_logits(model, mine, rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    hidden = model.hidden_size
    without = [torch.cat([r[:, :hidden], torch.zeros_like(r[:, hidden:])], dim=-1) for r in rows]
    assert (_prefill_logits(model, mine, without) - want).abs().max() > 1e-2


class TestServed(ServedInEveryTopology):
    pass


@pytest.mark.slow
def test_kv_wire_carries_the_mrope_delta_when_it_is_not_zero(dep, ours):
    deltas = []
    for case in ("text", "one-image"):
        delta = ours.process_chat(chat_messages(case, urls=False), media(case)).mrope_position_delta
        kv = prefill_kv_params(dep["pd"], case)
        assert ("mrope_position_delta" in kv) == (delta != 0), case
        assert kv.get("mrope_position_delta", 0) == delta
        deltas.append(delta)
    assert deltas[0] == 0 and deltas[1] != 0
