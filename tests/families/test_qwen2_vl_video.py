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
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from ec_frontend.model import builtin
from ec_frontend.model.loader import load_processor
from ec_frontend.model.processor import InputProcessor
from ec_frontend.model.video import VideoLimits, VideoSampling, decode_video
from transformers import PreTrainedTokenizerFast, Qwen2VLForConditionalGeneration

from ..disagg.conftest import serve
from ..helpers.processes import Proc, start_all
from ..helpers.video import make_audio_only, make_clip, make_empty_video, make_png_video
from .conftest import data_url, image_bytes, write_qwen2_vl

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
#: The test-only torchvision (``scripts/setup.sh``) beside the interpreter's venv.
TORCHVISION_DIR = Path(sys.prefix) / "extras" / "torchvision"
#: name -> (with an image, media_io_kwargs["video"] or None, text). The clip has 8
#: frames of 84x56 at 4 fps; 4 frames -> grid (2, 4, 6), the default 32 -> all 8.
CASES: dict[str, tuple[bool, dict[str, Any] | None, str]] = {
    "video": (False, {"num_frames": 4}, "What happens in this clip?"),
    "video-6": (False, {"num_frames": 6}, "What happens in this clip?"),
    "image+video": (True, None, "Compare the picture with the clip."),
}


@dataclass(frozen=True, slots=True)
class Media:
    """Stands in for the native ``MediaItem`` (what the processor reads)."""

    data: bytes
    mm_hash: str
    param: str
    kind: str


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(frames=8, width=84, height=56, gop=3)


@pytest.fixture(scope="module")
def png() -> bytes:
    return image_bytes(84, 56, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl_video"))
    # transformers' Qwen2VLVideoProcessor config, with the image processor's values and
    # a frame pixel range as small as the image one.
    config = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": builtin.MIN_PIXELS, "longest_edge": builtin.MAX_PIXELS},
        "patch_size": builtin.PATCH_SIZE,
        "temporal_patch_size": builtin.TEMPORAL_PATCH_SIZE,
        "merge_size": builtin.SPATIAL_MERGE_SIZE,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1 / 255,
        "resample": 3,
    }
    (directory / "video_preprocessor_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def template_messages(case: str) -> list[dict[str, Any]]:
    with_image, _, text = CASES[case]
    parts: list[dict[str, Any]] = [{"type": "image", "media_index": 0}] if with_image else []
    parts.append({"type": "video", "media_index": len(parts)})
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def frames(clip: bytes, case: str) -> np.ndarray:
    sampling = VideoSampling.from_kwargs({"video": CASES[case][1] or {}})
    return decode_video(clip, index=0, sampling=sampling, limits=VideoLimits()).frames


@pytest.fixture(scope="module")
def reference(
    model_dir: Path, clip: bytes, png: bytes, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    """transformers' processor over every case (a child process with torchvision)."""
    if not (TORCHVISION_DIR / "torchvision").is_dir():
        pytest.fail(f"the test-only torchvision is not in {TORCHVISION_DIR} (scripts/setup.sh)")
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tmp = tmp_path_factory.mktemp("video_reference")
    arrays: dict[str, Any] = {"checkpoint": np.array(str(model_dir))}
    for case, (with_image, _, _) in CASES.items():
        text = tok.apply_chat_template(
            template_messages(case), tokenize=False, add_generation_prompt=True
        )
        arrays[f"{case}/text"] = np.array(text)
        arrays[f"{case}/video"] = frames(clip, case)
        arrays[f"{case}/image"] = np.frombuffer(png if with_image else b"", np.uint8)
    np.savez(tmp / "in.npz", **arrays)
    env = dict(os.environ, PYTHONPATH=str(TORCHVISION_DIR))
    script = Path(__file__).with_name("video_reference.py")
    subprocess.run(
        [sys.executable, str(script), str(tmp / "in.npz"), str(tmp / "out.npz")],
        env=env,
        check=True,
        timeout=600,
    )
    return np.load(tmp / "out.npz")


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    return Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> InputProcessor:
    return load_processor(model_dir)


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory, clip: bytes) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "clip.mp4").write_bytes(clip)
    return root


@pytest.fixture(scope="module")
def server(model_dir: Path, media_root: Path) -> Iterator[Proc]:
    (proc,) = start_all(
        [
            serve(
                model_dir,
                "video",
                extra=["--allowed-local-media-path", str(media_root), "--max-video-frames", "12"],
            )
        ]
    )
    try:
        yield proc
    finally:
        proc.stop()


def ref_inputs(reference: Any, case: str) -> dict[str, torch.Tensor]:
    """What transformers' processor returned for the case (``mm_token_type_ids`` too)."""
    prefix = f"{case}/"
    return {
        key[len(prefix) :]: torch.from_numpy(reference[key])
        for key in reference.files
        if key.startswith(prefix)
    }


def hf_generate(hf_model: Any, reference: Any, case: str) -> list[int]:
    inputs = ref_inputs(reference, case)
    with torch.no_grad():
        out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("case", CASES)
def test_processor_and_rope_index_match_transformers(
    ours: InputProcessor, hf_model: Any, reference: Any, clip: bytes, png: bytes, case: str
) -> None:
    with_image, video, _ = CASES[case]
    media = (
        [Media(png, "aa", "messages[0].content[0].image_url", "image")] if with_image else []
    ) + [Media(clip, "bb", f"messages[0].content[{int(with_image)}].video_url", "video")]
    mine = ours.process_chat(
        template_messages(case), media, media_io_kwargs={"video": video} if video else None
    )
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
    if with_image:
        torch.testing.assert_close(
            mine.mm_features[0].pixel_values, ref["pixel_values"], atol=0, rtol=0
        )
    types = (ids == hf_model.config.image_token_id).int() + 2 * (ids == video_token).int()
    positions, delta = hf_model.model.get_rope_index(
        ids, types, image_grid_thw=ref.get("image_grid_thw"), video_grid_thw=ref["video_grid_thw"]
    )
    assert torch.equal(mine.mrope_positions, positions[:, 0])
    assert mine.mrope_position_delta == int(delta)


def chat(server: Proc, case: str, video_url: str, png: bytes, **extra: Any) -> Any:
    with_image, video, text = CASES[case]
    parts: list[dict[str, Any]] = []
    if with_image:
        parts.append({"type": "image_url", "image_url": {"url": data_url(png)}})
    parts.append({"type": "video_url", "video_url": {"url": video_url}})
    parts.append({"type": "text", "text": text})
    body: dict[str, Any] = {"return_token_ids": True, **extra}
    if video is not None:
        body["media_io_kwargs"] = {"video": video}
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        return c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": parts}],  # type: ignore[misc,list-item]
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=body,
        )


def video_data_url(clip: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


def computed(server: Proc) -> float:
    return server.metrics().get("ec_frontend_encoder_items_computed_total", 0.0)


@pytest.mark.parametrize("case", CASES)
def test_served_greedy_matches_transformers_generate(
    server: Proc, hf_model: Any, reference: Any, clip: bytes, png: bytes, case: str
) -> None:
    want = hf_generate(hf_model, reference, case)
    assert len(want) >= 2
    r = chat(server, case, video_data_url(clip), png)
    assert list((r.choices[0].model_extra or {})["token_ids"]) == want
    assert r.usage is not None
    assert r.usage.prompt_tokens == reference[f"{case}/input_ids"].shape[1]


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
