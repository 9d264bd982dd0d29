"""Qwen3-VL video against ``transformers``' own classes, then served aggregated.

The checkpoint is a tiny random one written by ``Qwen3VLForConditionalGeneration``
(``conftest.write_qwen3_vl``: 16-pixel patches, DeepStack) with a
``video_preprocessor_config.json`` of ``Qwen3VLVideoProcessor`` (mean and std 0.5,
a pixel range over all the frames of a video). ``Qwen3VLProcessor`` gets the
sampled frames with their metadata and writes ``<t seconds>`` before each
temporal patch (``<|vision_start|>`` patch tokens ``<|vision_end|>``); our
processor must give its ids (timestamps included), pixels and grids, and
``get_rope_index``'s positions, where each patch is placed as an image. The clip
has 8 frames at 4 fps (96x64, no resize): 4 frames sampled are two patches at
0.2 s and 1.4 s, 3 frames are padded to 4 (0.4 s, 1.8 s), all 8 frames are four
patches beside an image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.model.errors import InputError
from ec_frontend.model.processor import InputProcessor
from ec_frontend.model.video_processor import qwen3_smart_resize
from transformers import PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

from ..helpers.processes import Proc
from ..helpers.video import make_clip
from .conftest import image_bytes, write_qwen3_vl
from .video_flows import (
    Case,
    check_image_and_rope_index,
    check_served,
    process,
    ref_inputs,
    video_fixtures,
    write_video_config,
)

pytestmark = pytest.mark.slow

CASES: dict[str, Case] = {
    "video-4": (False, {"num_frames": 4}, "What happens in this clip?"),
    "video-3": (False, {"num_frames": 3}, "What happens in this clip?"),
    "image+video": (True, None, "Compare the picture with the clip."),
}

reference, hf_model, ours, server = video_fixtures(
    CASES, Qwen3VLForConditionalGeneration, "qwen3_vl"
)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(frames=8, width=96, height=64, gop=3)


@pytest.fixture(scope="module")
def png() -> bytes:
    return image_bytes(96, 64, seed=7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_video"))
    write_video_config(
        directory,
        video_processor_type="Qwen3VLVideoProcessor",
        size={"shortest_edge": 4096, "longest_edge": 65536},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        rescale_factor=1 / 255,
        resample=3,
    )
    return directory


@pytest.mark.parametrize("name", CASES)
def test_processor_timestamps_and_rope_match_transformers(
    ours: InputProcessor, hf_model: Any, reference: Any, clip: bytes, png: bytes, name: str
) -> None:
    mine = process(ours, CASES[name], clip, png)
    ref = ref_inputs(reference, name)
    assert mine.prompt_token_ids == ref["input_ids"][0].tolist()
    (t, h, w) = ref["video_grid_thw"][0].tolist()
    patches = mine.mm_features[-t:]
    assert [f.image_grid_thw for f in patches] == [(1, h, w)] * t
    assert len({f.mm_hash for f in patches}) == t
    pixels = torch.cat([f.pixel_values for f in patches if f.pixel_values is not None])
    torch.testing.assert_close(pixels, ref["pixel_values_videos"], atol=0, rtol=0)
    check_image_and_rope_index(mine, hf_model, ref)


def test_the_prompt_carries_each_patch_time(model_dir: Path, reference: Any) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    text = tok.decode(reference["video-3/input_ids"][0])
    assert "<0.4 seconds><|vision_start|><|video_pad|>" in text
    assert "<|vision_end|><1.8 seconds><|vision_start|>" in text


def test_a_one_frame_video_is_refused_as_transformers_refuses_it(
    ours: InputProcessor, clip: bytes, png: bytes
) -> None:
    with pytest.raises(InputError) as err:
        process(ours, (False, {"num_frames": 1}, "?"), clip, png)
    assert err.value.code == "invalid_video"
    assert "at least 2 frames" in str(err.value)
    assert err.value.param == "messages[0].content[0].video_url"


@pytest.mark.parametrize("name", CASES)
def test_served_greedy_matches_transformers_generate(
    server: Proc, hf_model: Any, reference: Any, clip: bytes, png: bytes, name: str
) -> None:
    check_served(server, hf_model, reference, CASES[name], name, clip, png)


@pytest.mark.parametrize(
    ("frames", "height", "width"),
    # within the range, over it (shrunk), under it (grown), smaller than a merge
    # window (scaled up first), an odd frame count, a tall frame
    [(4, 64, 96), (32, 720, 1280), (2, 40, 40), (8, 20, 30), (5, 250, 170), (3, 3000, 40)],
)
def test_target_size_equals_transformers_smart_resize(frames, height, width):
    kwargs = {"temporal_factor": 2, "factor": 32, "min_pixels": 4096, "max_pixels": 65536}
    assert qwen3_smart_resize(frames, height, width, **kwargs) == smart_resize(
        frames, height, width, **kwargs
    )
