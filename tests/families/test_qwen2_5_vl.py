"""Qwen2.5-VL against ``transformers``' own classes, then served end to end.

The checkpoint is a tiny random one written by ``Qwen2_5_VLForConditionalGeneration``
and Qwen2.5-VL's processor (``conftest.write_qwen2_5_vl``). Our processor must
give the token ids, pixels, grids and M-RoPE positions that ``transformers``'
processor and ``get_rope_index`` give; a served greedy chat must produce the
tokens of ``generate(do_sample=False)``, aggregated, E+PD and E+P+D.
"""

from __future__ import annotations

import pytest
from transformers import Qwen2_5_VLForConditionalGeneration

from .conftest import load_hf_processor
from .flows import CASES, ServedInEveryTopology, check_qwen_processor, family_fixtures

ours, hf, dep = family_fixtures(
    "qwen2_5_vl_dir", Qwen2_5_VLForConditionalGeneration, load_hf_processor
)


@pytest.mark.parametrize("case", CASES)
def test_processor_and_rope_index_match_transformers(ours, hf, case):
    check_qwen_processor(ours, hf, case, lambda ids, image_token, ref: (ids == image_token).int())


class TestServed(ServedInEveryTopology):
    pass
