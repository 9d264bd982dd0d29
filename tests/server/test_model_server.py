"""The server on the built-in model (CPU), through the official openai client.

The server runs with the echo connectors of ``ec_test_connectors``: their
``request_finished`` returns what the engine's ``Request`` read from
``extra_args``, so the transfer params' whole path is visible from outside.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ec_frontend as ecf
import httpx
import openai
import orjson
import pytest
from ec_frontend.model.loader import load_processor

from .conftest import MODEL_NAME, ServerProcess, png_data_url, responses_image_input

pytestmark = pytest.mark.slow

KV = {"do_remote_decode": True, "remote_block_ids": [3, 4]}
EC = {"0123abcd": {"peer_host": "127.0.0.1", "peer_port": 5501}}
IMAGE_MESSAGES: list[Any] = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "describe the picture"},
            {"type": "image_url", "image_url": {"url": png_data_url(56)}},
        ],
    }
]


@pytest.fixture(scope="module")
def client(model_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_chat_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage is not None and r.usage.prompt_tokens > 3
    assert r.usage.completion_tokens == 6 or r.choices[0].finish_reason == "stop"


def test_chat_image_with_transfer_params_and_stream_parity(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": IMAGE_MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"kv_transfer_params": KV, "ec_transfer_params": EC},
    }
    r = client.chat.completions.create(**kwargs)
    extra = r.model_extra or {}
    kv = extra["kv_transfer_params"]
    # The connector receives the request's params with the server's stamp of who asked.
    assert kv["connector"] == "EchoKVConnector"
    assert kv["received"] == {**KV, "hold_client": "127.0.0.1"}
    assert kv["extra_args_keys"] == ["ec_transfer_params", "kv_transfer_params"]
    assert kv["num_blocks"] >= 1
    assert extra["ec_transfer_params"] == {"connector": "EchoECConnector", "received": EC}

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    final_extra = finals[0].model_extra or {}
    assert final_extra["kv_transfer_params"]["received"] == {**KV, "hold_client": "127.0.0.1"}
    assert final_extra["ec_transfer_params"] == {"connector": "EchoECConnector", "received": EC}
    assert all("kv_transfer_params" not in (c.model_extra or {}) for c in chunks if c != finals[0])


def test_chat_without_params_connector_sees_none(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    extra = r.model_extra or {}
    assert extra["kv_transfer_params"]["received"] is None
    assert extra["kv_transfer_params"]["extra_args_keys"] == []
    assert extra["ec_transfer_params"]["received"] is None


def test_chat_n_and_seed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "tell me about the picture"}],
        "max_tokens": 12,
        "temperature": 1.0,
        "n": 2,
        "seed": 7,
    }
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]


def test_completions_stream_and_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL_NAME, prompt="the cat", max_tokens=5, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs or [])
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="the cat", max_tokens=5, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_responses(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL_NAME,
        input=responses_image_input("what is this", png_data_url(56)),
        max_output_tokens=6,
        temperature=0,
        extra_body={"kv_transfer_params": {}},
    )
    assert isinstance(r.output_text, str) and r.usage is not None
    assert (r.model_extra or {})["kv_transfer_params"]["received"] == {}
    events = list(
        client.responses.create(
            model=MODEL_NAME,
            input="what is this",
            max_output_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert events[0].type == "response.created"
    assert any(e.type == "response.output_text.delta" for e in events)
    assert events[-1].type in ("response.completed", "response.incomplete")


@pytest.mark.parametrize(
    ("params", "kv_received", "ec_received"),
    [
        ({"kv_transfer_params": {}, "ec_transfer_params": {}}, {}, {}),
        ({"kv_transfer_params": {"x": 1}}, {"x": 1}, None),
        ({}, None, None),
    ],
)
def test_generate_forwards_params_is_not_none(
    model_server: ServerProcess, params: dict[str, Any], kv_received: Any, ec_received: Any
) -> None:
    body = {
        "token_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": 3, "temperature": 0},
        "output_mode": "text",
        **params,
    }
    r = httpx.post(model_server.url + "/inference/v1/generate", content=orjson.dumps(body))
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    assert len(choice["token_ids"]) == 3 and isinstance(choice["text"], str)
    assert data["kv_transfer_params"]["received"] == kv_received
    assert data["ec_transfer_params"]["received"] == ec_received


def test_generate_bad_token_id_is_400(model_server: ServerProcess) -> None:
    body = {"token_ids": [5, 10_000_000], "sampling_params": {"max_tokens": 2}}
    r = httpx.post(model_server.url + "/inference/v1/generate", content=orjson.dumps(body))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "token_ids[1]"


IDLE = {
    "ec_frontend_num_requests_running": 0.0,
    "ec_frontend_num_requests_waiting": 0.0,
    "ec_frontend_kv_blocks_used": 0.0,
    "ec_frontend_encoder_cache_refs": 0.0,
    "ec_frontend_http_requests_in_flight": 0.0,
}


def test_disconnect_mid_stream_frees_kv_and_encoder_refs(model_server: ServerProcess) -> None:
    body = orjson.dumps(
        {
            "model": MODEL_NAME,
            "messages": IMAGE_MESSAGES,
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
    )
    with httpx.stream(
        "POST", model_server.url + "/v1/chat/completions", content=body, timeout=60
    ) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n == 4:
                busy = model_server.metrics()
                break
    assert busy["ec_frontend_kv_blocks_used"] > 0
    assert busy["ec_frontend_encoder_cache_refs"] + busy["ec_frontend_encoder_cache_usage"] > 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = model_server.metrics()
        if all(m[k] == v for k, v in IDLE.items()):
            break
        time.sleep(0.1)
    assert {k: m[k] for k in IDLE} == IDLE
    assert m["ec_frontend_requests_aborted_total"] >= 1
    assert httpx.get(model_server.url + "/health").status_code == 200


def test_generate_with_features_reuses_the_encoded_image(
    model_server: ServerProcess, builtin_model_dir: Path
) -> None:
    """A chat request encodes an image; generate then names it by mm_hash and placeholders
    (no pixels) and continues exactly as the chat did."""
    model_id = httpx.get(model_server.url + "/v1/models").json()["data"][0]["root"]
    chat_body = orjson.dumps(
        {"model": MODEL_NAME, "messages": IMAGE_MESSAGES, "max_tokens": 4, "temperature": 0}
    )
    chat = httpx.post(model_server.url + "/v1/chat/completions", content=chat_body).json()
    before = model_server.metrics()
    hits = before["ec_frontend_encoder_cache_hits_total"]

    parsed = ecf.parse_request("chat", chat_body, model_id=model_id)
    inputs = load_processor(builtin_model_dir, model_id=model_id).process_chat(
        parsed.messages, parsed.media, add_generation_prompt=True
    )
    (feat,) = inputs.mm_features
    body = {
        "token_ids": inputs.prompt_token_ids,
        "features": {
            "mm_hashes": {"image": [feat.mm_hash]},
            "mm_placeholders": {"image": [{"offset": feat.offset, "length": feat.length}]},
            "mm_grid_thw": {"image": [list(feat.image_grid_thw)]},
            "kwargs_data": {"image": [None]},
        },
        "sampling_params": {"max_tokens": 4, "temperature": 0},
        "output_mode": "text",
        "ec_transfer_params": {},
    }
    r = httpx.post(model_server.url + "/inference/v1/generate", content=orjson.dumps(body))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert out["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert out["ec_transfer_params"]["received"] == {}
    # Reused either as an encoder-cache hit or, with prefix caching, as cached KV
    # covering the whole image; never encoded again.
    after = model_server.metrics()
    kv_hit = after["ec_frontend_prefix_cache_hits_total"] - before.get(
        "ec_frontend_prefix_cache_hits_total", 0.0
    )
    assert kv_hit >= feat.offset + feat.length or (
        after["ec_frontend_encoder_cache_hits_total"] == hits + 1
    )
    assert (
        after["ec_frontend_encoder_items_computed_total"]
        == before["ec_frontend_encoder_items_computed_total"]
    )
