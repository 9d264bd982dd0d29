"""A bounded, seeded fuzz run over the video entry point: mutated MP4 and WebM files
through ``decode_video`` and the Qwen2-VL video rule, as ``InputProcessor._video``
runs them for the server.

Seeds are clips written by PyAV in the test (H.264 in MP4 with an AAC track, VP9
in WebM, MPEG-4 in Matroska). Each case applies seeded mutations: byte flips,
overwritten runs, truncations, splices of another seed's bytes, duplicated
ranges. Every case must end as frames within the caps (tight ones, so a mutated
header that claims more is refused) and pixel values of the frames' grid, or as an
:class:`InputError` of a documented code (which the server answers as a 400 naming
the part: ``docs/video.md``, "Errors"): never another exception, and the
process's peak memory stays within what the caps allow.
"""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest
from ec_frontend.model.errors import InputError
from ec_frontend.model.video import VideoLimits, VideoSampling, decode_video

from ..helpers.video import make_clip, qwen_video_rule

#: The codes ``docs/video.md`` documents for a bad video.
CODES = {"invalid_video", "video_too_large", "video_too_long"}
LIMITS = VideoLimits(
    max_frames=16, max_frame_pixels=320 * 240, max_video_pixels=12 * 320 * 240, max_duration_s=60
)
RULE = qwen_video_rule(56 * 56, 224 * 224)
CASES_PER_SEED = 110
SEEDS = {
    "mp4": lambda: make_clip(frames=10, width=84, height=56, gop=3, audio=True),
    "webm": lambda: make_clip(frames=10, container="webm", codec="libvpx-vp9", gop=4),
    "mkv": lambda: make_clip(frames=8, container="matroska", codec="mpeg4", gop=2),
    "ts": lambda: make_clip(frames=8, container="mpegts", gop=3),
}


def mutate(data: bytes, other: bytes, rng: np.random.Generator) -> bytes:
    """One to three seeded mutations of ``data``."""
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(0, 6))
        n = len(buf)
        if n < 16:
            break
        at = int(rng.integers(0, n))
        if kind == 0:  # flip bits in a few bytes
            for i in rng.integers(0, n, int(rng.integers(1, 9))):
                buf[int(i)] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:  # overwrite a run (often a size or count field) with extremes
            run = int(rng.integers(1, 9))
            value = int(rng.choice([0x00, 0xFF, 0x7F, 0x80]))
            buf[at : at + run] = bytes([value]) * len(buf[at : at + run])
        elif kind == 2:  # truncate
            del buf[max(8, at) :]
        elif kind == 3:  # splice in another file's bytes
            start = int(rng.integers(0, len(other)))
            buf[at:at] = other[start : start + int(rng.integers(1, 4096))]
        elif kind == 4:  # duplicate a range
            end = min(n, at + int(rng.integers(1, 2048)))
            buf[at:at] = buf[at:end]
        else:  # cut a range out
            del buf[at : at + int(rng.integers(1, 512))]
    return bytes(buf)


def run_one(data: bytes) -> str:
    """``ok`` or the error code; anything other than an :class:`InputError` raises."""
    try:
        video = decode_video(data, index=1, sampling=VideoSampling(), limits=LIMITS)
        n, height, width, channels = video.frames.shape
        assert channels == 3 and 1 <= n <= LIMITS.max_frames
        assert height * width <= LIMITS.max_frame_pixels
        assert n * height * width <= LIMITS.max_video_pixels
        assert len(video.indices) == len(video.timestamps) == n
        assert all(0 <= i < video.total_frames for i in video.indices)
        (t, h, w), pixels = RULE.preprocess(video.frames, index=1)
        assert pixels.shape == (t * h * w, 3 * 2 * 14 * 14)
        assert t == (n + 1) // 2
    except InputError as exc:
        assert exc.code in CODES, exc
        assert exc.message.startswith("video 1 "), exc.message
        return exc.code
    return "ok"


@pytest.mark.parametrize("name", SEEDS)
def test_mutated_videos_end_as_frames_or_documented_errors(name: str) -> None:
    seeds = {k: make() for k, make in SEEDS.items()}
    data, other = seeds[name], seeds["webm" if name != "webm" else "mp4"]
    assert run_one(data) == "ok"
    rng = np.random.default_rng(sum(map(ord, name)))
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes: dict[str, int] = {}
    start = time.monotonic()
    for case in range(CASES_PER_SEED):
        mutated = mutate(data, other, rng)
        try:
            outcome = run_one(mutated)
        except Exception as exc:  # the failure names the case to replay
            raise AssertionError(f"{name} case {case}: {type(exc).__name__}: {exc}") from exc
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    elapsed = time.monotonic() - start
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    # Decoded frames are bounded by the caps (12 x 320 x 240 x 3 bytes, 2.8 MB) and the
    # pixel values by the rule's range; FFmpeg's own buffers for clips this small
    # are a few MB. A mutation that made anything allocate by a header's claim
    # would show here.
    assert grown_mb < 64, (grown_mb, outcomes)
    assert elapsed < 20, (elapsed, outcomes)
    # The run reached both ends: mutated files that still decode, and refusals.
    assert outcomes.get("ok", 0) > 0 and outcomes.get("invalid_video", 0) > 0, outcomes
