"""Prefix caching through a real server on the built-in model and the ``openai`` client:
a second chat turn is served from the first one's KV (``cached_tokens``, the
``prefix_cache_*`` counters), tenants with different ``cache_salt`` share nothing,
and ``n = 2`` shares its prompt between the two sequences."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image

from ..helpers.processes import Proc

MODEL = "tiny"
BLOCK = 16

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(builtin_model_dir: Path) -> Iterator[Proc]:
    args = ["--model", str(builtin_model_dir), "--device", "cpu", "--max-model-len", "1024"]
    proc = Proc("serve", [*args, "--served-model-name", MODEL], "server").wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture
def client(server: Proc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def png_url(color: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0.0, **extra
    )


def cached(response: Any) -> int:
    return int(response.usage.prompt_tokens_details.cached_tokens)


def test_second_turn_reads_the_first_turns_kv(server: Proc, client: openai.OpenAI) -> None:
    first = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_url((10, 200, 30))}},
                {"type": "text", "text": "What is in this picture? Answer at length."},
            ],
        }
    ]
    r1 = chat(client, first)
    assert cached(r1) == 0
    second = [
        *first,
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And what colour is it?"},
    ]
    hits = server.metric("prefix_cache_hits_total")
    queries = server.metric("prefix_cache_queries_total")
    r2 = chat(client, second)
    # At least turn 1's prompt, whole blocks of it, comes from the cache.
    assert cached(r2) >= (r1.usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
    assert cached(r2) % BLOCK == 0 and cached(r2) < r2.usage.prompt_tokens
    assert server.metric("prefix_cache_hits_total") - hits == cached(r2)
    assert server.metric("prefix_cache_queries_total") - queries == r2.usage.prompt_tokens
    # The same conversation again: everything but the last token's block.
    r3 = chat(client, second)
    assert cached(r3) == (r2.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert r3.choices[0].message.content == r2.choices[0].message.content


def test_tenants_with_different_salts_share_nothing(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You answer several tenants."},
        {"role": "user", "content": "A question that each of them asks. " * 4},
    ]
    a1 = chat(client, messages, extra_body={"cache_salt": "tenant-a"})
    b1 = chat(client, messages, extra_body={"cache_salt": "tenant-b"})
    plain = chat(client, messages)
    a2 = chat(client, messages, extra_body={"cache_salt": "tenant-a"})
    b2 = chat(client, messages, extra_body={"cache_salt": "tenant-b"})
    assert [cached(r) for r in (a1, b1, plain)] == [0, 0, 0]
    full = (a1.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert cached(a2) == cached(b2) == full > 0
    texts = {r.choices[0].message.content for r in (a1, b1, plain, a2, b2)}
    assert len(texts) == 1


def test_n_sequences_share_their_prompt(server: Proc, client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You give two answers."},
        {"role": "user", "content": "Two answers to one fresh question, please. " * 3},
    ]
    hits = server.metric("prefix_cache_hits_total")
    r = chat(client, messages, n=2)
    assert r.choices[0].message.content == r.choices[1].message.content
    assert server.metric("prefix_cache_hits_total") - hits == (
        (r.usage.prompt_tokens - 1) // BLOCK * BLOCK
    )
