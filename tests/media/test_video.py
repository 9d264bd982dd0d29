"""Videos: decoding and frame sampling (``model/video.py``), the Qwen2-VL video rule's
temporal patches (``model/video_processor.py``), and fetching video URLs by kind.

Clips are written by PyAV in the test (``tests/helpers/video.py``), a few frames
each, in memory.
"""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ec_frontend import _core
from ec_frontend.media import MediaError, MediaFetchConfig, MediaFetcher, parse_networks
from ec_frontend.media.items import resolve_items
from ec_frontend.model import video_processor
from ec_frontend.model.errors import InputError
from ec_frontend.model.native_preprocess import DISABLE_ENV
from ec_frontend.model.video import (
    DEFAULT_NUM_FRAMES,
    VideoLimits,
    VideoSampling,
    decode_video,
    sample_indices,
)
from PIL import Image

from ..helpers.origin import Origin, Route, origin
from ..helpers.torchvision import torchvision_env
from ..helpers.video import (
    decode_all,
    make_audio_only,
    make_clip,
    make_empty_video,
    make_png_video,
    qwen_video_rule,
)

#: A WebM (streamable: a cut keeps the frames before it) of 16 frames.
WEBM = make_clip(frames=16, container="webm", codec="libvpx-vp9")


def decode(data: bytes, sampling: VideoSampling = VideoSampling(), **limits: Any) -> Any:
    return decode_video(data, index=2, sampling=sampling, limits=VideoLimits(**limits))


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize(
    ("total", "duration", "num_frames", "fps", "expected"),
    [
        # vLLM 0.33's VideoBackend: the fewer of num_frames and floor(duration * fps),
        # at most every frame, at least one, linspace(0, total - 1, n) as integers.
        (8, 2.0, 4, -1, [0, 2, 4, 7]),
        (8, 2.0, 32, -1, list(range(8))),
        (8, 2.0, -1, -1, list(range(8))),
        (8, 2.0, 0, -1, list(range(8))),
        (8, 2.0, -1, 1, [0, 7]),
        (8, 2.0, 4, 1, [0, 7]),
        (8, 2.0, 3, 10, [0, 3, 7]),
        (8, 2.0, -1, 0.1, [0]),
        (10, 10 / 3, 3, -1, [0, 4, 9]),
        (100, 50.0, 6, -1, [0, 19, 39, 59, 79, 99]),
        (1, 0.25, 4, 2, [0]),
    ],
)
def test_sampling_follows_vllm(
    total: int, duration: float, num_frames: int, fps: float, expected: list[int]
) -> None:
    assert sample_indices(total, duration, VideoSampling(num_frames, fps)) == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # vLLM's defaults (VideoMediaIO num_frames=32, the loader's fps=-1); a request
        # that sets one of the two drops the other's default (VideoMediaIO.merge_kwargs).
        (None, VideoSampling(DEFAULT_NUM_FRAMES, -1.0)),
        ({}, VideoSampling(32, -1.0)),
        ({"video": {}}, VideoSampling(32, -1.0)),
        ({"video": {"num_frames": 4}}, VideoSampling(4, -1.0)),
        ({"video": {"fps": 2}}, VideoSampling(-1, 2.0)),
        ({"video": {"num_frames": 4, "fps": 0.5}}, VideoSampling(4, 0.5)),
    ],
)
def test_sampling_options_merge_as_vllm(kwargs: Any, expected: VideoSampling) -> None:
    assert VideoSampling.from_kwargs(kwargs) == expected


# ------------------------------------------------------------------ decoding


@pytest.mark.parametrize(
    ("clip", "num_frames"),
    [
        ({"gop": 2}, 4),  # H.264 in MP4, keyframes this close: a seek between samples
        ({"gop": 2}, 3),
        ({}, 8),
        ({"container": "webm", "codec": "libvpx-vp9", "gop": 3}, 3),
        ({"container": "matroska", "codec": "mpeg4", "gop": 2, "frames": 12}, 5),
        # sparse samples: whole keyframe intervals between them are skipped by seeks
        ({"gop": 2, "frames": 24}, 3),
        ({"container": "webm", "codec": "libvpx-vp9", "gop": 2, "frames": 24}, 3),
        # MPEG-TS: seeks go by decode time, which B-frames put before presentation
        ({"container": "mpegts"}, 8),
        ({"container": "mpegts", "gop": 2, "frames": 12}, 5),
        ({"container": "mpegts", "codec": "mpeg2video", "gop": 3, "frames": 12}, 4),
        ({"container": "mpegts", "gop": 2, "frames": 24}, 3),
    ],
)
def test_sampled_frames_are_the_frames_of_a_full_decode(
    clip: dict[str, Any], num_frames: int
) -> None:
    data = make_clip(**clip)
    reference = decode_all(data)
    video = decode(data, VideoSampling(num_frames, -1))
    assert video.total_frames == len(reference)
    assert video.indices == sample_indices(
        len(reference), len(reference) / 4, VideoSampling(num_frames, -1)
    )
    assert video.frames.dtype == np.uint8
    assert video.frames.shape == (len(video.indices), 56, 84, 3)
    for frame, i in zip(video.frames, video.indices, strict=True):
        assert np.array_equal(frame, reference[i])
    assert video.fps == 4.0
    assert video.timestamps == [i / 4 for i in video.indices]


def test_fps_sampling_and_an_audio_track() -> None:
    data = make_clip(frames=12, audio=True)  # 3 s at 4 fps, with AAC beside it
    video = decode(data, VideoSampling(-1, 1.0))
    assert video.indices == [0, 5, 11]


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (b"", "invalid_video", "is empty"),
        (b"\x00" * 4096, "invalid_video", "not a readable video"),
        (bytes(range(256)) * 16, "invalid_video", "not a readable video"),
        (make_clip()[:900], "invalid_video", "not a readable video"),  # MP4 cut before its index
        (
            WEBM[: len(WEBM) * 6 // 10],
            "invalid_video",
            "truncated",
        ),
        (make_empty_video(), "invalid_video", "video"),  # a header and no frame
        (make_audio_only(), "invalid_video", "no video stream"),
        # A 24-hour clip: two frames 12 hours apart.
        (make_clip(frames=2, rate=Fraction(1, 43200)), "video_too_long", "--max-video-duration"),
        (
            make_clip(frames=1, width=4000, height=2500, codec="mpeg4"),
            "video_too_large",
            "--max-video-frame-pixels",
        ),
    ],
)
def test_bad_videos_are_input_errors(data: bytes, code: str, words: str) -> None:
    with pytest.raises(InputError) as info:
        decode(data)
    assert info.value.code == code
    assert words in info.value.message
    assert info.value.message.startswith("video 2 ")


def test_huge_frames_are_refused_without_being_allocated() -> None:
    """A 10000x10000 stream (a real, decodable PNG frame: 300 MB as RGB) and a bomb of
    100 streams whose headers declare 10000x10000 frames, in files under 600 KB: FFmpeg's
    probe decode while opening is capped at ``max_frame_pixels`` too, so neither
    allocates its frames (the bomb took 10 GB and 22 s before the cap covered every
    stream)."""
    huge = make_png_video(10_000, 10_000)
    bomb = make_png_video(10_000, 10_000, streams=100, rows=2)
    assert len(huge) < 600_000 and len(bomb) < 100_000
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for data in (huge, bomb):
        start = time.monotonic()
        with pytest.raises(InputError) as info:
            decode(data)
        assert time.monotonic() - start < 2
        assert info.value.code == "video_too_large"
        assert "--max-video-frame-pixels" in info.value.message
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024 < 64
    # Within the cap, the same kind of file decodes.
    assert decode(make_png_video(64, 48)).frames.shape == (2, 48, 64, 3)


def test_limits_are_checked_before_decoding() -> None:
    data = make_clip(frames=8)
    with pytest.raises(InputError, match="--max-video-frames") as info:
        decode(data, VideoSampling(8, -1), max_frames=6)
    assert info.value.code == "video_too_large"
    assert len(decode(data, VideoSampling(6, -1), max_frames=6).indices) == 6
    with pytest.raises(InputError, match="--max-video-pixels"):
        decode(data, VideoSampling(4, -1), max_video_pixels=3 * 84 * 56)
    with pytest.raises(InputError, match="--max-video-frame-pixels"):
        decode(data, max_frame_pixels=84 * 56 - 1)
    with pytest.raises(InputError, match="--max-video-duration"):
        decode(data, max_duration_s=1.5)  # 8 frames at 4 fps: 2 s
    with pytest.raises(ValueError):
        VideoLimits(max_frames=0)


# ------------------------------------------------------------------ the Qwen2-VL rule


RULE = qwen_video_rule(56 * 56, 224 * 224)


def test_consecutive_frames_form_one_temporal_patch() -> None:
    frames = decode(make_clip(frames=8), VideoSampling(3, -1)).frames  # 3 frames: padded to 4
    grid, pixels = RULE.preprocess(frames, index=0)
    assert grid == (2, 4, 6)
    assert pixels.shape == (2 * 4 * 6, 3 * 2 * 14 * 14)
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    mean = torch.tensor(RULE.image_mean) * 255
    std = torch.tensor(RULE.image_std) * 255
    x = (x - mean[:, None, None]) / std[:, None, None]
    # Row 0 is the top-left patch of temporal patch 0: channel-major, then the two frames.
    first = pixels[0].view(3, 2, 14, 14)
    torch.testing.assert_close(first[:, 0], x[0, :, :14, :14], atol=1e-6, rtol=0)
    torch.testing.assert_close(first[:, 1], x[1, :, :14, :14], atol=1e-6, rtol=0)
    # The last temporal patch pairs frame 2 with its own copy (the count is padded).
    last = pixels[4 * 6].view(3, 2, 14, 14)
    torch.testing.assert_close(last[:, 0], last[:, 1], atol=0, rtol=0)
    torch.testing.assert_close(last[:, 0], x[2, :, :14, :14], atol=1e-6, rtol=0)


def test_frames_are_resized_into_the_pixel_range() -> None:
    frames = decode(make_clip(frames=2, width=64, height=48)).frames
    grid, _ = RULE.preprocess(frames, index=0)
    assert grid == (1, 4, 4)  # 48x64 -> 56x56
    grid, _ = RULE.preprocess(
        frames, index=0, size={"shortest_edge": 112 * 112, "longest_edge": 224 * 224}
    )
    assert grid == (1, 8, 10)  # 48x64 upscaled to 112x140
    with pytest.raises(InputError, match="aspect ratio"):
        RULE.preprocess(np.zeros((2, 1, 300, 3), np.uint8), index=4)


# ------------------------------------------------------------------ the native kernels

#: transformers' ``Qwen2VLVideoProcessor`` defaults (the rule above has a smaller range).
HF_RULE = qwen_video_rule(128 * 28 * 28, 28 * 28 * 768)


def smooth_frames(n: int, height: int, width: int, seed: int) -> np.ndarray:
    """Camera-like frames: smooth colour fields plus noise."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        small = rng.integers(0, 256, (max(height // 20, 2), max(width // 20, 2), 3), np.uint8)
        field = Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)
        noisy = np.asarray(field).astype(np.int16) + rng.integers(-6, 7, (height, width, 3))
        out.append(np.clip(noisy, 0, 255).astype(np.uint8))
    return np.stack(out)


def noise_frames(n: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, height, width, 3), np.uint8)


#: name -> (frames, (min_pixels, max_pixels)): downscaled, upscaled, odd sizes and
#: counts, a tall strip, and frames already at the target size.
NATIVE_CASES: dict[str, tuple[np.ndarray, tuple[int, int]]] = {
    "noise-720p": (noise_frames(3, 720, 1280, 1), (100_352, 602_112)),
    "smooth-720p": (smooth_frames(2, 720, 1280, 2), (100_352, 602_112)),
    "upscaled": (smooth_frames(2, 48, 64, 3), (100_352, 602_112)),
    "noise-upscaled": (noise_frames(1, 48, 64, 4), (100_352, 602_112)),
    "odd": (smooth_frames(5, 97, 131, 5), (3136, 50_176)),
    "tall": (smooth_frames(2, 1000, 30, 6), (3136, 602_112)),
    "exact": (smooth_frames(3, 56, 84, 7), (3136, 50_176)),
}


def pixel_range(case: str) -> dict[str, int]:
    low, high = NATIVE_CASES[case][1]
    return {"shortest_edge": low, "longest_edge": high}


@pytest.mark.parametrize("case", NATIVE_CASES)
def test_the_native_video_rule_equals_the_python_rule(case: str) -> None:
    frames = NATIVE_CASES[case][0]
    grid, pixels = HF_RULE.preprocess(frames, index=0, size=pixel_range(case))
    want_grid, want = HF_RULE.preprocess_python(frames, index=0, size=pixel_range(case))
    assert grid == want_grid
    assert pixels.dtype == torch.float32
    assert torch.equal(pixels, want)  # bit-identical, resized frames included


def test_the_native_video_rule_checks_what_the_python_rule_checks() -> None:
    # The checkpoint's own range (no size), and an aspect ratio over 200.
    frames = NATIVE_CASES["odd"][0]
    grid, pixels = RULE.preprocess(frames, index=0)
    assert (grid, pixels.shape) == ((3, 6, 10), (3 * 6 * 10, 3 * 2 * 14 * 14))
    assert torch.equal(pixels, RULE.preprocess_python(frames, index=0)[1])
    with pytest.raises(InputError, match="aspect ratio") as info:
        RULE.preprocess(np.zeros((2, 1, 300, 3), np.uint8), index=4)
    assert info.value.code == "invalid_video"
    assert info.value.message.startswith("video 4 ")
    # Frames that are a view (not contiguous) are read as the frames they show.
    wide = smooth_frames(2, 56, 168, 8)
    view = wide[:, :, ::2]
    assert torch.equal(RULE.preprocess(view, index=0)[1], RULE.preprocess_python(view, index=0)[1])


def test_the_python_rule_serves_when_native_is_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = RULE
    video_processor._native_kernels.cache_clear()
    monkeypatch.setenv(DISABLE_ENV, "1")
    try:
        assert video_processor._native_kernels(rule) is None
        frames = NATIVE_CASES["exact"][0]
        _, pixels = rule.preprocess(frames, index=0)
        assert torch.equal(pixels, rule.preprocess_python(frames, index=0)[1])
    finally:
        video_processor._native_kernels.cache_clear()
    monkeypatch.delenv(DISABLE_ENV)
    assert video_processor._native_kernels(rule) is not None


@pytest.mark.slow
def test_the_native_video_rule_against_transformers(tmp_path: Path) -> None:
    """transformers' ``Qwen2VLVideoProcessor`` (torchvision, in a child process):
    grids equal; frames at the target size bit-identical; resized frames within two
    8-bit levels after normalization (torchvision's bicubic rounds differently from
    Pillow's, whose bytes the native kernels reproduce: ``docs/video.md``)."""
    env = torchvision_env()
    arrays: dict[str, np.ndarray] = {}
    for case, (frames, pixels) in NATIVE_CASES.items():
        arrays[f"{case}/frames"] = frames
        arrays[f"{case}/pixels"] = np.array(pixels)
    np.savez(tmp_path / "in.npz", **arrays)
    script = Path(__file__).with_name("video_torchvision_reference.py")
    subprocess.run(
        [sys.executable, str(script), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
        env=env,
        check=True,
        timeout=600,
    )
    reference = np.load(tmp_path / "out.npz")
    two_levels = 2 / 255 / min(HF_RULE.image_std) + 1e-6
    for case, (frames, _) in NATIVE_CASES.items():
        grid, pixels = HF_RULE.preprocess(frames, index=0, size=pixel_range(case))
        assert [list(grid)] == reference[f"{case}/video_grid_thw"].tolist(), case
        want = torch.from_numpy(reference[f"{case}/pixel_values_videos"])
        atol = 0.0 if case == "exact" else two_levels
        torch.testing.assert_close(pixels, want, atol=atol, rtol=0, msg=case)


# ------------------------------------------------------------------ by URL


@pytest.fixture(scope="module")
def local() -> Any:
    with origin("127.0.0.1") as o:
        yield o


def fetcher(**kw: Any) -> MediaFetcher:
    return MediaFetcher(MediaFetchConfig(allowed_networks=parse_networks(["127.0.0.0/8"]), **kw))


async def fetch(f: MediaFetcher, url: str, kind: Any) -> bytes:
    try:
        return (await f.fetch(url, kind=kind)).data
    finally:
        await f.aclose()


def test_video_urls_accept_video_types_and_have_their_own_cap(local: Origin) -> None:
    clip = make_clip()
    url = local.set("/clip.mp4", Route(clip, content_type="video/mp4"))
    assert asyncio.run(fetch(fetcher(), url, "video")) == clip
    # An image part may not take it, nor a video part an image type.
    with pytest.raises(MediaError) as info:
        asyncio.run(fetch(fetcher(), url, "image"))
    assert "not an image" in info.value.message
    png_url = local.set("/a.png", Route(b"\x89PNG....", content_type="image/png"))
    with pytest.raises(MediaError) as info:
        asyncio.run(fetch(fetcher(), png_url, "video"))
    assert "not a video" in info.value.message
    # The video cap, not the image cap, bounds a video.
    small = {"max_item_bytes": 100, "max_video_bytes": len(clip) + 1}
    assert asyncio.run(fetch(fetcher(**small), url, "video")) == clip
    with pytest.raises(MediaError) as info:
        asyncio.run(fetch(fetcher(max_video_bytes=len(clip) - 1), url, "video"))
    assert (info.value.code, info.value.reason) == ("media_too_large", "too_large")
    assert "--max-media-video-bytes" in info.value.message


def test_a_fetched_video_is_keyed_like_the_same_video_inline(local: Origin) -> None:
    clip = make_clip()
    url = local.set("/same.mp4", Route(clip, content_type="video/mp4"))
    import base64
    import json

    def body(video_url: str, num_frames: int) -> bytes:
        part = {"type": "video_url", "video_url": {"url": video_url}}
        return json.dumps({
            "messages": [{"role": "user", "content": [part]}],
            "media_io_kwargs": {"video": {"num_frames": num_frames}},
        }).encode()  # fmt: skip

    inline = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    keys = {}
    for source in (inline, url):
        for n in (4, 8):
            parsed = _core.parse_request("chat", body(source, n), model_id="m")
            video = (parsed.media_io_kwargs or {}).get("video")
            items = asyncio.run(
                resolve_items(
                    fetcher(),
                    parsed.media,
                    model_id="m",
                    processor_kwargs=None,
                    cache_salt=None,
                    video_options=video,
                )
            )
            assert items[0].kind == "video"
            keys[(source == url, n)] = items[0].mm_hash
    assert keys[(True, 4)] == keys[(False, 4)]
    assert keys[(True, 8)] == keys[(False, 8)]
    assert keys[(False, 4)] != keys[(False, 8)]


# ------------------------------------------------------------------ the built-in model


def test_the_builtin_model_takes_video(builtin_model_dir: Any) -> None:
    from ec_frontend.model.loader import load_processor

    processor = load_processor(builtin_model_dir)

    class Item:
        def __init__(self, data: bytes) -> None:
            self.data, self.mm_hash, self.param, self.kind = data, "ab", "p", "video"

    messages = [{"role": "user", "content": [
        {"type": "video", "media_index": 0}, {"type": "text", "text": "what?"}]}]  # fmt: skip
    clip = make_clip(frames=8, width=56, height=56)
    for kwargs, t in ((None, 4), ({"video": {"num_frames": 4}}, 2), ({"video": {"fps": 1}}, 1)):
        out = processor.process_chat(messages, [Item(clip)], media_io_kwargs=kwargs)
        (feature,) = out.mm_features
        assert feature.image_grid_thw == (t, 4, 4)  # 56x56 frames: 4 tokens per 2 frames
        assert feature.length == 4 * t
        video_token = processor.video_token_id
        assert out.prompt_token_ids.count(video_token) == 4 * t
    with pytest.raises(InputError) as info:
        processor.process_chat(messages, [Item(make_audio_only())])
    assert info.value.param == "p"
    assert info.value.code == "invalid_video"
