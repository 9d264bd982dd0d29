"""vLLM's extra routes (``/tokenize``, ``/detokenize``, ``/version``, ``/ping``,
``/inference/v1/abort_requests``) and the sampling and detokenization fixes of
issue 8, over real HTTP.

The mock server's tokenizer maps a character to its code point, so expected ids
are known exactly; the built-in model checks what only a real tokenizer and chat
template show (image placeholders, the vocabulary bound, unseeded sampling).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ec_frontend
import httpx
import openai
import orjson
import pytest

from ..helpers.video import make_clip
from .conftest import API_KEY, MOCK_MODEL, MODEL_NAME, ServerProcess, png_data_url

pytestmark = pytest.mark.slow

AUTH = {"authorization": f"Bearer {API_KEY}"}


def post(server: ServerProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=30.0, **kw)


def error_param(r: httpx.Response, status: int = 400) -> str | None:
    assert r.status_code == status, r.text
    return r.json()["error"]["param"]


# ------------------------------------------------------------------ mock server


def test_version(mock_server: ServerProcess) -> None:
    assert httpx.get(mock_server.url + "/version").status_code == 401  # behind the key
    r = httpx.get(mock_server.url + "/version", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"version": ec_frontend.__version__}


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping(mock_server: ServerProcess, method: str) -> None:
    r = httpx.request(method, mock_server.url + "/ping")
    assert r.status_code == 200 and r.content == b""


def test_tokenize_prompt(mock_server: ServerProcess) -> None:
    r = post(mock_server, "/tokenize", {"model": MOCK_MODEL, "prompt": "héllo"})
    assert r.status_code == 200, r.text
    max_len = httpx.get(mock_server.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert r.json() == {
        "count": 5,
        "max_model_len": max_len["max_model_len"],
        "tokens": [ord(c) for c in "héllo"],
        "token_strs": None,
    }
    strs = post(mock_server, "/tokenize", {"prompt": "ab", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["a", "b"]


def test_tokenize_messages_counts_what_chat_feeds_the_model(mock_server: ServerProcess) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look: "},
                {"type": "image_url", "image_url": {"url": png_data_url()}},
            ],
        },
    ]
    tok = post(mock_server, "/tokenize", {"messages": messages}).json()
    chat = post(mock_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert tok["count"] == len(tok["tokens"]) == chat["usage"]["prompt_tokens"]
    no_prompt = post(
        mock_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}
    ).json()
    assert no_prompt["count"] < tok["count"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({}, 400, "prompt"),
        ({"prompt": 5}, 400, "prompt"),
        ({"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
        ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
        ({"messages": "hi"}, 400, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True},
            400,
            "add_special_tokens",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": []},
            400,
            "tools",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            400,
            "chat_template",
        ),
    ],
)
def test_tokenize_bad_input(
    mock_server: ServerProcess, body: dict[str, Any], status: int, param: str
) -> None:
    assert error_param(post(mock_server, "/tokenize", body), status) == param


def test_tokenize_invalid_json(mock_server: ServerProcess) -> None:
    for raw in (b"{", b"[1, 2]"):
        r = httpx.post(
            mock_server.url + "/tokenize",
            content=raw,
            headers={**AUTH, "content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] in (
            "invalid_json",
            "invalid_type",
        )


def test_detokenize(mock_server: ServerProcess) -> None:
    r = post(mock_server, "/detokenize", {"model": MOCK_MODEL, "tokens": [104, 105]})
    assert r.status_code == 200 and r.json() == {"prompt": "hi"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "tokens"),
        ({"tokens": "104"}, "tokens"),
        ({"tokens": [104, -1]}, "tokens[1]"),
        ({"tokens": [104, "a"]}, "tokens[1]"),
        ({"tokens": [True]}, "tokens[0]"),
        ({"tokens": [2**64]}, "tokens[0]"),
        ({"tokens": [0x110000]}, "tokens[0]"),
    ],
)
def test_detokenize_bad_input(mock_server: ServerProcess, body: dict[str, Any], param: str) -> None:
    assert error_param(post(mock_server, "/detokenize", body)) == param


def test_requests_counted_by_route(mock_server: ServerProcess) -> None:
    """``ec_frontend_requests_total`` labels a request by its route; a path no route
    serves is ``unmatched`` (its own path would let a scanner add series)."""

    def count(endpoint: str, status: str) -> float:
        text = httpx.get(mock_server.url + "/metrics", headers=AUTH).text
        line = f'ec_frontend_requests_total{{endpoint="{endpoint}",status="{status}"}} '
        return next((float(x[len(line) :]) for x in text.splitlines() if x.startswith(line)), 0)

    before = {
        key: count(*key)
        for key in (("/tokenize", "200"), ("/version", "200"), ("unmatched", "404"))
    }
    assert post(mock_server, "/tokenize", {"prompt": "ab"}).status_code == 200
    assert httpx.get(mock_server.url + "/version", headers=AUTH).status_code == 200
    assert httpx.get(mock_server.url + "/no/such/route-x1", headers=AUTH).status_code == 404
    after = {key: count(*key) for key in before}
    assert {key: after[key] - before[key] for key in before} == dict.fromkeys(before, 1)
    assert "/no/such/route-x1" not in httpx.get(mock_server.url + "/metrics", headers=AUTH).text


def test_abort_requests_bad_input(mock_server: ServerProcess) -> None:
    path = "/inference/v1/abort_requests"
    assert error_param(post(mock_server, path, {})) == "request_ids"
    assert error_param(post(mock_server, path, {"request_ids": [1]})) == "request_ids"
    r = httpx.post(mock_server.url + path, json={"request_ids": ["x"]})
    assert r.status_code == 401
    r = post(mock_server, path, {"request_ids": ["nobody-has-this-id"]})
    assert r.status_code == 200 and r.content == b""


@pytest.fixture(scope="module")
def slow_mock() -> Iterator[ServerProcess]:
    """A mock server that takes 20 ms per token, so a request can be aborted midway."""
    server = ServerProcess(
        [
            "--mock-engine",
            "--mock-token-latency-ms",
            "20",
            "--api-key",
            API_KEY,
            "--served-model-name",
            MOCK_MODEL,
        ]
    )
    yield server
    assert server.stop() == 0


@pytest.mark.parametrize("ids", [["abort-me"], "abort-me"])
def test_abort_requests_ends_every_choice_of_a_request(
    slow_mock: ServerProcess, ids: list[str] | str
) -> None:
    body = {
        "model": MOCK_MODEL,
        "messages": [{"role": "user", "content": "a long answer please"}],
        "max_tokens": 2000,
        "n": 2,
        "stream": True,
    }
    finish: dict[int, str] = {}
    tokens = 0
    headers = {**AUTH, "x-request-id": "abort-me"}
    with (
        httpx.Client(timeout=30.0) as client,
        client.stream(
            "POST", slow_mock.url + "/v1/chat/completions", json=body, headers=headers
        ) as r,
    ):
        assert r.status_code == 200
        aborted = False
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = orjson.loads(line[6:])["choices"][0]
            if "role" in choice["delta"]:
                continue
            tokens += 1
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
            if not aborted and tokens >= 4:
                a = client.post(
                    slow_mock.url + "/inference/v1/abort_requests",
                    json={"request_ids": ids},
                    headers=AUTH,
                )
                assert a.status_code == 200, a.text
                aborted = True
    assert finish == {0: "abort", 1: "abort"}
    assert tokens < 2 * 2000


# ------------------------------------------------------------- built-in model


@pytest.fixture(scope="module")
def model_client(model_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_model_tokenize_detokenize_round_trip(model_server: ServerProcess) -> None:
    text = "Hello world, ✓ 漢字!"
    tok = httpx.post(
        model_server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}
    ).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 0
    r = httpx.post(model_server.url + "/detokenize", json={"tokens": tok["tokens"]})
    assert r.json() == {"prompt": text}


def test_model_tokenize_image_message(
    model_server: ServerProcess, model_client: openai.OpenAI
) -> None:
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": png_data_url(56)}},
            ],
        }
    ]
    tok = httpx.post(model_server.url + "/tokenize", json={"messages": messages}).json()
    r = model_client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert r.usage is not None and tok["count"] == r.usage.prompt_tokens
    assert tok["count"] > 20  # the image's placeholder tokens are counted


def test_model_tokenize_samples_videos_as_chat_does(
    model_server: ServerProcess, model_client: openai.OpenAI
) -> None:
    clip = base64.b64encode(make_clip(frames=8)).decode()
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{clip}"}},
                {"type": "text", "text": "what happens?"},
            ],
        }
    ]
    counts = {}
    for frames in (2, 8):
        kwargs = {"video": {"num_frames": frames}}
        tok = httpx.post(
            model_server.url + "/tokenize",
            json={"messages": messages, "media_io_kwargs": kwargs},
            timeout=60,
        ).json()
        r = model_client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=1,
            extra_body={"media_io_kwargs": kwargs},
        )
        assert r.usage is not None and tok["count"] == r.usage.prompt_tokens
        counts[frames] = tok["count"]
    # 84x56 frames (a 6x4 patch grid, merged 2x2) give 6 tokens per temporal patch of
    # two frames: 1 patch for 2 frames, 4 for 8.
    assert counts[8] - counts[2] == 3 * 6
    bad = httpx.post(
        model_server.url + "/tokenize",
        json={"messages": messages, "media_io_kwargs": {"video": {"backend": "x"}}},
    )
    assert error_param(bad) == "media_io_kwargs.video.backend"


@pytest.fixture(scope="module")
def vocab_size(builtin_model_dir: Path) -> int:
    return int(orjson.loads((builtin_model_dir / "config.json").read_bytes())["vocab_size"])


def test_model_detokenize_outside_the_vocabulary(
    model_server: ServerProcess, vocab_size: int
) -> None:
    r = httpx.post(model_server.url + "/detokenize", json={"tokens": [1, vocab_size]})
    assert error_param(r) == "tokens[1]"


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_model_stop_token_ids_outside_the_vocabulary(
    model_server: ServerProcess, vocab_size: int, endpoint: str
) -> None:
    vocab = vocab_size
    body: dict[str, Any] = {"max_tokens": 2, "stop_token_ids": [3, vocab]}
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = httpx.post(model_server.url + endpoint, json=body)
    assert error_param(r) == "stop_token_ids"
    body["stop_token_ids"] = [3, vocab - 1]
    assert httpx.post(model_server.url + endpoint, json=body).status_code == 200


def test_model_seed_minus_one_is_unseeded(model_client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        r = model_client.completions.create(
            model=MODEL_NAME, prompt="once upon", max_tokens=12, temperature=1.5, seed=seed, n=3
        )
        return [c.text for c in r.choices]

    # A fixed seed repeats itself; -1 (no seed) does not.
    assert sample(7) == sample(7)
    assert sample(-1) != sample(-1)


def test_model_text_of_unfinished_characters_is_released_at_the_end(
    model_client: openai.OpenAI,
) -> None:
    # The built-in model's greedy answer here ends in bytes that never form a
    # character: that text arrives with the last chunk (as U+FFFD), not never.
    args: Any = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "say something long"}],
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = model_client.chat.completions.create(**args)
    text = whole.choices[0].message.content or ""
    assert text.endswith("\ufffd")
    chunks = [c for c in model_client.chat.completions.create(**args, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks[1:]]
    assert len(deltas) == 24 and all(d.content is not None for d in deltas)
    assert "".join(d.content or "" for d in deltas) == text


def test_openapi_schema_has_unique_operation_ids() -> None:
    """Each method of ``/ping`` has its own operation id: building the schema warns of nothing."""
    from ec_frontend.entrypoints.openai import vllm_routes
    from fastapi import FastAPI

    api = FastAPI()
    vllm_routes.register(api, None)  # type: ignore[arg-type]
    spec = api.openapi()  # a duplicate operation id warns: filterwarnings makes that a failure
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)) == 6
    assert sorted(spec["paths"]["/ping"]) == ["get", "post"]
