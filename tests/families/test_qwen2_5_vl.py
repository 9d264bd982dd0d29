"""Qwen2.5-VL against ``transformers``' own classes, then served end to end.

The checkpoint is a tiny random one written by ``Qwen2_5_VLForConditionalGeneration``
and Qwen2.5-VL's processor (``conftest.write_qwen2_5_vl``). Our processor must
give the token ids, pixels, grids and M-RoPE positions that ``transformers``'
processor and ``get_rope_index`` give; a served greedy chat must produce the
tokens of ``generate(do_sample=False)``, aggregated, E+PD and E+P+D.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.model.loader import load_processor
from ec_frontend.model.processor import InputProcessor
from transformers import Qwen2_5_VLForConditionalGeneration

from ..helpers.processes import Proc
from .conftest import load_hf_processor
from .flows import (
    CASES,
    chat_messages,
    check_disaggregated_parts,
    check_served_equals,
    deployment,
    hf_generate,
    hf_inputs,
    media,
)


@pytest.fixture(scope="module")
def ours(qwen2_5_vl_dir: Path) -> InputProcessor:
    return load_processor(qwen2_5_vl_dir)


@pytest.fixture(scope="module")
def hf(qwen2_5_vl_dir: Path) -> tuple[Any, Qwen2_5_VLForConditionalGeneration]:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_dir, dtype=torch.float32)
    return load_hf_processor(qwen2_5_vl_dir), model.eval()


@pytest.mark.parametrize("case", CASES)
def test_processor_and_rope_index_match_transformers(ours, hf, case):
    hf_processor, hf_model = hf
    mine = ours.process_chat(chat_messages(case, urls=False), media(case))
    ref = hf_inputs(hf_processor, case)
    ids = ref["input_ids"]
    assert mine.prompt_token_ids == ids[0].tolist()
    image_token = hf_model.config.image_token_id
    placeholders = [f.length for f in mine.mm_features]
    grids = ref.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.int64))
    assert placeholders == (grids.prod(-1) // 4).tolist()
    assert sum(placeholders) == int((ids == image_token).sum())
    assert [list(f.image_grid_thw) for f in mine.mm_features] == grids.tolist()
    if mine.mm_features:
        pixels = torch.cat([f.pixel_values for f in mine.mm_features])
        torch.testing.assert_close(pixels, ref["pixel_values"], atol=0, rtol=0)
    positions, delta = hf_model.model.get_rope_index(
        ids, (ids == image_token).int(), image_grid_thw=grids if len(grids) else None
    )
    assert torch.equal(mine.mrope_positions, positions[:, 0])
    assert mine.mrope_position_delta == int(delta)


@pytest.fixture(scope="module")
def dep(qwen2_5_vl_dir: Path) -> Iterator[dict[str, Proc]]:
    with deployment(qwen2_5_vl_dir) as procs:
        yield procs


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_served_greedy_matches_transformers_generate_in_every_topology(dep, hf, case):
    check_served_equals(dep, case, hf_generate(*hf, case))


@pytest.mark.slow
def test_disaggregated_instances_did_their_part_only(dep):
    check_disaggregated_parts(dep, (70, 42))
