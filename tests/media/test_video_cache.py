"""Processed videos kept by content (``--mm-processor-cache-gb``): a video sent again
with the same sampling and pixel range is not decoded again and gives what its decode
gave; other sampling, other pixels, other bytes under the same ``uuid`` are decoded."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.metrics import VIDEO_CACHE_HITS, VIDEOS_DECODED
from ec_frontend.model.errors import InputError
from ec_frontend.model.loader import load_processor
from ec_frontend.model.processor import InputProcessor, ProcessedInputs
from ec_frontend.model.video_cache import ProcessedVideoCache, content_key
from openai import OpenAI

from ..helpers.processes import Proc, start_all
from ..helpers.video import make_audio_only, make_clip

MESSAGES = [{"role": "user", "content": [
    {"type": "video", "media_index": 0}, {"type": "text", "text": "what?"}]}]  # fmt: skip


class Item:
    """A video item as the Rust parser hands it over."""

    def __init__(self, data: bytes, mm_hash: str) -> None:
        self.data, self.mm_hash, self.param, self.kind = data, mm_hash, "messages[0]", "video"


@pytest.fixture(scope="module")
def processor(builtin_model_dir: Path) -> InputProcessor:
    proc = load_processor(builtin_model_dir)
    proc.configure_media(video_cache_bytes=1 << 30)
    return proc


def chat(proc: InputProcessor, data: bytes, mm_hash: str = "a" * 32, **kw: Any) -> ProcessedInputs:
    return proc.process_chat(MESSAGES, [Item(data, mm_hash)], **kw)


def decodes() -> float:
    return VIDEOS_DECODED.get()


def same(a: ProcessedInputs, b: ProcessedInputs) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    (fa,), (fb,) = a.mm_features, b.mm_features
    assert fa.image_grid_thw == fb.image_grid_thw and fa.length == fb.length
    assert fa.pixel_values is not None and fb.pixel_values is not None
    assert torch.equal(fa.pixel_values, fb.pixel_values)
    assert a.mrope_positions is not None and b.mrope_positions is not None
    assert torch.equal(a.mrope_positions, b.mrope_positions)


# ------------------------------------------------------------------ the cache alone


def test_the_cache_is_bounded_by_bytes_and_drops_the_least_recently_used() -> None:
    cache: ProcessedVideoCache[str] = ProcessedVideoCache(100)
    keys = [content_key(bytes([i]) * 10, i) for i in range(4)]
    assert cache.put(keys[0], "v0", 40) and cache.put(keys[1], "v1", 40)
    assert cache.get(keys[0]) == "v0"  # now the most recent
    assert cache.put(keys[2], "v2", 40)  # 120 > 100: v1, the least recent, goes
    assert cache.get(keys[1]) is None
    assert (cache.get(keys[0]), cache.get(keys[2])) == ("v0", "v2")
    assert cache.used_bytes == 80 and len(cache) == 2
    assert not cache.put(keys[3], "big", 101)  # larger than the whole cache: not kept
    assert cache.get(keys[3]) is None and cache.used_bytes == 80
    assert cache.put(keys[0], "v0 again", 10)  # replacing an entry counts its new size
    assert cache.used_bytes == 50 and cache.get(keys[0]) == "v0 again"
    assert (cache.hits, cache.misses) == (4, 2)
    with pytest.raises(ValueError, match=">= 0"):
        ProcessedVideoCache(-1)


def test_keys_cover_the_bytes_and_every_option() -> None:
    data = make_clip(frames=4, width=28, height=28)
    assert content_key(data, 4) == content_key(bytes(data), 4)
    assert content_key(data, 4) != content_key(data, 8)
    assert content_key(data, 4) != content_key(data[:-1] + b"\0", 4)


# ------------------------------------------------------------------ the processor


def test_a_video_sent_again_is_not_decoded_again(processor: InputProcessor) -> None:
    clip = make_clip(frames=8, width=56, height=56)
    before = decodes()
    first = chat(processor, clip)
    assert decodes() == before + 1
    hits = VIDEO_CACHE_HITS.get()
    again = chat(processor, clip)
    assert decodes() == before + 1
    assert VIDEO_CACHE_HITS.get() == hits + 1
    same(first, again)


def test_the_same_bytes_under_another_key_are_decoded(processor: InputProcessor) -> None:
    """Another ``mm_hash`` (another ``cache_salt``, or ``uuid``) is another entry: a
    tenant's repeated video is not found by a tenant of another salt."""
    clip = make_clip(frames=8, width=84, height=56)
    first = chat(processor, clip, mm_hash="d" * 32)
    before = decodes()
    other = chat(processor, clip, mm_hash="e" * 32)
    assert decodes() == before + 1
    assert other.mm_features[0].mm_hash == "e" * 32
    assert torch.equal(other.mm_features[0].pixel_values, first.mm_features[0].pixel_values)


def test_other_sampling_or_pixels_are_decoded_and_give_their_own_frames(
    processor: InputProcessor,
) -> None:
    clip = make_clip(frames=8, width=112, height=112)
    base = chat(processor, clip)
    before = decodes()
    four = chat(processor, clip, media_io_kwargs={"video": {"num_frames": 4}})
    assert decodes() == before + 1
    assert four.mm_features[0].image_grid_thw[0] == base.mm_features[0].image_grid_thw[0] // 2
    small = chat(processor, clip, mm_processor_kwargs={"max_pixels": 56 * 56})
    assert decodes() == before + 2
    assert small.mm_features[0].length < base.mm_features[0].length
    # each again: from the cache, equal to its own decode
    same(chat(processor, clip, media_io_kwargs={"video": {"num_frames": 4}}), four)
    same(chat(processor, clip, mm_processor_kwargs={"max_pixels": 56 * 56}), small)
    assert decodes() == before + 2


def test_other_bytes_under_the_same_uuid_are_decoded(processor: InputProcessor) -> None:
    one = make_clip(frames=8, width=56, height=56)
    other = make_clip(frames=8, width=56, height=84)
    first = chat(processor, one, mm_hash="c" * 32)
    before = decodes()
    second = chat(processor, other, mm_hash="c" * 32)
    assert decodes() == before + 1
    assert second.mm_features[0].image_grid_thw != first.mm_features[0].image_grid_thw


def test_a_bad_video_is_refused_every_time(processor: InputProcessor) -> None:
    bad = make_audio_only()
    for _ in range(2):
        with pytest.raises(InputError) as info:
            chat(processor, bad)
        assert info.value.code == "invalid_video" and info.value.param == "messages[0]"


def test_without_a_cache_every_request_decodes(builtin_model_dir: Path) -> None:
    proc = load_processor(builtin_model_dir)
    proc.configure_media(video_cache_bytes=0)
    clip = make_clip(frames=8, width=56, height=56)
    before = decodes()
    same(chat(proc, clip), chat(proc, clip))
    assert decodes() == before + 2


def test_a_video_larger_than_the_cache_is_not_kept(builtin_model_dir: Path) -> None:
    proc = load_processor(builtin_model_dir)
    proc.configure_media(video_cache_bytes=1000)  # one 56x56 frame pair is 12 KiB of pixels
    clip = make_clip(frames=8, width=56, height=56)
    before = decodes()
    chat(proc, clip)
    chat(proc, clip)
    assert decodes() == before + 2
    assert proc.video_cache is not None and len(proc.video_cache) == 0


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server(builtin_model_dir: Path) -> Any:
    procs = start_all([Proc("serve", ["--model", str(builtin_model_dir), "--device", "cpu",
                                      "--max-model-len", "1024"], "builtin")])  # fmt: skip
    yield procs[0]
    procs[0].stop()


def test_a_chat_about_one_video_decodes_it_once(server: Proc) -> None:
    clip = make_clip(frames=8, width=56, height=84)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    before = server.metric("videos_decoded_total")
    hits = server.metric("video_cache_hits_total")
    messages: list[Any] = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "what happens?"}]}]  # fmt: skip
    answers = []
    for turn in range(3):
        out = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=messages,
            max_tokens=4,
            temperature=0.0,
        )
        answers.append(out.choices[0].message.content)
        messages += [
            {"role": "assistant", "content": answers[-1]},
            {"role": "user", "content": f"and then? ({turn})"},
        ]
    assert server.metric("videos_decoded_total") == before + 1
    assert server.metric("video_cache_hits_total") == hits + 2
    # the first turn again, with the video from the cache, answers as it did
    again = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages[:1],
        max_tokens=4,
        temperature=0.0,
    )
    assert again.choices[0].message.content == answers[0]
    assert server.metric("videos_decoded_total") == before + 1
