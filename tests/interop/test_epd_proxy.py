"""vLLM 0.33.0's ``disagg_epd_proxy.py``, unmodified, in front of ec-frontend E+PD.

The proxy (started from vLLM's source distribution in the vLLM environment)
sends each image with a ``uuid`` to the encoder, reads the ``modality``,
``item_indices`` and ``metadata`` of its ``ec_transfer_params`` entries, and
rewrites the image for the prefill/decode instance into a metadata-only
``{"type": "image_embeds", "image_embeds": {"image_grid_thw": ...}, "uuid": ...}``
reference (plus the encoder's entries and ``ec_items`` in
``ec_transfer_params``). Behind it, ec-frontend must answer token for token
what one aggregated instance answers, with the PD instance computing no
encoder item (it loads them all through the EC connector: vLLM's file layout
on a shared directory, the side channel with signed params; and E+P+D with
``ECSharedStorageConnector`` and the KV side channel). The bad-input
cases go straight to the PD instance: each is a 400 or a per-request error,
and the instance stays healthy.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..disagg.conftest import (
    png_data_url,
    proxy,
    serve,
    shared_storage_ec,
    side_channel_ec,
    side_channel_kv,
)
from ..families.conftest import write_llava_onevision, write_qwen2_5_vl, write_qwen3_vl
from ..families.video_flows import write_qwen2_video_config, write_qwen3_video_config
from ..helpers.processes import start_all, stop_all
from ..helpers.video import make_clip
from .conftest import MODEL_NAME, VllmScript

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROXY = Path("sdist/vllm-0.33.0/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py")
IMAGES = [png_data_url(56, (200, 30, 30)), png_data_url(84, (20, 160, 90))]


def example_ec(role: str, path: Path) -> dict[str, Any]:
    return {"ec_connector": "ECExampleConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(path)}}  # fmt: skip


def vllm_proxy(python: Path, encode: str, decode: str, prefill: str = "none") -> VllmScript:
    """vLLM's EPD proxy script, unmodified."""
    return VllmScript(
        python,
        PROXY,
        ["--host", "127.0.0.1", "--port", "{port}", "--encode-servers-urls", encode,
         "--prefill-servers-urls", prefill, "--decode-servers-urls", decode],
        "/health",
    )  # fmt: skip


@pytest.fixture(scope="module")
def dep(
    vllm_python: Path, builtin_model_dir: Path, tmp_path_factory: Any
) -> Iterator[dict[str, Any]]:
    shared = tmp_path_factory.mktemp("ec-example")
    flat = tmp_path_factory.mktemp("ec-shared-storage")
    m = builtin_model_dir
    procs = {
        "agg": serve(m, "agg"),
        "e_ex": serve(m, "e_ex", ec=example_ec("ec_producer", shared)),
        "pd_ex": serve(m, "pd_ex", ec=example_ec("ec_consumer", shared)),
        "e_sc": serve(m, "e_sc", ec=side_channel_ec("ec_producer")),
        "pd_sc": serve(m, "pd_sc", ec=side_channel_ec("ec_consumer")),
        "e_ss": serve(m, "e_ss", ec=shared_storage_ec("ec_producer", flat)),
        "p_ss": serve(m, "p_ss", ec=shared_storage_ec("ec_consumer", flat),
                      kv=side_channel_kv("kv_producer")),
        "d": serve(m, "d", kv=side_channel_kv("kv_consumer")),
    }  # fmt: skip
    start_all(list(procs.values()))
    ours = {
        "ours_sc": proxy("ours_sc", encode=[procs["e_sc"].url], decode=[procs["pd_sc"].url]),
        "ours_epd": proxy("ours_epd", encode=[procs["e_ss"].url], prefill=[procs["p_ss"].url],
                          decode=[procs["d"].url]),
    }  # fmt: skip
    proxies: dict[str, Any] = {
        "example": vllm_proxy(vllm_python, procs["e_ex"].url, procs["pd_ex"].url),
        "side_channel": vllm_proxy(vllm_python, procs["e_sc"].url, procs["pd_sc"].url),
        "epd": vllm_proxy(
            vllm_python, procs["e_ss"].url, procs["d"].url, prefill=procs["p_ss"].url
        ),
    }
    try:
        for p in proxies.values():
            p.wait_ready()
        start_all(list(ours.values()))
        yield {**procs, "proxies": {**proxies, **ours}, "shared": shared}
    finally:
        for p in [*proxies.values(), *ours.values()]:
            p.stop()
        stop_all(list(procs.values()))


def ask(url: str, image: str, *, stream: bool) -> tuple[str, int | None]:
    """Greedy answer text (and prompt tokens, when not streamed) for one image."""
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        return _answer(client, image, stream=stream)


def _answer(client: openai.OpenAI, image: str, *, stream: bool) -> tuple[str, int | None]:
    messages: Any = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": "describe it"}]}]  # fmt: skip
    common: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8,
                              "temperature": 0.0}  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**common)
        assert r.usage is not None
        return r.choices[0].message.content or "", r.usage.prompt_tokens
    text = ""
    for chunk in client.chat.completions.create(**common, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
    return text, None


@pytest.mark.parametrize(
    ("proxy", "encoder", "pd"),
    [("example", "e_ex", "pd_ex"), ("side_channel", "e_sc", "pd_sc"), ("epd", "e_ss", "p_ss")],
)
def test_vllm_proxy_token_identical_and_pd_encodes_nothing(
    dep: dict[str, Any], proxy: str, encoder: str, pd: str
) -> None:
    """E+PD (``pd`` prefills and decodes) and E+P+D (``pd`` prefills, ``d`` decodes
    from its KV)."""
    front = dep["proxies"][proxy]
    agg, e, d = dep["agg"], dep[encoder], dep[pd]
    for image in IMAGES:
        for stream in (False, True):
            want = ask(agg.url, image, stream=stream)
            got = ask(front.url, image, stream=stream)
            assert got == want, (proxy, stream, front.log()[-2000:])
    assert d.metric("encoder_items_computed_total") == 0, d.log()
    assert d.metric("ec_items_loaded_total") >= len(IMAGES)
    assert d.metric("ec_load_fallbacks_total") == 0
    assert e.metric("encoder_items_computed_total") >= len(IMAGES)
    if proxy == "epd":
        decode = dep["d"]
        assert decode.metric("encoder_items_computed_total") == 0
        assert decode.metric("kv_tokens_received_total") > 0
        assert decode.metric("kv_local_prefill_fallbacks_total") == 0
    assert "Rewrote 1 media item(s) as metadata references" in front.log()
    if proxy == "example":
        # One item directory per image in vLLM's layout, named by the key both sides
        # derive from the proxy's uuid (sha256 of the URL), never by the uuid itself.
        names = {f.parent.name for f in dep["shared"].glob("*/encoder_cache.safetensors")}
        assert len(names) == len(IMAGES), names
        assert not names & {hashlib.sha256(image.encode()).hexdigest() for image in IMAGES}


def embeds_body(part: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
        part, {"type": "text", "text": "describe it"}]}], **extra}  # fmt: skip


def reference(grid: Any, uuid: str = "never-encoded") -> dict[str, Any]:
    return {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": uuid}


def video_reference(grid: Any, uuid: str = "never-encoded", **more: Any) -> dict[str, Any]:
    return {"type": "video_embeds", "video_embeds": {"video_grid_thw": grid, **more},
            "uuid": uuid}  # fmt: skip


@pytest.mark.parametrize(
    ("target", "body", "want"),
    [
        ("pd_ex", embeds_body({"type": "image_embeds", "image_embeds": "AAAA", "uuid": "u"}),
         "messages[0].content[0].image_embeds"),
        ("pd_ex", embeds_body({**reference([1, 4, 4]), "uuid": None}),
         "messages[0].content[0].uuid"),
        ("pd_ex", embeds_body(reference([1, 4, 4, 4])),
         "messages[0].content[0].image_embeds.image_grid_thw"),
        ("pd_ex", embeds_body(reference([2, 4, 4])), "invalid_image_embeds"),
        ("pd_ex", embeds_body(reference([1, 3, 4])), "invalid_image_embeds"),
        ("pd_ex", embeds_body(reference([1, 4000, 4000])), "invalid_image_embeds"),
        ("pd_sc", embeds_body(reference([1, 4, 4]), ec_transfer_params={"ec_items": "x"}),
         "ec_transfer_params"),
        ("pd_sc", embeds_body(reference([1, 4, 4]), ec_transfer_params={"ec_items": [3]}),
         "ec_transfer_params"),
        ("agg", embeds_body(reference([1, 4, 4])), "messages[0].content[0].image_embeds"),
        ("agg", embeds_body(video_reference([2, 4, 4])), "messages[0].content[0].video_embeds"),
        ("pd_ex", embeds_body({"type": "video_embeds", "video_embeds": "AAAA", "uuid": "u"}),
         "messages[0].content[0].video_embeds"),
        ("pd_ex", embeds_body(video_reference([2, 3, 4])), "invalid_video_embeds"),
        ("pd_ex", embeds_body(video_reference([65, 4, 4])), "invalid_video_embeds"),
        # Qwen2-VL's positions take no absolute time: a Qwen2.5-VL encoder's field is refused.
        ("pd_ex", embeds_body(video_reference([2, 4, 4], second_per_grid_ts=[0.5])),
         "messages[0].content[0].video_embeds.second_per_grid_ts"),
        ("pd_ex", embeds_body(video_reference([2, 4, 4], second_per_grid_ts=[0])),
         "messages[0].content[0].video_embeds.second_per_grid_ts[0]"),
        ("pd_sc", embeds_body(video_reference([2, 4, 4])), "ec_item_unavailable"),
        # A well-formed reference whose output no connector can load: that request fails.
        ("pd_ex", embeds_body(reference([1, 4, 4])), "ec_item_unavailable"),
        ("pd_sc", embeds_body(reference([1, 4, 4])), "ec_item_unavailable"),
    ],
)  # fmt: skip
def test_bad_references_are_400_and_the_instance_stays_healthy(
    dep: dict[str, Any], target: str, body: dict[str, Any], want: str
) -> None:
    """``want``: the error's ``param``, or its ``code`` where no field is to blame."""
    server = dep[target]
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert want in (error["param"], error["code"]), error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert ok.status_code == 200, ok.text


CLIP = "data:video/mp4;base64," + base64.b64encode(make_clip(8)).decode()
VIDEO_PROMPTS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "video": ([{"type": "video_url", "video_url": {"url": CLIP}}], {}),
    "image+video": (
        [{"type": "image_url", "image_url": {"url": IMAGES[0]}},
         {"type": "video_url", "video_url": {"url": CLIP}}],
        {"media_io_kwargs": {"video": {"num_frames": 4}}},
    ),
}  # fmt: skip
_AGG_VIDEO: dict[str, tuple[str, int | None]] = {}


def ask_video(url: str, prompt: str) -> tuple[str, int | None]:
    """Greedy answer text and prompt tokens for one of :data:`VIDEO_PROMPTS`."""
    parts, extra = VIDEO_PROMPTS[prompt]
    messages: Any = [{"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}]
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0.0, extra_body=extra
        )
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens


@pytest.mark.parametrize("prompt", list(VIDEO_PROMPTS))
@pytest.mark.parametrize(
    ("proxy", "encoder", "pd"),
    [("example", "e_ex", "pd_ex"), ("side_channel", "e_sc", "pd_sc"), ("epd", "e_ss", "p_ss"),
     ("ours_sc", "e_sc", "pd_sc"), ("ours_epd", "e_ss", "p_ss")],
)  # fmt: skip
def test_video_through_both_proxies_token_identical_and_decoded_only_by_the_encoder(
    dep: dict[str, Any], proxy: str, encoder: str, pd: str, prompt: str
) -> None:
    """A video (and an image beside a video, sampled by ``media_io_kwargs``) through
    vLLM's proxy and ours, E+PD and E+P+D: the answer is the aggregated one, the video
    is decoded and encoded by the encoder only, and prefill / decode get metadata-only
    ``video_embeds`` references (they decode no video and compute no encoder item)."""
    if prompt not in _AGG_VIDEO:
        _AGG_VIDEO[prompt] = ask_video(dep["agg"].url, prompt)
    e, d = dep[encoder], dep[pd]
    decoded_before = videos_taken(e)
    got = ask_video(dep["proxies"][proxy].url, prompt)
    assert got == _AGG_VIDEO[prompt], (proxy, dep["proxies"][proxy].log()[-2000:])
    if not proxy.startswith("ours"):
        rewrote = f"Rewrote {len(VIDEO_PROMPTS[prompt][0])} media item(s) as metadata references"
        assert rewrote in dep["proxies"][proxy].log()
    # Decoded, or (sent before, to the same encoder through the other proxy) taken
    # from its processed-video cache: once either way.
    assert videos_taken(e) == decoded_before + 1
    assert e.metric("video_frames_decoded_total") > 0
    downstream = [d, dep["d"]] if pd == "p_ss" else [d]
    for instance in downstream:
        assert instance.metric("videos_decoded_total") == 0, instance.log()
        assert instance.metric("video_cache_hits_total") == 0
        assert instance.metric("video_frames_decoded_total") == 0
        assert instance.metric("video_bytes_decoded_total") == 0
        assert instance.metric("encoder_items_computed_total") == 0
    assert d.metric("ec_load_fallbacks_total") == 0
    assert dep["agg"].metric("videos_decoded_total") >= 1


def videos_taken(instance: Any) -> float:
    """Videos ``instance`` decoded or took from its processed-video cache."""
    return instance.metric("videos_decoded_total") + instance.metric("video_cache_hits_total")


def behind_vllms_proxy(vllm_python: Path, model_dir: Path, prefix: str) -> Iterator[dict[str, Any]]:
    """An encoder ``e`` and a PD instance ``pd`` of ``model_dir`` over the side channel,
    behind vLLM's proxy, unmodified (its start, vLLM's imports, overlaps theirs)."""
    procs = {
        "e": serve(model_dir, f"{prefix}_e", ec=side_channel_ec("ec_producer")),
        "pd": serve(model_dir, f"{prefix}_pd", ec=side_channel_ec("ec_consumer")),
    }
    front = vllm_proxy(vllm_python, procs["e"].url, procs["pd"].url)
    try:
        start_all(list(procs.values()))
        front.wait_ready()
        yield {**procs, "proxy": front}
    finally:
        front.stop()
        stop_all(list(procs.values()))


@pytest.fixture(scope="module")
def qwen2_5(vllm_python: Path, tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    """A tiny Qwen2.5-VL (``tokens_per_second`` 2) behind vLLM's proxy."""
    m = write_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))
    write_qwen2_video_config(m)
    yield from behind_vllms_proxy(vllm_python, m, "q25")


@pytest.fixture(scope="module")
def qwen3(vllm_python: Path, tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    """A tiny Qwen3-VL (a video is an item per temporal patch, each after its time in
    the prompt) behind vLLM's proxy."""
    m = write_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))
    write_qwen3_video_config(m)
    yield from behind_vllms_proxy(vllm_python, m, "q3")


@pytest.fixture(scope="module")
def onevision(vllm_python: Path, tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    """LLaVA-OneVision (the family's tiny checkpoint) behind vLLM's proxy."""
    m = write_llava_onevision(tmp_path_factory.mktemp("llava_onevision"))
    yield from behind_vllms_proxy(vllm_python, m, "ov")


@pytest.mark.parametrize("prompt", list(VIDEO_PROMPTS))
def test_qwen2_5_vl_video_through_vllms_proxy_carries_its_frame_times(
    qwen2_5: dict[str, Any], prompt: str
) -> None:
    """The encoder reports ``{"video_grid_thw": [t, h, w], "second_per_grid_ts": [s]}``
    (vLLM's per-item lists); vLLM's proxy copies both into the ``video_embeds``
    reference, and PD places the video from them (without ``second_per_grid_ts`` it
    would be a 400), decoding and encoding nothing: its answer is the one PD gives
    when it is sent the video itself and decodes it (the aggregated path)."""
    e, pd, front = qwen2_5["e"], qwen2_5["pd"], qwen2_5["proxy"]
    metrics = ("videos_decoded_total", "encoder_items_computed_total", "ec_load_fallbacks_total")
    before = {m: pd.metric(m) for m in metrics}
    decoded = e.metric("videos_decoded_total")
    got = ask_video(front.url, prompt)
    rewrote = f"Rewrote {len(VIDEO_PROMPTS[prompt][0])} media item(s) as metadata references"
    assert rewrote in front.log()
    assert e.metric("videos_decoded_total") == decoded + 1
    assert {m: pd.metric(m) for m in metrics} == before, pd.log()[-2000:]
    assert got == ask_video(pd.url, prompt), front.log()[-2000:]
    assert pd.metric("videos_decoded_total") == before["videos_decoded_total"] + 1


@pytest.mark.parametrize("prompt", list(VIDEO_PROMPTS))
def test_qwen3_vl_video_through_vllms_proxy_carries_its_patch_times(
    qwen3: dict[str, Any], prompt: str
) -> None:
    """The encoder publishes the video as one entry (vLLM's proxy matches one per item
    it sent; one per temporal patch made it answer 502): ``video_grid_thw`` and
    ``timestamps`` as metadata, the patch items' entries under it. The proxy copies
    both keys into the ``video_embeds`` reference and the entry into PD's
    ``ec_transfer_params``; PD writes each patch's time from them and loads every
    patch, decoding and encoding nothing: its answer is the one it gives when it is
    sent the video itself and decodes it."""
    e, pd, front = qwen3["e"], qwen3["pd"], qwen3["proxy"]
    metrics = ("videos_decoded_total", "encoder_items_computed_total", "ec_load_fallbacks_total")
    before = {m: pd.metric(m) for m in metrics}
    loaded = pd.metric("ec_items_loaded_total")
    decoded = e.metric("videos_decoded_total")
    got = ask_video(front.url, prompt)
    rewrote = f"Rewrote {len(VIDEO_PROMPTS[prompt][0])} media item(s) as metadata references"
    assert rewrote in front.log()
    assert e.metric("videos_decoded_total") == decoded + 1
    assert {m: pd.metric(m) for m in metrics} == before, pd.log()[-2000:]
    assert pd.metric("ec_items_loaded_total") > loaded
    assert got == ask_video(pd.url, prompt), front.log()[-2000:]
    assert pd.metric("videos_decoded_total") == before["videos_decoded_total"] + 1


def test_llava_onevision_video_through_vllms_proxy_decoded_only_by_the_encoder(
    onevision: dict[str, Any],
) -> None:
    """A LLaVA-OneVision encoder's ``video_grid_thw`` ([frames, tile height, tile
    width]) is copied by vLLM's proxy into the ``video_embeds`` reference; the PD
    instance sizes the placeholder from it, loads the encoder output and decodes no
    video, computes no encoder item. Its answers are the ones it gives afterwards for
    the same chats sent to it directly (then it decodes and encodes them itself)."""
    pd, front = onevision["pd"], onevision["proxy"]
    got = {prompt: ask_video(front.url, prompt) for prompt in VIDEO_PROMPTS}
    for count in (1, 2):  # the video; the image and the video
        assert f"Rewrote {count} media item(s) as metadata references" in front.log()
    assert onevision["e"].metric("videos_decoded_total") == len(VIDEO_PROMPTS)
    for metric in ("videos_decoded_total", "encoder_items_computed_total"):
        assert pd.metric(metric) == 0, (metric, pd.log()[-2000:])
    assert pd.metric("ec_items_loaded_total") == 3
    assert pd.metric("ec_load_fallbacks_total") == 0
    for prompt, answer in got.items():
        assert answer == ask_video(pd.url, prompt), prompt
    assert pd.metric("videos_decoded_total") == len(VIDEO_PROMPTS)
