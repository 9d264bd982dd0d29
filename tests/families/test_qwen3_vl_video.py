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

Disaggregated, the encoder publishes each video as one entry (vLLM's proxy expects
one per item it sends): the video's ``video_grid_thw`` and ``timestamps`` (vLLM's
keys) as its metadata, the patch items' signed entries under ``patches``. Both
proxies turn the video into a ``video_embeds`` reference carrying both, and prefill
writes each patch's time from them and loads the patches through the EC connector:
the same prompt, the same tokens, no video decoded there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.connectors.ec_item_params import group_video_patches, item_fields
from ec_frontend.model.errors import InputError
from ec_frontend.model.processor import InputProcessor, ProcessedInputs
from ec_frontend.model.video_processor import qwen3_smart_resize
from transformers import PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

from ..helpers.processes import Proc
from ..helpers.video import make_clip
from .conftest import image_bytes, write_qwen3_vl
from .video_flows import (
    Case,
    Media,
    VideoReference,
    check_image_and_rope_index,
    check_only_the_encoder_decodes,
    check_reference_refused,
    check_served,
    deployment_fixtures,
    process,
    ref_inputs,
    template_messages,
    video_fixtures,
    write_qwen3_video_config,
)

pytestmark = pytest.mark.slow

CASES: dict[str, Case] = {
    "video-4": (False, {"num_frames": 4}, "What happens in this clip?"),
    "video-3": (False, {"num_frames": 3}, "What happens in this clip?"),
    "image+video": (True, None, "Compare the picture with the clip."),
}

reference, hf_model, ours, _ = video_fixtures(CASES, Qwen3VLForConditionalGeneration, "qwen3_vl")
# The aggregated server is the deployment's.
dep, server = deployment_fixtures()


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(frames=8, width=96, height=64, gop=3)


@pytest.fixture(scope="module")
def png() -> bytes:
    return image_bytes(96, 64, seed=7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_video"))
    write_qwen3_video_config(directory)
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


def published(mine: ProcessedInputs) -> tuple[str, dict[str, Any]]:
    """``(video mm_hash, entry)``: what an encoder publishes for the case's video (its
    patch items' fields grouped as a producer's connector output is), through JSON."""
    patches = [f for f in mine.mm_features if f.video_patch_of is not None]
    fields = item_fields(mine.mm_features)
    params = group_video_patches({f.mm_hash: dict(fields[f.mm_hash]) for f in patches},
                                 mine.mm_features)  # fmt: skip
    assert params is not None
    (video_hash,) = [h for h in params if h not in fields]
    return video_hash, json.loads(json.dumps(params[video_hash]))


def references(ours: InputProcessor, case: Case, clip: bytes, png: bytes) -> ProcessedInputs:
    """The case processed as a prefill instance gets it behind a proxy: the image as
    it is, the video as a ``video_embeds`` reference carrying its published metadata."""
    video_hash, entry = published(process(ours, case, clip, png))
    metadata = entry["metadata"]
    grid = tuple(metadata["video_grid_thw"])
    ref = VideoReference(video_hash, grid, None, timestamps=metadata["timestamps"])
    media: list[Any] = [Media(png, "aa", "messages[0].content[0].image_url", "image")]
    return ours.process_chat(
        template_messages(case),
        [*media[: int(case[0])], ref],
        media_io_kwargs={"video": case[1]} if case[1] else None,
    )


@pytest.mark.parametrize("name", CASES)
def test_the_video_is_published_as_one_entry_with_its_grid_and_times(
    ours: InputProcessor, model_dir: Path, reference: Any, clip: bytes, png: bytes, name: str
) -> None:
    """The grid is transformers' ``video_grid_thw``; each time is the one its processor
    wrote before that patch."""
    mine = process(ours, CASES[name], clip, png)
    video_hash, entry = published(mine)
    ref = ref_inputs(reference, name)
    (t, h, w) = ref["video_grid_thw"][0].tolist()
    assert entry["modality"] == "video"
    assert entry["item_indices"] == [int(CASES[name][0])]  # after the image, if any
    assert entry["metadata"]["video_grid_thw"] == [t, h, w]
    times = entry["metadata"]["timestamps"]
    assert len(times) == t
    text = PreTrainedTokenizerFast.from_pretrained(model_dir).decode(ref["input_ids"][0])
    written = "".join(f"<{seconds:.1f} seconds><|vision_start|>" for seconds in times)
    assert written.replace("<|vision_start|>", "") in text.replace("<|vision_start|>", "").replace(
        "<|video_pad|>", ""
    ).replace("<|vision_end|>", "")
    patches = [f.mm_hash for f in mine.mm_features if f.video_patch_of is not None]
    assert list(entry["patches"]) == patches
    assert all(f.video_patch_of.mm_hash == video_hash for f in mine.mm_features[-t:])


@pytest.mark.parametrize("name", CASES)
def test_a_reference_with_the_published_metadata_places_the_video_as_decoded(
    ours: InputProcessor, hf_model: Any, reference: Any, clip: bytes, png: bytes, name: str
) -> None:
    """A ``video_embeds`` reference with ``video_grid_thw`` and ``timestamps`` gives the
    decoded video's ids (each patch's time written from the timestamps), patch items
    and ``get_rope_index``'s positions, with no pixels."""
    decoded = process(ours, CASES[name], clip, png)
    placed = references(ours, CASES[name], clip, png)
    ref = ref_inputs(reference, name)
    assert placed.prompt_token_ids == decoded.prompt_token_ids == ref["input_ids"][0].tolist()
    assert torch.equal(placed.mrope_positions, decoded.mrope_positions)
    assert placed.mrope_position_delta == decoded.mrope_position_delta
    t = int(ref["video_grid_thw"][0][0])
    got, want = placed.mm_features[-t:], decoded.mm_features[-t:]
    assert [(f.mm_hash, f.offset, f.length) for f in got] == [
        (f.mm_hash, f.offset, f.length) for f in want
    ]
    assert all(f.pixel_values is None for f in got)
    ids = ref["input_ids"]
    config = hf_model.config
    types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    positions, delta = hf_model.model.get_rope_index(
        ids, types, image_grid_thw=ref.get("image_grid_thw"), video_grid_thw=ref["video_grid_thw"]
    )
    assert torch.equal(placed.mrope_positions, positions[:, 0])
    assert placed.mrope_position_delta == int(delta)


@pytest.mark.parametrize(
    ("times", "words"),
    [
        (None, "video_embeds.timestamps is missing"),
        ([0.5, 3600.5], "holds 3600.5, over 3600 s"),
    ],
)
def test_a_reference_without_usable_times_is_a_400_naming_the_field(
    ours: InputProcessor, times: list[float] | None, words: str
) -> None:
    ref = VideoReference("ab" * 32, (2, 4, 6), None, timestamps=times)
    content = [{"type": "video", "media_index": 0}, {"type": "text", "text": "x"}]
    with pytest.raises(InputError) as exc:
        ours.process_chat([{"role": "user", "content": content}], [ref])
    assert exc.value.code == "invalid_video_embeds", exc.value
    assert exc.value.param == "messages[0].content[0].video_embeds.timestamps"
    assert words in str(exc.value)


@pytest.mark.parametrize("topology", ["E+PD", "E+P+D"])
@pytest.mark.parametrize("name", CASES)
def test_served_through_each_proxy_topology_matches_transformers_generate(
    dep: dict[str, Proc],
    hf_model: Any,
    reference: Any,
    clip: bytes,
    png: bytes,
    name: str,
    topology: str,
) -> None:
    check_served(dep[topology], hf_model, reference, CASES[name], name, clip, png)


def test_only_the_encoder_decodes_and_encodes_the_video(
    dep: dict[str, Proc], clip: bytes, png: bytes
) -> None:
    """A fresh sampling of the clip (6 frames: three patches) through both topologies:
    the encoder decodes it and encodes its patches, ``pd`` loads them through the EC
    connector, and neither ``pd`` nor ``d`` decodes a video or computes an item."""
    check_only_the_encoder_decodes(dep, (False, {"num_frames": 6}, "And now?"), clip, png, 3)


def test_a_reference_without_times_is_a_400_from_the_server(dep: dict[str, Proc]) -> None:
    check_reference_refused(dep["pd"], {"video_grid_thw": [2, 4, 6]}, "timestamps")
