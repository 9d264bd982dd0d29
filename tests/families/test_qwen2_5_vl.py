"""Qwen2.5-VL against ``transformers``' own classes, then served end to end.

The checkpoint is a tiny random one written by ``Qwen2_5_VLForConditionalGeneration``
and Qwen2.5-VL's processor (``conftest.write_qwen2_5_vl``). Our processor must
give the token ids, pixels, grids and M-RoPE positions that ``transformers``'
processor and ``get_rope_index`` give; a served greedy chat must produce the
tokens of ``generate(do_sample=False)``; E+PD and E+P+D deployments through
``ec-frontend proxy`` must produce the aggregated instance's tokens.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from ec_frontend.model.loader import load_processor
from ec_frontend.model.processor import InputProcessor, ProcessedInputs
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

from ..disagg.conftest import proxy, serve, side_channel_ec, side_channel_kv
from ..helpers.processes import Proc, start_all
from .conftest import data_url, image_bytes, load_hf_processor

MAX_TOKENS = 8
#: (image sizes (w, h), text) per case: no image, one, two of different sizes.
CASES = {
    "text": ([], "Tell me about the lighthouse."),
    "one-image": ([(84, 56)], "What is in this picture?"),
    "two-images": ([(112, 84), (56, 140)], "Compare the two pictures."),
}


@dataclass(frozen=True, slots=True)
class Media:
    data: bytes
    mm_hash: str


def images(case: str) -> list[bytes]:
    return [image_bytes(w, h, seed=i) for i, (w, h) in enumerate(CASES[case][0])]


def chat_messages(case: str, *, urls: bool) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for i, png in enumerate(images(case)):
        if urls:
            parts.append({"type": "image_url", "image_url": {"url": data_url(png)}})
        else:
            parts.append({"type": "image", "media_index": i})
    parts.append({"type": "text", "text": CASES[case][1]})
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def ours(qwen2_5_vl_dir: Path) -> InputProcessor:
    return load_processor(qwen2_5_vl_dir)


@pytest.fixture(scope="module")
def hf(qwen2_5_vl_dir: Path) -> tuple[Any, Qwen2_5_VLForConditionalGeneration]:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_dir, dtype=torch.float32)
    return load_hf_processor(qwen2_5_vl_dir), model.eval()


def process(ours: InputProcessor, case: str) -> ProcessedInputs:
    media = [Media(png, f"{i:x}") for i, png in enumerate(images(case))]
    return ours.process_chat(chat_messages(case, urls=False), media)


def hf_inputs(hf_processor: Any, case: str) -> dict[str, torch.Tensor]:
    msgs = [{"role": "user", "content": [{"type": "image"}] * len(CASES[case][0])
             + [{"type": "text", "text": CASES[case][1]}]}]  # fmt: skip
    text = hf_processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(png)) for png in images(case)]
    return dict(hf_processor(text=[text], images=pil or None, return_tensors="pt"))


@pytest.mark.parametrize("case", CASES)
def test_processor_and_rope_index_match_transformers(ours, hf, case):
    hf_processor, hf_model = hf
    mine = process(ours, case)
    ref = hf_inputs(hf_processor, case)
    ids = ref["input_ids"]
    assert mine.prompt_token_ids == ids[0].tolist()
    image_token = hf_model.config.image_token_id
    placeholders = [f.length for f in mine.mm_features]
    grids = ref.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.int64))
    assert placeholders == (grids.prod(-1) // 4).tolist()
    assert sum(placeholders) == int((ids == image_token).sum())
    assert [list(f.image_grid_thw) for f in mine.mm_features] == grids.tolist()
    if mine.mm_features:
        pixels = torch.cat([f.pixel_values for f in mine.mm_features])
        torch.testing.assert_close(pixels, ref["pixel_values"], atol=0, rtol=0)
    positions, delta = hf_model.model.get_rope_index(
        ids, (ids == image_token).int(), image_grid_thw=grids if len(grids) else None
    )
    assert torch.equal(mine.mrope_positions, positions[:, 0])
    assert mine.mrope_position_delta == int(delta)


def hf_generate(hf: Any, case: str) -> list[int]:
    hf_processor, hf_model = hf
    inputs = hf_inputs(hf_processor, case)
    with torch.no_grad():
        out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def dep(qwen2_5_vl_dir: Path) -> Iterator[dict[str, Proc]]:
    m = qwen2_5_vl_dir
    engines = {
        "agg": serve(m, "agg"),
        "e": serve(m, "e", ec=side_channel_ec("ec_producer")),
        "pd": serve(
            m, "pd", ec=side_channel_ec("ec_consumer"), kv=side_channel_kv("kv_both", ttl_s=10.0)
        ),
        "d": serve(m, "d", kv=side_channel_kv("kv_consumer")),
    }
    procs = start_all(list(engines.values()))
    proxies = {
        "E+PD": proxy("px_epd", encode=[engines["e"].url], decode=[engines["pd"].url]),
        "E+P+D": proxy(
            "px_e_p_d",
            encode=[engines["e"].url],
            prefill=[engines["pd"].url],
            decode=[engines["d"].url],
        ),
    }
    procs += start_all(list(proxies.values()))
    yield {**engines, **proxies}
    for p in procs:
        p.stop()


def served_tokens(p: Proc, case: str, *, stream: bool = False) -> list[int]:
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "messages": chat_messages(case, urls=True),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }
    with openai.OpenAI(base_url=p.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        if not stream:
            r = c.chat.completions.create(**kwargs)
            return list((r.choices[0].model_extra or {})["token_ids"])
        tokens: list[int] = []
        for chunk in c.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                tokens += (choice.model_extra or {}).get("token_ids") or []
        return tokens


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_served_greedy_matches_transformers_generate_in_every_topology(dep, hf, case):
    want = hf_generate(hf, case)
    assert len(want) >= 2
    assert served_tokens(dep["agg"], case) == want
    assert served_tokens(dep["agg"], case, stream=True) == want
    for topology in ("E+PD", "E+P+D"):
        assert served_tokens(dep[topology], case) == want, topology
        assert served_tokens(dep[topology], case, stream=True) == want, topology


@pytest.mark.slow
def test_disaggregated_instances_did_their_part_only(dep):
    """Through E+P+D, fresh images are encoded once on E, prefill loads them instead of
    encoding, and decode receives the whole prompt's KV."""
    names = ("e", "pd", "d")
    before = {n: dep[n].metrics() for n in names}
    prompt_tokens = 0
    for seed in (101, 202):
        msgs = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image_bytes(70, 42, seed))}},
            {"type": "text", "text": "What is this?"}]}]  # fmt: skip
        with openai.OpenAI(base_url=dep["E+P+D"].url + "/v1", api_key="x", max_retries=0) as c:
            r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
        assert r.usage is not None
        prompt_tokens += r.usage.prompt_tokens

    def delta(name: str, metric: str) -> float:
        key = "ec_frontend_" + metric
        return dep[name].metrics().get(key, 0.0) - before[name].get(key, 0.0)

    assert delta("e", "encoder_items_computed_total") == 2
    assert delta("pd", "encoder_items_computed_total") == 0
    assert delta("pd", "ec_items_loaded_total") == 2
    assert delta("pd", "kv_tokens_sent_total") == prompt_tokens
    assert delta("d", "kv_tokens_received_total") == prompt_tokens
