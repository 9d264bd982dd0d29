"""LLaVA-OneVision video against ``transformers``' own classes, then served aggregated.

The checkpoint is the family's tiny random one (``conftest.write_llava_onevision``:
SigLIP on 56-pixel tiles, 4x4 features a tile) with a ``<video>`` token and a
``LlavaOnevisionVideoProcessor`` config. ``LlavaOnevisionProcessor`` with that
video processor gets the frames our decoder sampled: our processor must give its
ids (``frames * 2 * 2 + 1`` ``<video>`` tokens: each frame's 4x4 features pooled to
2x2, one ``image_newline`` after the video), its pixels (exactly: the clip's
frames are one tile, so neither side resamples), our encoder the rows of
``get_video_features``, and a server the greedy tokens of ``generate``:
aggregated, and through E+PD and E+P+D behind ``ec-frontend proxy``, where
prefill / decode place a ``video_embeds`` reference from the grid the encoder
published (``[frames, 56, 56]``) and decode no video. The image beside a video
stays an image alone in its prompt (anyres tiles), as ``transformers`` and vLLM
0.33 have it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from ec_frontend.connectors.ec_item_params import item_fields
from ec_frontend.model.errors import InputError
from ec_frontend.model.llava_onevision import VIDEO
from ec_frontend.model.loader import load_model, load_processor
from ec_frontend.model.processor import InputProcessor
from ec_frontend.model.video_processor import LlavaOnevisionVideoRule
from transformers import AutoImageProcessor, LlavaOnevisionForConditionalGeneration
from transformers.image_transforms import resize
from transformers.image_utils import PILImageResampling

from ..helpers.processes import Proc
from ..helpers.video import frame_rgb, make_clip
from .conftest import LLAVA_IMAGE_SIZE, image_bytes, write_llava_onevision
from .video_flows import (
    Case,
    chat,
    check_served,
    deployment_fixtures,
    hf_generate,
    process,
    ref_inputs,
    template_messages,
    video_data_url,
    video_fixtures,
)

pytestmark = pytest.mark.slow

#: Pooled features per frame: the 4x4 map of a 56-pixel tile halved.
PER_FRAME = 2 * 2

CASES: dict[str, Case] = {
    "video-4": (False, {"num_frames": 4}, "What happens in this clip?"),
    "image+video": (True, None, "Compare the picture with the clip."),
}

reference, hf_model, ours, _ = video_fixtures(
    CASES, LlavaOnevisionForConditionalGeneration, "llava_onevision"
)
# Aggregated, E+PD and E+P+D behind ``ec-frontend proxy``; the aggregated server is its.
dep, server = deployment_fixtures()


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(frames=6, width=LLAVA_IMAGE_SIZE, height=LLAVA_IMAGE_SIZE, gop=3)


@pytest.fixture(scope="module")
def png() -> bytes:
    return image_bytes(84, 56, seed=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llava_onevision(tmp_path_factory.mktemp("llava_onevision_video"))


@pytest.mark.parametrize("name", CASES)
def test_processor_matches_transformers(
    ours: InputProcessor, hf_model: Any, reference: Any, clip: bytes, png: bytes, name: str
) -> None:
    mine = process(ours, CASES[name], clip, png)
    ref = ref_inputs(reference, name)
    ids = ref["input_ids"][0]
    assert mine.prompt_token_ids == ids.tolist()
    video = mine.mm_features[-1]
    frames = ref["pixel_values_videos"].shape[1]
    assert frames == (4 if name == "video-4" else 6)
    assert video.image_grid_thw == (VIDEO, frames, 1)
    assert video.mm_hash == "bb"
    video_token = hf_model.config.video_token_id
    assert video.length == frames * PER_FRAME + 1 == int((ids == video_token).sum())
    assert ids[video.offset : video.offset + video.length].eq(video_token).all()
    assert video.pixel_values is not None
    torch.testing.assert_close(video.pixel_values, ref["pixel_values_videos"][0], atol=0, rtol=0)
    if CASES[name][0]:
        image = mine.mm_features[0]
        assert image.mm_hash == "aa"  # alone: the image's own key, not one of several
        assert image.image_grid_thw == (1, *ref["image_sizes"][0].tolist())
        tiles = image.pixel_values.shape[0]
        torch.testing.assert_close(
            image.pixel_values, ref["pixel_values"][0, :tiles], atol=0, rtol=0
        )
        assert image.length == int((ids == hf_model.config.image_token_id).sum())
    n = len(ids)
    assert torch.equal(mine.mrope_positions, torch.arange(n).expand(3, n))
    assert mine.mrope_position_delta == 0


def test_the_published_grid_places_a_reference_as_the_video(
    ours: InputProcessor, clip: bytes, png: bytes
) -> None:
    """An encoder's entry for a LLaVA-OneVision video carries ``video_grid_thw =
    [frames, tile height, tile width]``; a ``video_embeds`` reference with it gets the
    video's prompt and placeholder with nothing decoded; a grid this rule cannot give
    (another tile, more frames than ``--max-video-frames``) is a 400, not a 500."""
    for name in CASES:
        mine = process(ours, CASES[name], clip, png)
        video = mine.mm_features[-1]
        frames = video.image_grid_thw[1]
        entry = item_fields([video])[video.mm_hash]
        grid = [frames, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE]
        assert (entry["modality"], entry["metadata"]) == ("video", {"video_grid_thw": grid})
        media: list[Any] = [
            SimpleNamespace(mm_hash=f.mm_hash, image_grid_thw=f.image_grid_thw, data=None)
            for f in mine.mm_features[:-1]
        ] + [SimpleNamespace(mm_hash=video.mm_hash, video_grid_thw=grid, data=None)]
        placed = ours.process_chat(template_messages(CASES[name]), media)
        assert placed.prompt_token_ids == mine.prompt_token_ids
        got = placed.mm_features[-1]
        assert (got.offset, got.length, got.image_grid_thw) == (
            video.offset,
            frames * PER_FRAME + 1,
            (VIDEO, frames, 1),
        )
        assert got.pixel_values is None
    most = ours.video_limits.max_frames
    for bad in ([4, LLAVA_IMAGE_SIZE // 2, LLAVA_IMAGE_SIZE], [most + 1, *grid[1:]]):
        ref = SimpleNamespace(mm_hash="bb", video_grid_thw=bad, data=None)
        content = [{"type": "video", "media_index": 0}, {"type": "text", "text": "x"}]
        with pytest.raises(InputError) as exc:
            ours.process_chat([{"role": "user", "content": content}], [ref])
        assert exc.value.code == "invalid_video_embeds" and "video_embeds" in str(exc.value)


def test_encoder_matches_get_video_features(
    model_dir: Path, ours: InputProcessor, hf_model: Any, reference: Any, clip: bytes, png: bytes
) -> None:
    """The image and the video of a prompt in one tower call: the video's rows are
    ``get_video_features``' (pooled frames, then the newline), the image's
    ``get_image_features``'."""
    model = load_model(model_dir, device="cpu", dtype="float32", load_language=False)
    mine = process(ours, CASES["image+video"], clip, png)
    pixels = torch.cat([f.pixel_values for f in mine.mm_features])
    grids = torch.tensor([f.image_grid_thw for f in mine.mm_features])
    image, video = model.encode_images(pixels, grids)
    ref = ref_inputs(reference, "image+video")
    config = hf_model.config
    with torch.no_grad():
        want_video = hf_model.model.get_video_features(
            pixel_values_videos=ref["pixel_values_videos"],
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        ).pooler_output[0]
        want_image = hf_model.model.get_image_features(
            pixel_values=ref["pixel_values"],
            image_sizes=ref["image_sizes"],
            batch_num_images=ref["batch_num_images"],
        ).pooler_output[0]
    assert video.shape == (6 * PER_FRAME + 1, config.text_config.hidden_size)
    torch.testing.assert_close(video, want_video, atol=1e-5, rtol=0)
    torch.testing.assert_close(image, want_image, atol=1e-5, rtol=0)


def test_resized_frames_equal_transformers_pil_resize(model_dir: Path) -> None:
    """Frames of another size are resized to the tile as transformers' PIL backend
    resizes (bicubic; its torchvision video backend rounds some pixels differently:
    ``docs/video.md``), then normalized by the checkpoint's mean and std."""
    rule = LlavaOnevisionVideoRule.from_checkpoint(model_dir, None)
    assert (rule.height, rule.width) == (LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE)
    frames = np.stack([frame_rgb(i, 84, 70) for i in range(3)])
    grid, pixels = rule.preprocess(frames, index=0)
    assert grid == (VIDEO, 3, 1)
    side = (LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE)
    resized = np.stack(
        [resize(f, side, resample=PILImageResampling.BICUBIC, reducing_gap=None) for f in frames]
    )
    want = torch.from_numpy(resized).permute(0, 3, 1, 2).to(torch.float32)
    mean = torch.tensor(rule.image_mean)[:, None, None] * 255
    std = torch.tensor(rule.image_std)[:, None, None] * 255
    torch.testing.assert_close(pixels, (want - mean) / std, atol=0, rtol=0)
    assert not torch.equal(pixels[0], pixels[2])


def test_without_a_video_config_the_image_processor_gives_the_tile(
    model_dir: Path, tmp_path: Path
) -> None:
    """As transformers reads the image processor's config when a checkpoint has no
    video processor config."""
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    with_config = LlavaOnevisionVideoRule.from_checkpoint(model_dir, image_processor)
    assert LlavaOnevisionVideoRule.from_checkpoint(tmp_path, image_processor) == with_config
    assert (with_config.height, with_config.width) == (LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE)


def test_families_without_a_video_path_refuse_video(llava_next_dir: Path, clip: bytes) -> None:
    next_processor = load_processor(llava_next_dir)
    with pytest.raises(InputError, match="does not take video") as raised:
        process(next_processor, CASES["video-4"], clip, b"")
    assert raised.value.code == "unsupported_video"


@pytest.mark.parametrize("name", CASES)
def test_served_greedy_matches_transformers_generate(
    server: Proc, hf_model: Any, reference: Any, clip: bytes, png: bytes, name: str
) -> None:
    check_served(server, hf_model, reference, CASES[name], name, clip, png)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("front", ["E+PD", "E+P+D"])
def test_served_through_the_proxy_matches_generate_and_only_the_encoder_decodes(
    dep: dict[str, Proc],
    hf_model: Any,
    reference: Any,
    clip: bytes,
    png: bytes,
    front: str,
    name: str,
) -> None:
    """Behind ``ec-frontend proxy`` the encoder decodes and encodes the video and
    publishes its grid; prefill / decode get a ``video_embeds`` reference, load the
    encoder output (its rows checked against the placeholder the grid sizes) and give
    ``generate``'s tokens, decoding no video and computing no encoder item."""
    e, pd = dep["e"], dep["pd"]
    downstream = [pd, dep["d"]] if front == "E+P+D" else [pd]
    items = 2 if CASES[name][0] else 1
    want = hf_generate(hf_model, reference, name)
    decoded, computed = e.metric("videos_decoded_total"), e.metric("encoder_items_computed_total")
    loaded = pd.metric("ec_items_loaded_total")
    # A salt per topology: every item is new to the encoder and to prefill.
    r = chat(dep[front], CASES[name], video_data_url(clip), png, cache_salt=front)
    assert list((r.choices[0].model_extra or {})["token_ids"]) == want
    assert r.usage is not None
    assert r.usage.prompt_tokens == reference[f"{name}/input_ids"].shape[1]
    assert e.metric("videos_decoded_total") == decoded + 1
    assert e.metric("encoder_items_computed_total") == computed + items
    assert pd.metric("ec_items_loaded_total") == loaded + items
    assert pd.metric("ec_load_fallbacks_total") == 0
    for instance in downstream:
        for metric in ("videos_decoded_total", "encoder_items_computed_total"):
            assert instance.metric(metric) == 0, (instance.name, metric)


@pytest.mark.parametrize(
    "grid", [[4, LLAVA_IMAGE_SIZE, 2 * LLAVA_IMAGE_SIZE], [129, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE]]
)
def test_a_reference_this_model_cannot_have_published_is_a_400(
    dep: dict[str, Proc], grid: list[int]
) -> None:
    """Another tile size, or more frames than ``--max-video-frames`` (128): a 400
    ``invalid_video_embeds`` from the consumer, which stays healthy."""
    pd = dep["pd"]
    part = {"type": "video_embeds", "video_embeds": {"video_grid_thw": grid}, "uuid": "u"}
    content = [part, {"type": "text", "text": "x"}]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(pd.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_video_embeds", r.text
    assert httpx.get(pd.url + "/health", timeout=10).status_code == 200
