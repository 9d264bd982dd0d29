"""Qwen2.5-VL video against ``transformers``' own classes, then served aggregated.

The checkpoint is a tiny random one written by ``Qwen2_5_VLForConditionalGeneration``
(``conftest.write_qwen2_5_vl``, ``tokens_per_second`` 2) with a
``video_preprocessor_config.json`` (``Qwen2VLVideoProcessor``, as Qwen2.5-VL's
checkpoints have). ``Qwen2_5_VLProcessor`` gets the sampled frames with their
metadata (the clip's rate and frame count, the sampled indices), so its
``second_per_grid_ts`` is ``2 / sampled_fps``; our processor must give its ids,
pixels and grids, and ``get_rope_index``'s absolute-time positions (the temporal
index scaled by ``tokens_per_second * second_per_grid_ts``). The clip has 12
frames at 4 fps (84x56): 8 frames sampled are 2.67 fps (interval 1.5, four
temporal patches: the temporal index sets the decode delta), 3 frames 1 fps
(interval 4), all 12 frames 4 fps (interval 1, beside an image).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from ec_frontend.connectors.ec_item_params import item_fields
from ec_frontend.model.errors import InputError
from ec_frontend.model.processor import InputProcessor
from transformers import Qwen2_5_VLForConditionalGeneration

from ..helpers.processes import Proc
from ..helpers.video import make_clip
from .conftest import image_bytes, write_qwen2_5_vl
from .video_flows import (
    Case,
    check_image_and_rope_index,
    check_served,
    process,
    ref_inputs,
    video_fixtures,
    write_qwen2_video_config,
)

pytestmark = pytest.mark.slow

CASES: dict[str, Case] = {
    "video-8": (False, {"num_frames": 8}, "What happens in this clip?"),
    "video-3": (False, {"num_frames": 3}, "What happens in this clip?"),
    "image+video": (True, None, "Compare the picture with the clip."),
}

reference, hf_model, ours, server = video_fixtures(
    CASES, Qwen2_5_VLForConditionalGeneration, "qwen2_5_vl"
)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(frames=12, width=84, height=56, gop=4)


@pytest.fixture(scope="module")
def png() -> bytes:
    return image_bytes(84, 56, seed=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_video"))
    write_qwen2_video_config(directory)
    return directory


@pytest.mark.parametrize("name", CASES)
def test_processor_and_absolute_time_rope_match_transformers(
    ours: InputProcessor, hf_model: Any, reference: Any, clip: bytes, png: bytes, name: str
) -> None:
    mine = process(ours, CASES[name], clip, png)
    ref = ref_inputs(reference, name)
    assert mine.prompt_token_ids == ref["input_ids"][0].tolist()
    video = mine.mm_features[-1]
    assert [list(video.image_grid_thw)] == ref["video_grid_thw"].tolist()
    assert video.pixel_values is not None
    torch.testing.assert_close(video.pixel_values, ref["pixel_values_videos"], atol=0, rtol=0)
    check_image_and_rope_index(mine, hf_model, ref)


def test_the_cases_cover_scaled_and_unscaled_time(reference: Any) -> None:
    """``second_per_grid_ts`` is 2 / sampled fps: 0.75, 2 and 0.5 here, so the
    interval (times ``tokens_per_second`` 2) is 1.5, 4 and 1."""
    got = [float(reference[f"{name}/second_per_grid_ts"][0]) for name in CASES]
    assert got == pytest.approx([0.75, 2.0, 0.5])


@pytest.mark.parametrize("name", CASES)
def test_served_greedy_matches_transformers_generate(
    server: Proc, hf_model: Any, reference: Any, clip: bytes, png: bytes, name: str
) -> None:
    check_served(server, hf_model, reference, CASES[name], name, clip, png)


def test_no_video_grid_is_published_and_a_reference_is_refused(
    ours: InputProcessor, clip: bytes, png: bytes
) -> None:
    """Qwen2.5-VL places a video by its frame times, which a ``video_embeds``
    reference does not carry: an encoder's entry has no metadata (both EPD proxies
    then send the video itself) and a reference is a 400 ``invalid_video_embeds``."""
    video = process(ours, CASES["video-8"], clip, png).mm_features[-1]
    entry = item_fields([video])[video.mm_hash]
    assert (entry["modality"], entry["metadata"]) == ("video", {})
    ref = SimpleNamespace(mm_hash=video.mm_hash, video_grid_thw=video.image_grid_thw, data=None)
    content = [{"type": "video", "media_index": 0}, {"type": "text", "text": "x"}]
    with pytest.raises(InputError) as exc:
        ours.process_chat([{"role": "user", "content": content}], [ref])
    assert exc.value.code == "invalid_video_embeds" and "frame times" in str(exc.value)
