"""Qwen2.5-VL video against ``transformers``' own classes, then served aggregated,
E+PD and E+P+D behind ``ec-frontend proxy``.

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

Disaggregated, the encoder publishes each video's ``video_grid_thw`` and
``second_per_grid_ts`` (vLLM's metadata keys); the proxy rewrites the video into a
``video_embeds`` reference carrying both, and prefill / decode place it from them
with the aggregated path's float32 scale, loading its encoder output through the EC
connector: the same positions, the same tokens, no video decoded there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.connectors.ec_item_params import item_fields
from ec_frontend.model.errors import InputError
from ec_frontend.model.processor import InputProcessor, ProcessedInputs
from transformers import Qwen2_5_VLForConditionalGeneration

from ..helpers.processes import Proc
from ..helpers.video import make_clip
from .conftest import image_bytes, write_qwen2_5_vl
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
    write_qwen2_video_config,
)

pytestmark = pytest.mark.slow

CASES: dict[str, Case] = {
    "video-8": (False, {"num_frames": 8}, "What happens in this clip?"),
    "video-3": (False, {"num_frames": 3}, "What happens in this clip?"),
    "image+video": (True, None, "Compare the picture with the clip."),
}

reference, hf_model, ours, _ = video_fixtures(
    CASES, Qwen2_5_VLForConditionalGeneration, "qwen2_5_vl"
)
# The aggregated server is the deployment's.
dep, server = deployment_fixtures()


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


def references(ours: InputProcessor, case: Case, clip: bytes, png: bytes) -> ProcessedInputs:
    """The case processed as a prefill / decode instance gets it behind a proxy: the
    image as it is, the video as a ``video_embeds`` reference carrying the metadata
    its encoder published (through :func:`item_fields`, a JSON round trip)."""
    video = process(ours, case, clip, png).mm_features[-1]
    metadata = json.loads(json.dumps(item_fields([video])[video.mm_hash]["metadata"]))
    assert metadata == {
        "video_grid_thw": list(video.image_grid_thw),
        "second_per_grid_ts": [video.second_per_grid_ts],
    }
    (seconds,) = metadata["second_per_grid_ts"]
    ref = VideoReference(video.mm_hash, tuple(metadata["video_grid_thw"]), seconds)
    media: list[Any] = [Media(png, "aa", "messages[0].content[0].image_url", "image")]
    return ours.process_chat(
        template_messages(case),
        [*media[: int(case[0])], ref],
        media_io_kwargs={"video": case[1]} if case[1] else None,
    )


@pytest.mark.parametrize("name", CASES)
def test_a_reference_with_the_published_metadata_places_the_video_as_decoded(
    ours: InputProcessor, hf_model: Any, reference: Any, clip: bytes, png: bytes, name: str
) -> None:
    """The encoder publishes ``video_grid_thw`` and ``second_per_grid_ts`` (vLLM's
    list of one, the value transformers' processor gives in float32); a reference with
    them gives the decoded video's ids and ``get_rope_index``'s absolute-time
    positions, with no pixels."""
    decoded = process(ours, CASES[name], clip, png)
    video = decoded.mm_features[-1]
    ref = ref_inputs(reference, name)
    assert video.second_per_grid_ts is not None
    assert torch.tensor([video.second_per_grid_ts]).equal(ref["second_per_grid_ts"])
    placed = references(ours, CASES[name], clip, png)
    assert placed.prompt_token_ids == decoded.prompt_token_ids == ref["input_ids"][0].tolist()
    assert torch.equal(placed.mrope_positions, decoded.mrope_positions)
    assert placed.mrope_position_delta == decoded.mrope_position_delta
    assert placed.mm_features[-1].pixel_values is None
    assert placed.mm_features[-1].mm_hash == video.mm_hash
    positions, delta = hf_model.model.get_rope_index(
        ref["input_ids"],
        (ref["input_ids"] == hf_model.config.image_token_id).int()
        + 2 * (ref["input_ids"] == hf_model.config.video_token_id).int(),
        image_grid_thw=ref.get("image_grid_thw"),
        video_grid_thw=ref["video_grid_thw"],
        second_per_grid_ts=ref["second_per_grid_ts"],
    )
    assert torch.equal(placed.mrope_positions, positions[:, 0])
    assert placed.mrope_position_delta == int(delta)


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (None, "video_embeds.second_per_grid_ts is missing"),
        # Two frames an hour apart (--max-video-duration 3600) give 2 * 3600 at most.
        (7200.5, "over 7200.0 seconds"),
    ],
)
def test_a_reference_without_usable_frame_times_is_a_400_naming_the_field(
    ours: InputProcessor, seconds: float | None, words: str
) -> None:
    ref = VideoReference("ab" * 32, (4, 4, 6), seconds)
    content = [{"type": "video", "media_index": 0}, {"type": "text", "text": "x"}]
    with pytest.raises(InputError) as exc:
        ours.process_chat([{"role": "user", "content": content}], [ref])
    assert exc.value.code == "invalid_video_embeds", exc.value
    assert exc.value.param == "messages[0].content[0].video_embeds.second_per_grid_ts"
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
    """Behind ``ec-frontend proxy`` the video reaches prefill / decode as a
    ``video_embeds`` reference with its grid and ``second_per_grid_ts``: the answer
    is ``generate``'s."""
    check_served(dep[topology], hf_model, reference, CASES[name], name, clip, png)


def test_only_the_encoder_decodes_and_encodes_the_video(
    dep: dict[str, Proc], clip: bytes, png: bytes
) -> None:
    """A fresh sampling of the clip through both topologies: the encoder decodes and
    encodes it, ``pd`` loads it through the EC connector, and neither ``pd`` nor ``d``
    decodes a video or computes an encoder item."""
    check_only_the_encoder_decodes(dep, (False, {"num_frames": 6}, "And now?"), clip, png, 1)


def test_a_reference_without_frame_times_is_a_400_from_the_server(dep: dict[str, Proc]) -> None:
    check_reference_refused(dep["pd"], {"video_grid_thw": [4, 4, 6]}, "second_per_grid_ts")
