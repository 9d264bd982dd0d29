"""vLLM 0.33.0's own API server layer over a stub engine (``benches/vllm_api_stub_driver.py``).

The benchmark ``benches/bench_vs_vllm_api.py`` measures ec-frontend against this
server; these tests keep its driver from rotting as vLLM or the built-in model
change. The server must start on this GPU-less host, answer chat through vLLM's
unmodified routes with the real chat template, tokenizer and image processor,
and generate exactly as ec-frontend's ``--mock-engine`` does: ``max_tokens``
tokens echoed from the prompt (in order when greedy), one stream chunk per token.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from ..disagg.conftest import image_part, png_data_url
from .conftest import MODEL_NAME, REPO, VllmScript

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

DRIVER = REPO / "benches" / "vllm_api_stub_driver.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stub_server(vllm_python: Path, builtin_model_dir: Path) -> Iterator[VllmScript]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        server = VllmScript(
            vllm_python,
            DRIVER,
            ["--model", str(builtin_model_dir), "--served-model-name", MODEL_NAME,
             "--host", "127.0.0.1", "--port", "{port}", "--max-model-len", "1024",
             "--disable-uvicorn-access-log"],
            "/health",
        )  # fmt: skip
    try:
        server.wait_ready(300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hf(builtin_model_dir: Path) -> tuple[Any, Any]:
    """transformers' tokenizer and (PIL) image processor of the built-in checkpoint."""
    tokenizer = AutoTokenizer.from_pretrained(builtin_model_dir)
    return tokenizer, AutoImageProcessor.from_pretrained(builtin_model_dir, backend="pil")


@pytest.fixture(scope="module")
def client(stub_server: VllmScript) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stub_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def prompt_ids(hf: tuple[Any, Any], messages: list[dict[str, Any]], image: Any = None) -> list[int]:
    """The prompt's token ids by transformers: chat template, tokenizer, and the image's
    placeholder repeated once per merged patch of the grid its processor produces."""
    tokenizer, image_processor = hf
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if image is None:
        return ids
    grid = image_processor(images=[image])["image_grid_thw"][0]
    count = int(grid.prod()) // image_processor.merge_size**2
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    at = ids.index(pad)
    return ids[:at] + [pad] * count + ids[at + 1 :]


def image_of(data_url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).convert("RGB")


def test_chat_echoes_the_templated_prompt(client: openai.OpenAI, hf: tuple[Any, Any]) -> None:
    messages = [{"role": "user", "content": "hello from the interop test"}]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    ids = prompt_ids(hf, messages)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.choices[0].finish_reason == "length"
    tokenizer = hf[0]
    expected = "".join(tokenizer.decode([t], skip_special_tokens=True) for t in ids[:MAX_TOKENS])
    assert reply.choices[0].message.content == expected


def test_chat_with_an_image_streams_one_chunk_per_token(
    client: openai.OpenAI, hf: tuple[Any, Any]
) -> None:
    url = png_data_url(64, (30, 140, 200))
    parts = [{"type": "text", "text": "what is this?"}, image_part(url)]
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    token_chunks = 0
    finish = None
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role is None:
                token_chunks += 1
            finish = choice.finish_reason or finish
    assert token_chunks == MAX_TOKENS
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    hf_messages = [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image"}]}
    ]
    with_image = prompt_ids(hf, hf_messages, image_of(url))
    assert usage.prompt_tokens == len(with_image)


def test_bad_request_is_a_400_and_the_server_stays_up(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=MAX_TOKENS,
            n=2,
        )
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "again"}], max_tokens=2
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 2
