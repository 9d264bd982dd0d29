"""Qwen2-VL video against ``transformers``' own classes, then served end to end.

The checkpoint is a tiny random one written by ``Qwen2VLForConditionalGeneration``
(``conftest.write_qwen2_vl``) with a ``video_preprocessor_config.json``. Videos are
clips written by PyAV in the test; our decoder samples them
(``media_io_kwargs``), and ``transformers``' ``Qwen2VLProcessor`` with its video
processor (run with the test-only torchvision, ``video_reference.py``) processes
the same frames. Our processor must give its token ids, ``pixel_values_videos``,
``video_grid_thw`` and ``get_rope_index``'s M-RoPE positions; a greedy chat served
by ``ec-frontend serve`` through the ``openai`` client must produce the tokens of
``generate(do_sample=False)``, for a video prompt and an image+video prompt, and
one video sampled two ways must be two encoder items, each giving the output of
its own frames. Bad videos get a 400 naming the part and leave the server healthy.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ec_frontend.metrics import VIDEO_FRAMES_DECODED
from ec_frontend.model.errors import InputError
from ec_frontend.model.loader import load_processor
from ec_frontend.model.processor import InputProcessor
from transformers import Qwen2VLForConditionalGeneration

from ..disagg.conftest import serve
from ..helpers.processes import Proc, start_all
from ..helpers.video import make_audio_only, make_clip, make_empty_video, make_png_video
from .conftest import image_bytes, write_qwen2_vl
from .video_flows import (
    Case,
    VideoReference,
    check_image_and_rope_index,
    check_served,
    hf_generate,
    process,
    ref_inputs,
    video_data_url,
    video_fixtures,
    write_qwen2_video_config,
)
from .video_flows import chat as chat_case

pytestmark = pytest.mark.slow

#: name -> (with an image, media_io_kwargs["video"] or None, text). The clip has 8
#: frames of 84x56 at 4 fps; 4 frames -> grid (2, 4, 6), the default 32 -> all 8.
CASES: dict[str, Case] = {
    "video": (False, {"num_frames": 4}, "What happens in this clip?"),
    "video-6": (False, {"num_frames": 6}, "What happens in this clip?"),
    "image+video": (True, None, "Compare the picture with the clip."),
}

# Qwen2-VL's processor needs no video metadata; the server here serves local files too.
reference, hf_model, ours, _ = video_fixtures(CASES, Qwen2VLForConditionalGeneration)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(frames=8, width=84, height=56, gop=3)


@pytest.fixture(scope="module")
def png() -> bytes:
    return image_bytes(84, 56, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl_video"))
    write_qwen2_video_config(directory)
    return directory


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory, clip: bytes) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "clip.mp4").write_bytes(clip)
    return root


#: At most 12 frames; an encoder cache of 32 rows (the cases' items take 6 to 24; 12
#: frames of the clip's size, 36, are over it).
SERVER_LIMITS = ["--max-video-frames", "12", "--encoder-cache-size", "32",
                 "--max-num-batched-tokens", "32"]  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir: Path, media_root: Path) -> Iterator[Proc]:
    (proc,) = start_all(
        [
            serve(
                model_dir,
                "video",
                extra=["--allowed-local-media-path", str(media_root), *SERVER_LIMITS],
            )
        ]
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("case", CASES)
def test_processor_and_rope_index_match_transformers(
    ours: InputProcessor, hf_model: Any, reference: Any, clip: bytes, png: bytes, case: str
) -> None:
    mine = process(ours, CASES[case], clip, png)
    ref = ref_inputs(reference, case)
    ids = ref["input_ids"]
    assert mine.prompt_token_ids == ids[0].tolist()
    video_feature = mine.mm_features[-1]
    assert [list(video_feature.image_grid_thw)] == ref["video_grid_thw"].tolist()
    video_token = hf_model.config.video_token_id
    assert video_feature.length == int((ids == video_token).sum())
    assert (
        ids[0, video_feature.offset : video_feature.offset + video_feature.length]
        .eq(video_token)
        .all()
    )
    assert video_feature.pixel_values is not None
    torch.testing.assert_close(
        video_feature.pixel_values, ref["pixel_values_videos"], atol=0, rtol=0
    )
    check_image_and_rope_index(mine, hf_model, ref)


def chat(server: Proc, case: str, video_url: str, png: bytes, **extra: Any) -> Any:
    return chat_case(server, CASES[case], video_url, png, **extra)


def computed(server: Proc) -> float:
    return server.metrics().get("ec_frontend_encoder_items_computed_total", 0.0)


@pytest.mark.parametrize("case", CASES)
def test_served_greedy_matches_transformers_generate(
    server: Proc, hf_model: Any, reference: Any, clip: bytes, png: bytes, case: str
) -> None:
    check_served(server, hf_model, reference, CASES[case], case, clip, png)


def test_one_video_sampled_two_ways_is_two_items(
    server: Proc, hf_model: Any, reference: Any, clip: bytes, png: bytes, media_root: Path
) -> None:
    """A fresh video (another clip) at 4 and at 6 frames: two encodes, and a repeat of
    either is an encoder-cache hit; the same bytes by ``file://`` URL key as inline."""
    other = make_clip(frames=8, width=84, height=56, gop=2)  # other bytes than ``clip``
    (media_root / "other.mp4").write_bytes(other)
    before = computed(server)
    four = chat(server, "video", video_data_url(other), png)
    six = chat(server, "video-6", video_data_url(other), png)
    assert computed(server) - before == 2
    again = chat(server, "video", f"file://{media_root / 'other.mp4'}", png)
    assert computed(server) - before == 2
    tokens = [list((r.choices[0].model_extra or {})["token_ids"]) for r in (four, six, again)]
    assert tokens[0] == tokens[2]
    # With the frames of ``clip``, each sampling gives transformers' output for its frames.
    for case in ("video", "video-6"):
        r = chat(server, case, f"file://{media_root / 'clip.mp4'}", png)
        assert list((r.choices[0].model_extra or {})["token_ids"]) == hf_generate(
            hf_model, reference, case
        )


def b64_video(data: bytes) -> dict[str, str]:
    return {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}


#: name -> (the part, built when the test runs; code; words in the message).
BAD_VIDEOS: dict[str, tuple[Callable[[], dict[str, str]], str, str]] = {
    "random-bytes": (lambda: b64_video(b"\x00" * 512), "invalid_video", "not a readable video"),
    "audio-only": (lambda: b64_video(make_audio_only()), "invalid_video", "no video stream"),
    "truncated": (lambda: b64_video(make_clip(frames=8)[:700]), "invalid_video", "video"),
    "zero-frames": (lambda: b64_video(make_empty_video()), "invalid_video", "video"),
    "not-video-data-url": (
        lambda: {"url": "data:image/png;base64,AAAA"},
        "invalid_data_url",
        "video/*",
    ),
    # 16 frames sampled (the default num_frames is 32) over the server's 12.
    "too-many-frames": (
        lambda: b64_video(make_clip(frames=16)),
        "video_too_large",
        "--max-video-frames",
    ),
    # Two frames 12 hours apart: a header (and frame times) claiming 24 hours.
    "24-hours": (
        lambda: b64_video(make_clip(frames=2, rate=Fraction(1, 43200))),
        "video_too_long",
        "--max-video-duration",
    ),
    # A real 10000x10000 frame (300 MB as RGB) in a 580 KB file.
    "10000x10000": (
        lambda: b64_video(make_png_video(10_000, 10_000)),
        "video_too_large",
        "--max-video-frame-pixels",
    ),
    # 12 frames of 84x56 are one item of 36 rows, over the server's cache of 32: refused
    # before any frame is decoded.
    "over-the-encoder-cache": (
        lambda: b64_video(make_clip(frames=12)),
        "video_too_large",
        "encoder item of 36 rows; this instance's encoder cache holds 32 (--encoder-cache-size)",
    ),
    # 100 streams declaring 10000x10000 frames in 80 KB.
    "container-bomb": (
        lambda: b64_video(make_png_video(10_000, 10_000, streams=100, rows=2)),
        "video_too_large",
        "--max-video-frame-pixels",
    ),
}


@pytest.mark.parametrize("bad", BAD_VIDEOS)
def test_bad_videos_are_400s_naming_the_part_and_the_server_stays_healthy(
    server: Proc, png: bytes, clip: bytes, bad: str
) -> None:
    """The bad video and a good one at once: the bad one is a 400 naming the part, the
    good one is answered, and the server stays healthy."""
    build, code, words = BAD_VIDEOS[bad]
    parts = [{"type": "text", "text": "what?"}, {"type": "video_url", "video_url": build()}]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(chat, server, "video", video_data_url(clip), png)
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert good.result(timeout=120).choices[0].finish_reason in ("stop", "length")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("messages[0].content[1].video_url"), error
    assert error["code"] == code, error
    assert words in error["message"], error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_reference_is_placed_from_its_grid_and_frame_times_are_refused(
    ours: InputProcessor, clip: bytes, png: bytes
) -> None:
    """Qwen2-VL's positions take no absolute time: a reference with the grid alone is
    placed as the decoded video; one that also carries ``second_per_grid_ts`` (a
    Qwen2.5-VL encoder's metadata) is a 400 ``invalid_video_embeds`` naming it."""
    decoded = process(ours, CASES["video"], clip, png)
    video = decoded.mm_features[-1]
    assert video.second_per_grid_ts is None
    content = [{"type": "video", "media_index": 0}, {"type": "text", "text": CASES["video"][2]}]
    messages = [{"role": "user", "content": content}]
    placed = ours.process_chat(messages, [VideoReference("bb", video.image_grid_thw, None)])
    assert placed.prompt_token_ids == decoded.prompt_token_ids
    assert torch.equal(placed.mrope_positions, decoded.mrope_positions)
    with pytest.raises(InputError) as exc:
        ours.process_chat(messages, [VideoReference("bb", video.image_grid_thw, 0.5)])
    assert exc.value.code == "invalid_video_embeds", exc.value
    assert exc.value.param == "messages[0].content[0].video_embeds.second_per_grid_ts"
    assert "take no frame times" in str(exc.value)


@pytest.mark.parametrize(("rows", "refused"), [(17, True), (18, False)])
def test_a_video_over_the_encoder_cache_is_refused_before_its_frames_are_decoded(
    model_dir: Path, clip: bytes, png: bytes, rows: int, refused: bool
) -> None:
    """Six sampled frames make one item of 18 rows: with a cache of 17 rows the video
    is a 400 ``video_too_large`` naming the part and ``--encoder-cache-size``, and no
    frame was decoded (the engine would have refused it only after preprocessing);
    with 18 rows it is processed."""
    processor = load_processor(model_dir)
    processor.configure_media(max_item_rows=rows)
    case: Case = (False, {"num_frames": 6}, "?")
    frames = VIDEO_FRAMES_DECODED.get()
    if not refused:
        assert process(processor, case, clip, png).mm_features[-1].length == 18
        assert VIDEO_FRAMES_DECODED.get() == frames + 6
        return
    with pytest.raises(InputError) as err:
        process(processor, case, clip, png)
    assert err.value.code == "video_too_large"
    assert err.value.param == "messages[0].content[0].video_url"
    assert "encoder item of 18 rows; this instance's encoder cache holds 17" in str(err.value)
    assert VIDEO_FRAMES_DECODED.get() == frames
