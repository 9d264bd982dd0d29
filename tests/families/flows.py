"""What every family's tests run: the request cases, transformers' side of each, a
deployment (aggregated, E+PD, E+P+D through ``ec-frontend proxy``) and the checks."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from ec_frontend.model.loader import load_processor
from ec_frontend.model.processor import InputProcessor
from PIL import Image

from ..disagg.conftest import proxy, serve, side_channel_ec, side_channel_kv
from ..helpers.processes import Proc, start_all, stop_all
from .conftest import data_url, image_bytes

MAX_TOKENS = 8
#: (image sizes (w, h), text) per case: no image, one, two of different sizes.
CASES = {
    "text": ([], "Tell me about the lighthouse."),
    "one-image": ([(84, 56)], "What is in this picture?"),
    "two-images": ([(112, 84), (56, 140)], "Compare the two pictures."),
}


@dataclass(frozen=True, slots=True)
class Media:
    """Stands in for the native ``MediaItem`` (the processor reads these two)."""

    data: bytes
    mm_hash: str


def images(case: str) -> list[bytes]:
    return [image_bytes(w, h, seed=i) for i, (w, h) in enumerate(CASES[case][0])]


def media(case: str) -> list[Media]:
    return [Media(png, f"{i:x}") for i, png in enumerate(images(case))]


def chat_messages(case: str, *, urls: bool) -> list[dict[str, Any]]:
    """The case as chat messages: image parts by URL (for the server) or by media index
    (for the processor), then the text."""
    parts: list[dict[str, Any]] = []
    for i, png in enumerate(images(case)):
        if urls:
            parts.append({"type": "image_url", "image_url": {"url": data_url(png)}})
        else:
            parts.append({"type": "image", "media_index": i})
    parts.append({"type": "text", "text": CASES[case][1]})
    return [{"role": "user", "content": parts}]


def hf_inputs(hf_processor: Any, case: str, *, nested: bool = False) -> dict[str, torch.Tensor]:
    """The case through ``transformers``' processor of the family; ``nested`` gives the
    images as one sample's list (LLaVA-OneVision's processor counts them per sample)."""
    msgs = [{"role": "user", "content": [{"type": "image"}] * len(CASES[case][0])
             + [{"type": "text", "text": CASES[case][1]}]}]  # fmt: skip
    text = hf_processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    pil: list[Any] = [Image.open(io.BytesIO(png)) for png in images(case)]
    if nested and pil:
        pil = [pil]
    return dict(hf_processor(text=[text], images=pil or None, return_tensors="pt"))


def hf_generate(hf_processor: Any, hf_model: Any, case: str, *, nested: bool = False) -> list[int]:
    inputs = hf_inputs(hf_processor, case, nested=nested)
    with torch.no_grad():
        out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@contextmanager
def deployment(model_dir: Path) -> Iterator[dict[str, Proc]]:
    """``agg``; encoder ``e`` -> prefill ``pd`` (EC consumer, KV producer) -> decode ``d``
    over the side channels; proxies ``E+PD`` (e -> pd) and ``E+P+D`` (e -> pd -> d)."""
    m = model_dir
    engines = {
        "agg": serve(m, "agg"),
        "e": serve(m, "e", ec=side_channel_ec("ec_producer")),
        "pd": serve(
            m, "pd", ec=side_channel_ec("ec_consumer"), kv=side_channel_kv("kv_both", ttl_s=10.0)
        ),
        "d": serve(m, "d", kv=side_channel_kv("kv_consumer")),
    }
    procs = start_all(list(engines.values()))
    try:
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
    finally:
        stop_all(procs)


def served_tokens(p: Proc, case: str, *, stream: bool = False) -> list[int]:
    """Greedy chat completion of the case; the generated token ids (``return_token_ids``)."""
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


def prefill_kv_params(p: Proc, case: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill instance hands out for the case's chat."""
    body = {"model": "tiny", "messages": chat_messages(case, urls=True), "max_tokens": 1,
            "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    r = httpx.post(p.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    kv = r.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_num_tokens"] > 0
    return kv


def check_served_equals(dep: dict[str, Proc], case: str, want: list[int]) -> None:
    """Aggregated, E+PD and E+P+D, streamed and not, all give ``want``."""
    assert len(want) >= 2
    for name in ("agg", "E+PD", "E+P+D"):
        assert served_tokens(dep[name], case) == want, name
        assert served_tokens(dep[name], case, stream=True) == want, name


def check_disaggregated_parts(dep: dict[str, Proc], size: tuple[int, int]) -> None:
    """Through E+P+D, two fresh images are encoded once on E, prefill loads them
    instead of encoding, and decode receives each whole prompt's KV."""
    names = ("e", "pd", "d")
    before = {n: dep[n].metrics() for n in names}
    prompt_tokens = 0
    for seed in (101, 202):
        msgs = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image_bytes(*size, seed))}},
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


def family_fixtures(dir_fixture: str, hf_class: Any, load_hf: Callable[[Path], Any]) -> Any:
    """The module fixtures of the family whose checkpoint directory is the fixture
    ``dir_fixture``: ``ours`` (our processor), ``hf`` (transformers' processor and
    ``hf_class`` model, float32, eval) and ``dep`` (its deployment)."""

    @pytest.fixture(scope="module")
    def ours(request: pytest.FixtureRequest) -> InputProcessor:
        return load_processor(request.getfixturevalue(dir_fixture))

    @pytest.fixture(scope="module")
    def hf(request: pytest.FixtureRequest) -> tuple[Any, Any]:
        directory = request.getfixturevalue(dir_fixture)
        model = hf_class.from_pretrained(directory, dtype=torch.float32)
        return load_hf(directory), model.eval()

    @pytest.fixture(scope="module")
    def dep(request: pytest.FixtureRequest) -> Iterator[dict[str, Proc]]:
        with deployment(request.getfixturevalue(dir_fixture)) as procs:
            yield procs

    return ours, hf, dep


class ServedInEveryTopology:
    """The end-to-end tests of every family, on its module's ``dep`` and ``hf``
    fixtures; a family's module runs them as ``class TestServed(ServedInEveryTopology)``."""

    #: ``hf_generate``'s ``nested`` (each sample's images as one list).
    nested = False

    @pytest.mark.slow
    @pytest.mark.parametrize("case", CASES)
    def test_served_greedy_matches_transformers_generate_in_every_topology(
        self, dep: dict[str, Proc], hf: tuple[Any, Any], case: str
    ) -> None:
        check_served_equals(dep, case, hf_generate(*hf, case, nested=self.nested))

    @pytest.mark.slow
    def test_disaggregated_instances_did_their_part_only(self, dep: dict[str, Proc]) -> None:
        check_disaggregated_parts(dep, (70, 42))


def check_qwen_processor(
    ours: InputProcessor, hf: tuple[Any, Any], case: str, token_types: Callable[..., Any]
) -> None:
    """A Qwen-VL family's processor against transformers': token ids, placeholders,
    grids, pixels, and M-RoPE positions and delta from its ``get_rope_index``, given
    ``token_types(ids, image_token, ref)`` (its second argument)."""
    hf_processor, hf_model = hf
    mine = ours.process_chat(chat_messages(case, urls=False), media(case))
    ref = hf_inputs(hf_processor, case)
    ids = ref["input_ids"]
    assert mine.prompt_token_ids == ids[0].tolist()
    image_token = hf_model.config.image_token_id
    placeholders = [f.length for f in mine.mm_features]
    grids = ref.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.int64))
    assert placeholders == (grids.prod(-1) // 4).tolist()
    assert sum(placeholders) == int((ids == image_token).sum())
    assert [list(f.image_grid_thw) for f in mine.mm_features] == grids.tolist()
    for f in mine.mm_features:
        assert ids[0, f.offset : f.offset + f.length].eq(image_token).all()
    if mine.mm_features:
        pixels = torch.cat([f.pixel_values for f in mine.mm_features])
        torch.testing.assert_close(pixels, ref["pixel_values"], atol=0, rtol=0)
    positions, delta = hf_model.model.get_rope_index(
        ids, token_types(ids, image_token, ref), image_grid_thw=grids if len(grids) else None
    )
    assert torch.equal(mine.mrope_positions, positions[:, 0])
    assert mine.mrope_position_delta == int(delta)
