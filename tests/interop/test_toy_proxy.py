"""vLLM 0.33.0's toy P/D proxy (``tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py``), unmodified, in front of an ec-frontend prefill instance
and decode instance joined by ``KVSideChannelConnector``.

The proxy sends each request to the prefill instance with ``max_tokens: 1``,
``stream: false`` and NIXL-style ``kv_transfer_params`` (``do_remote_decode``),
then forwards the request to the decode instance with the ``kv_transfer_params``
prefill answered, and streams the decode instance's answer back. Behind it the
answers must be token for token those of one aggregated instance, streamed or
not, for chat and completions, with the decode instance pulling every prompt's KV
instead of computing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ..disagg.conftest import png_data_url, serve, side_channel_kv
from ..helpers.processes import start_all
from .conftest import MODEL_NAME, VllmScript

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOY_PROXY = Path("sdist/vllm-0.33.0/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py")


@pytest.fixture(scope="module")
def dep(vllm_python: Path, builtin_model_dir: Path) -> Iterator[dict[str, Any]]:
    m = builtin_model_dir
    procs = {
        "agg": serve(m, "agg"),
        "p": serve(m, "p", kv=side_channel_kv("kv_producer")),
        "d": serve(m, "d", kv=side_channel_kv("kv_consumer")),
    }
    start_all(list(procs.values()))
    proxy = VllmScript(
        vllm_python,
        TOY_PROXY,
        ["--host", "127.0.0.1", "--port", "{port}",
         "--prefiller-host", "127.0.0.1", "--prefiller-port", str(procs["p"].port),
         "--decoder-host", "127.0.0.1", "--decoder-port", str(procs["d"].port)],
        "/healthcheck",
    )  # fmt: skip
    try:
        proxy.wait_ready()
        yield {**procs, "proxy": proxy}
    finally:
        proxy.stop()
        for proc in procs.values():
            proc.stop()


PROMPTS: list[Any] = [
    "Once upon a time",
    [{"role": "user", "content": "tell me a story about a fox"}],
    [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url(56, (30, 90, 200))}},
        {"type": "text", "text": "what is this?"}]}],
]  # fmt: skip


def ask(url: str, prompt: Any, *, stream: bool) -> list[str]:
    """The greedy answer's pieces (one per chunk when streamed)."""
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        return _answer(client, prompt, stream=stream)


def _answer(client: openai.OpenAI, prompt: Any, *, stream: bool) -> list[str]:
    common: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0.0}
    if isinstance(prompt, str):
        if not stream:
            return [client.completions.create(prompt=prompt, **common).choices[0].text]
        chunks = client.completions.create(prompt=prompt, stream=True, **common)
        return [c.choices[0].text for c in chunks if c.choices]
    if not stream:
        r = client.chat.completions.create(messages=prompt, **common)
        return [r.choices[0].message.content or ""]
    chunks = client.chat.completions.create(messages=prompt, stream=True, **common)
    return [c.choices[0].delta.content or "" for c in chunks if c.choices]


@pytest.mark.parametrize("stream", [False, True])
def test_toy_proxy_is_token_identical_to_aggregated(dep: dict[str, Any], stream: bool) -> None:
    decode = dep["d"]
    received = decode.metric("kv_tokens_received_total")
    for prompt in PROMPTS:
        want = ask(dep["agg"].url, prompt, stream=stream)
        got = ask(dep["proxy"].url, prompt, stream=stream)
        assert got == want, (prompt, dep["proxy"].log()[-2000:])
    assert decode.metric("kv_tokens_received_total") > received
    assert decode.metric("kv_local_prefill_fallbacks_total") == 0
    assert decode.metric("encoder_items_computed_total") == 0
    assert dep["p"].metric("encoder_items_computed_total") >= 1
