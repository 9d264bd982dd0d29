"""Shared steps of the Qwen-VL video tests (``test_qwen*_video.py``).

Each family's test writes a tiny checkpoint with ``transformers``' own classes
(``conftest.write_qwen*``) plus the family's ``video_preprocessor_config.json``,
samples a clip written by PyAV with our decoder (``media_io_kwargs``), and has
``transformers``' processor with its video processor process the same frames in
a child process with the test-only torchvision (``video_reference.py``), given
the video's metadata (its rate, frame count and the sampled indices) as vLLM
gives it. Our processor must give its token ids, pixels, grids and
``get_rope_index``'s positions; a greedy chat served by ``ec-frontend serve``
through the ``openai`` client must produce the tokens of
``generate(do_sample=False)`` on the processor's output.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from ec_frontend.model import builtin
from ec_frontend.model.loader import load_processor
from ec_frontend.model.processor import InputProcessor, ProcessedInputs
from ec_frontend.model.video import VideoLimits, VideoSampling, decode_video
from transformers import PreTrainedTokenizerFast

from ..disagg.conftest import serve
from ..helpers.processes import Proc, start_all
from ..helpers.torchvision import torchvision_env
from .conftest import data_url
from .flows import deployment

MAX_TOKENS = 8
#: A case: (with an image before the video, media_io_kwargs["video"] or None, text).
Case = tuple[bool, dict[str, Any] | None, str]


@dataclass(frozen=True, slots=True)
class Media:
    """Stands in for the native ``MediaItem`` (what the processor reads)."""

    data: bytes
    mm_hash: str
    param: str
    kind: str


@dataclass(frozen=True, slots=True)
class VideoReference:
    """A ``video_embeds`` reference as the processor reads it (the native item's
    ``video_grid_thw``, ``second_per_grid_ts`` and ``timestamps``, no bytes)."""

    mm_hash: str
    video_grid_thw: tuple[int, ...]
    second_per_grid_ts: float | None
    data: bytes | None = None
    param: str = "messages[0].content[0].video_embeds"
    timestamps: list[float] | None = None


def write_video_config(directory: Path, **config: Any) -> None:
    """The checkpoint's ``video_preprocessor_config.json`` (transformers' keys)."""
    (directory / "video_preprocessor_config.json").write_text(json.dumps(config), encoding="utf-8")


def write_qwen3_video_config(directory: Path) -> None:
    """transformers' ``Qwen3VLVideoProcessor`` config for the tiny Qwen3-VL (16-pixel
    patches, mean and std 0.5, a pixel range over all the frames of a video)."""
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


def write_qwen2_video_config(directory: Path) -> None:
    """transformers' ``Qwen2VLVideoProcessor`` config (Qwen2-VL's and Qwen2.5-VL's),
    with the built-in image processor's values and a frame pixel range as small as
    the image one."""
    write_video_config(
        directory,
        video_processor_type="Qwen2VLVideoProcessor",
        size={"shortest_edge": builtin.MIN_PIXELS, "longest_edge": builtin.MAX_PIXELS},
        patch_size=builtin.PATCH_SIZE,
        temporal_patch_size=builtin.TEMPORAL_PATCH_SIZE,
        merge_size=builtin.SPATIAL_MERGE_SIZE,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
        rescale_factor=1 / 255,
        resample=3,
    )


def template_messages(case: Case) -> list[dict[str, Any]]:
    with_image, _, text = case
    parts: list[dict[str, Any]] = [{"type": "image", "media_index": 0}] if with_image else []
    parts.append({"type": "video", "media_index": len(parts)})
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def sample(clip: bytes, case: Case) -> Any:
    """Our decoder's sampling of ``clip`` for the case (a ``DecodedVideo``)."""
    sampling = VideoSampling.from_kwargs({"video": case[1] or {}})
    return decode_video(clip, index=0, sampling=sampling, limits=VideoLimits())


def run_reference(
    model_dir: Path,
    cases: dict[str, Case],
    clip: bytes,
    png: bytes,
    tmp: Path,
    family: str | None = None,
) -> Any:
    """transformers' processor over every case (a child process with torchvision);
    with ``family`` it is that family's processor, given the video metadata."""
    env = torchvision_env()
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    arrays: dict[str, Any] = {"checkpoint": np.array(str(model_dir))}
    if family is not None:
        arrays["family"] = np.array(family)
    for name, case in cases.items():
        text = tok.apply_chat_template(
            template_messages(case), tokenize=False, add_generation_prompt=True
        )
        decoded = sample(clip, case)
        arrays[f"{name}/text"] = np.array(text)
        arrays[f"{name}/video"] = decoded.frames
        arrays[f"{name}/image"] = np.frombuffer(png if case[0] else b"", np.uint8)
        if family is not None:
            arrays[f"{name}/metadata"] = np.array(
                [decoded.fps, decoded.total_frames, *decoded.indices], np.float64
            )
    np.savez(tmp / "in.npz", **arrays)
    script = Path(__file__).with_name("video_reference.py")
    subprocess.run(
        [sys.executable, str(script), str(tmp / "in.npz"), str(tmp / "out.npz")],
        env=env,
        check=True,
        timeout=600,
    )
    return np.load(tmp / "out.npz")


def ref_inputs(reference: Any, name: str) -> dict[str, torch.Tensor]:
    """What transformers' processor returned for the case, as tensors of the dtypes
    ``return_tensors="pt"`` gives (``second_per_grid_ts`` float32)."""
    prefix = f"{name}/"
    out = {
        key[len(prefix) :]: torch.from_numpy(reference[key])
        for key in reference.files
        if key.startswith(prefix)
    }
    if "second_per_grid_ts" in out:
        out["second_per_grid_ts"] = out["second_per_grid_ts"].to(torch.float32)
    return out


def hf_generate(hf_model: Any, reference: Any, name: str) -> list[int]:
    inputs = ref_inputs(reference, name)
    with torch.no_grad():
        out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def process(ours: InputProcessor, case: Case, clip: bytes, png: bytes) -> ProcessedInputs:
    """Our processor over the case's messages and media."""
    with_image, video, _ = case
    media = (
        [Media(png, "aa", "messages[0].content[0].image_url", "image")] if with_image else []
    ) + [Media(clip, "bb", f"messages[0].content[{int(with_image)}].video_url", "video")]
    return ours.process_chat(
        template_messages(case), media, media_io_kwargs={"video": video} if video else None
    )


def check_image_and_rope_index(mine: ProcessedInputs, hf_model: Any, ref: dict[str, Any]) -> None:
    """The image's pixels (when the case has one, the first item) equal the reference's,
    and our positions and decode delta equal ``get_rope_index`` over the reference's
    ids and grids (and ``second_per_grid_ts`` where the family has it)."""
    if "pixel_values" in ref:
        torch.testing.assert_close(
            mine.mm_features[0].pixel_values, ref["pixel_values"], atol=0, rtol=0
        )
    ids = ref["input_ids"]
    config = hf_model.config
    types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    extra = {k: ref[k] for k in ("second_per_grid_ts",) if k in ref}
    positions, delta = hf_model.model.get_rope_index(
        ids,
        types,
        image_grid_thw=ref.get("image_grid_thw"),
        video_grid_thw=ref["video_grid_thw"],
        **extra,
    )
    assert torch.equal(mine.mrope_positions, positions[:, 0])
    assert mine.mrope_position_delta == int(delta)


def chat(server: Proc, case: Case, video_url: str, png: bytes, **extra: Any) -> Any:
    with_image, video, text = case
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


def check_served(
    server: Proc, hf_model: Any, reference: Any, case: Case, name: str, clip: bytes, png: bytes
) -> None:
    """A served greedy chat gives ``generate``'s tokens and the reference's prompt length."""
    want = hf_generate(hf_model, reference, name)
    assert len(want) >= 2
    r = chat(server, case, video_data_url(clip), png)
    assert list((r.choices[0].model_extra or {})["token_ids"]) == want
    assert r.usage is not None
    assert r.usage.prompt_tokens == reference[f"{name}/input_ids"].shape[1]


def video_fixtures(cases: dict[str, Case], hf_class: Any, family: str | None = None) -> Any:
    """The module fixtures of a family's video test, on its module's ``model_dir``,
    ``clip`` and ``png`` fixtures: ``reference`` (transformers' processor over
    ``cases``: :func:`run_reference`, with ``family``'s metadata), ``hf_model``
    (``hf_class``, float32, eval), ``ours`` (our processor) and ``server`` (one
    aggregated ``ec-frontend serve``)."""

    @pytest.fixture(scope="module")
    def reference(
        model_dir: Path, clip: bytes, png: bytes, tmp_path_factory: pytest.TempPathFactory
    ) -> Any:
        tmp = tmp_path_factory.mktemp("video_reference")
        return run_reference(model_dir, cases, clip, png, tmp, family=family)

    @pytest.fixture(scope="module")
    def hf_model(model_dir: Path) -> Any:
        return hf_class.from_pretrained(model_dir, dtype=torch.float32).eval()

    @pytest.fixture(scope="module")
    def ours(model_dir: Path) -> InputProcessor:
        return load_processor(model_dir)

    @pytest.fixture(scope="module")
    def server(model_dir: Path) -> Iterator[Proc]:
        (proc,) = start_all([serve(model_dir, f"{family}_video")])
        try:
            yield proc
        finally:
            proc.stop()

    return reference, hf_model, ours, server


def deployment_fixtures() -> Any:
    """The module fixtures of a family's disaggregated video test, on its module's
    ``model_dir``: ``dep`` (``agg``, and the encoder ``e``, ``pd`` and ``d`` behind
    ``ec-frontend proxy`` as ``E+PD`` and ``E+P+D``: :func:`flows.deployment`) and
    ``server`` (its ``agg``)."""

    @pytest.fixture(scope="module")
    def dep(model_dir: Path) -> Iterator[dict[str, Proc]]:
        with deployment(model_dir) as procs:
            yield procs

    @pytest.fixture(scope="module")
    def server(dep: dict[str, Proc]) -> Proc:
        return dep["agg"]

    return dep, server


def check_only_the_encoder_decodes(
    dep: dict[str, Proc], case: Case, clip: bytes, png: bytes, items: int
) -> None:
    """``case`` (a sampling not sent before) through both topologies: the encoder
    decodes the video and computes its ``items`` encoder items once, ``pd`` loads them
    through the EC connector, and neither ``pd`` nor ``d`` decodes a video or
    computes an item."""
    before = {n: dep[n].metrics() for n in ("e", "pd", "d")}
    for topology in ("E+PD", "E+P+D"):
        r = chat(dep[topology], case, video_data_url(clip), png)
        assert r.choices[0].finish_reason in ("stop", "length")

    def delta(name: str, metric: str) -> float:
        key = "ec_frontend_" + metric
        return dep[name].metrics().get(key, 0.0) - before[name].get(key, 0.0)

    assert delta("e", "videos_decoded_total") >= 1
    assert delta("e", "encoder_items_computed_total") == items
    assert delta("pd", "ec_items_loaded_total") >= items
    for name in ("pd", "d"):
        for metric in ("encoder_items_computed_total", "videos_decoded_total"):
            assert dep[name].metrics().get("ec_frontend_" + metric, 0.0) == 0, (name, metric)
    assert delta("pd", "ec_load_fallbacks_total") == 0


def check_reference_refused(pd: Proc, video_embeds: dict[str, Any], field: str) -> None:
    """A ``video_embeds`` reference without ``field`` (what vLLM's proxy would send for
    an encoder that published only the grid): ``pd`` answers 400
    ``invalid_video_embeds`` naming it and stays healthy."""
    part = {"type": "video_embeds", "video_embeds": video_embeds, "uuid": "never-encoded"}
    content = [part, {"type": "text", "text": "x"}]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(pd.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_video_embeds", error
    assert error["param"] == f"messages[0].content[0].video_embeds.{field}", error
    assert httpx.get(pd.url + "/health", timeout=10).status_code == 200
