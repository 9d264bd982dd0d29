"""LLaVA-OneVision video against ``transformers``' own classes, then served aggregated.

The checkpoint is the family's tiny random one (``conftest.write_llava_onevision``:
SigLIP on 56-pixel tiles, 4x4 features a tile) with a ``<video>`` token and a
``LlavaOnevisionVideoProcessor`` config. ``LlavaOnevisionProcessor`` with that
video processor gets the frames our decoder sampled: our processor must give its
ids (``frames * 2 * 2 + 1`` ``<video>`` tokens: each frame's 4x4 features pooled to
2x2, one ``image_newline`` after the video), its pixels (exactly: the clip's
frames are one tile, so neither side resamples), our encoder the rows of
``get_video_features``, and a server the greedy tokens of ``generate``. The image
beside a video stays an image alone in its prompt (anyres tiles), as
``transformers`` and vLLM 0.33 have it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
from .video_flows import Case, check_served, process, ref_inputs, video_fixtures

pytestmark = pytest.mark.slow

#: Pooled features per frame: the 4x4 map of a 56-pixel tile halved.
PER_FRAME = 2 * 2

CASES: dict[str, Case] = {
    "video-4": (False, {"num_frames": 4}, "What happens in this clip?"),
    "image+video": (True, None, "Compare the picture with the clip."),
}

reference, hf_model, ours, server = video_fixtures(
    CASES, LlavaOnevisionForConditionalGeneration, "llava_onevision"
)


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


def test_no_video_grid_is_published_and_a_reference_is_refused(
    ours: InputProcessor, clip: bytes, png: bytes
) -> None:
    """An encoder's entry for a LLaVA-OneVision video carries no grid (the proxies then
    send the video itself), and a ``video_embeds`` reference is a 400, not a 500."""
    video = process(ours, CASES["video-4"], clip, png).mm_features[-1]
    entry = item_fields([video])[video.mm_hash]
    assert (entry["modality"], entry["metadata"]) == ("video", {})
    ref = SimpleNamespace(mm_hash=video.mm_hash, video_grid_thw=video.image_grid_thw, data=None)
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
