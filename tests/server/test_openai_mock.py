"""The OpenAI API through the official client, against a mock-engine server process.

The mock engine echoes prompt tokens (one token per character), so the expected
text of every request is known exactly; see ``engine/mock.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from .conftest import API_KEY, MOCK_MODEL, ServerProcess, png_data_url, responses_image_input

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(mock_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=mock_server.url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def echo(prompt: str, n: int) -> str:
    """What the mock generates greedily: the prompt's characters, cycled."""
    return "".join(prompt[i % len(prompt)] for i in range(n))


CHAT_PROMPT = "user: hello there\nassistant: "


def test_models_list(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MOCK_MODEL, "alias-model"]


@pytest.mark.parametrize("model", [MOCK_MODEL, "alias-model"])
def test_chat_text(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=7,
        temperature=0,
    )
    assert r.model == model
    assert r.choices[0].message.content == echo(CHAT_PROMPT, 7)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(CHAT_PROMPT), 7)
    extra = r.model_extra or {}
    assert extra["kv_transfer_params"] is None and extra["ec_transfer_params"] is None


def test_chat_image_data_url(client: openai.OpenAI) -> None:
    content: list[Any] = [
        {"type": "text", "text": "what is "},
        {"type": "image_url", "image_url": {"url": png_data_url()}},
    ]
    r = client.chat.completions.create(
        model=MOCK_MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
        temperature=0,
    )
    prompt = "user: what is \ufffc\ufffc\ufffc\ufffc\nassistant: "
    assert r.choices[0].message.content == echo(prompt, 12)
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)


def test_chat_stream_with_usage_and_params(client: openai.OpenAI) -> None:
    kv = {"do_remote_decode": True, "nested": {"a": [1, 2]}}
    ec = {"abc123": {"peer_host": "127.0.0.1", "peer_port": 5501}}
    stream = client.chat.completions.create(
        model=MOCK_MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"kv_transfer_params": kv, "ec_transfer_params": ec},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == echo(CHAT_PROMPT, 9)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    # A KV hold request comes back with the server's stamp of who asked (the mock echoes).
    stamped = {**kv, "hold_client": "127.0.0.1"}
    assert finals[0].model_extra == {"kv_transfer_params": stamped, "ec_transfer_params": ec}
    others = [c for c in chunks if c is not finals[0]]
    assert all("kv_transfer_params" not in (c.model_extra or {}) for c in others)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9


def test_chat_nonstream_transfer_params_echoed(client: openai.OpenAI) -> None:
    kv = {"remote_block_ids": [1, 2, 3], "remote_engine_id": "e"}
    r = client.chat.completions.create(
        model=MOCK_MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"kv_transfer_params": kv, "ec_transfer_params": {}},
    )
    extra = r.model_extra or {}
    assert extra["kv_transfer_params"] == kv
    assert extra["ec_transfer_params"] == {}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n_choices_and_seed(client: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": MOCK_MODEL,
        "messages": [{"role": "user", "content": "abcdefghijklmnop"}],
        "max_tokens": 10,
        "n": 3,
        "temperature": 1.0,
        "seed": 42,
    }

    def texts() -> list[str]:
        if not stream:
            r = client.chat.completions.create(**kwargs)
            assert [c.index for c in r.choices] == [0, 1, 2]
            return [c.message.content or "" for c in r.choices]
        out = ["", "", ""]
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                out[c.index] += c.delta.content or ""
        return out

    first, second = texts(), texts()
    assert first == second
    assert len(set(first)) > 1
    assert all(len(t) == 10 for t in first)


def test_chat_stop_string_and_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MOCK_MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=50,
        temperature=0,
        stop=["there"],
        logprobs=True,
        top_logprobs=2,
    )
    choice = r.choices[0]
    assert choice.message.content == "user: hello "
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    first = choice.logprobs.content[0]
    assert first.token == "u" and first.logprob == -0.5
    assert [t.token for t in first.top_logprobs] == ["u", "v"]


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MOCK_MODEL, prompt=["abc", "xyz"], max_tokens=5, temperature=0, echo=True
    )
    assert [c.text for c in r.choices] == ["abc" + echo("abc", 5), "xyz" + echo("xyz", 5)]
    assert r.usage is not None and r.usage.prompt_tokens == 6


def test_completions_echo_token_prompt(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MOCK_MODEL, prompt=[104, 105], max_tokens=3, temperature=0, echo=True
    )
    assert r.choices[0].text == "hi" + echo("hi", 3)


def test_completions_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MOCK_MODEL, prompt="abc", max_tokens=3, temperature=0, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["a", "b", "c"] and lp.text_offset == [0, 1, 2]


def test_completions_stream(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MOCK_MODEL,
            prompt="stream me",
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"kv_transfer_params": {"k": 1}},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == echo("stream me", 6)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert (chunks[-1].model_extra or {})["kv_transfer_params"] == {"k": 1}


def test_responses_nonstream(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MOCK_MODEL,
        input="hello there",
        max_output_tokens=8,
        temperature=0,
        extra_body={"ec_transfer_params": {"h": {"num_tokens": 4}}},
    )
    assert r.output_text == echo(CHAT_PROMPT, 8)
    assert r.usage is not None and r.usage.output_tokens == 8
    assert (r.model_extra or {})["ec_transfer_params"] == {"h": {"num_tokens": 4}}


def test_responses_image_item(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MOCK_MODEL,
        input=responses_image_input("see ", png_data_url()),
        max_output_tokens=5,
        temperature=0,
    )
    assert r.output_text == echo("user: see \ufffc\ufffc\ufffc\ufffc\nassistant: ", 5)


def test_responses_stream(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MOCK_MODEL,
            input="hello there",
            max_output_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"kv_transfer_params": {"x": 1}},
        )
    )
    types = [e.type for e in events]
    assert types[0] == "response.created"
    assert types[-1] == "response.incomplete" or types[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == echo(CHAT_PROMPT, 6)
    final = events[-1].response  # type: ignore[union-attr]
    assert (final.model_extra or {})["kv_transfer_params"] == {"x": 1}


def test_responses_stream_completed(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MOCK_MODEL,
            input="hello there",
            temperature=0,
            max_output_tokens=30,
            stream=True,
            extra_body={"stop": ["there"]},
        )
    )
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "user: hello "  # type: ignore[union-attr]


def _post(server: ServerProcess, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(
        server.url + path,
        content=orjson.dumps(body),
        headers={
            "authorization": f"Bearer {API_KEY}",
            "content-type": "application/json",
            **headers,
        },
        timeout=30.0,
    )


@pytest.mark.parametrize(
    ("extra", "kv", "ec"),
    [
        ({"kv_transfer_params": {}, "ec_transfer_params": {}}, {}, {}),
        ({"kv_transfer_params": {"a": 1}}, {"a": 1}, None),
        ({"ec_transfer_params": {}}, None, {}),
        ({}, None, None),
        ({"kv_transfer_params": None, "ec_transfer_params": None}, None, None),
    ],
)
def test_generate_forwards_params_is_not_none(
    mock_server: ServerProcess, extra: dict[str, Any], kv: Any, ec: Any
) -> None:
    body = {"token_ids": [10, 11, 12], "sampling_params": {"max_tokens": 4, "temperature": 0}}
    r = _post(mock_server, "/inference/v1/generate", {**body, **extra})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["choices"][0]["token_ids"] == [10, 11, 12, 10]
    assert data["kv_transfer_params"] == kv
    assert data["ec_transfer_params"] == ec


def test_generate_stream_final_chunk_params(mock_server: ServerProcess) -> None:
    body = {
        "token_ids": [65, 66],
        "sampling_params": {"max_tokens": 3, "temperature": 0},
        "stream": True,
        "kv_transfer_params": {},
        "ec_transfer_params": {"h": {}},
    }
    r = _post(mock_server, "/inference/v1/generate", body)
    lines = [ln[6:] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [orjson.loads(x) for x in lines[:-1]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == [65, 66, 65]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["kv_transfer_params"] == {} and chunks[-1]["ec_transfer_params"] == {"h": {}}
    assert all("kv_transfer_params" not in c for c in chunks[:-1])


def test_generate_n_above_one_is_400(mock_server: ServerProcess) -> None:
    body = {"token_ids": [1, 2], "sampling_params": {"n": 2}}
    r = _post(mock_server, "/inference/v1/generate", body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.n"


def test_request_id_echoed(mock_server: ServerProcess) -> None:
    body = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    r = _post(mock_server, "/v1/chat/completions", body, **{"x-request-id": "my-id-123"})
    assert r.headers["x-request-id"] == "my-id-123"
    assert r.json()["id"] == "chatcmpl-my-id-123"
    r2 = _post(mock_server, "/v1/chat/completions", body)
    assert len(r2.headers["x-request-id"]) == 32


def test_docs_and_openapi(mock_server: ServerProcess) -> None:
    """With an API key the docs need it too (no ``--public-docs`` on this server)."""
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(mock_server.url + path).status_code == 401, path
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/docs", "/redoc"):
        page = httpx.get(mock_server.url + path, headers=auth)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        # Everything is on the page: no script, no stylesheet or image from another host.
        assert "<script" not in page.text and not re.search(
            r"(src|href)=['\"]?(https?:)?//", page.text
        )
        assert "<code>/v1/chat/completions</code>" in page.text
        assert "<code>kv_transfer_params</code>" in page.text
    spec = httpx.get(mock_server.url + "/openapi.json", headers=auth).json()
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    schemas = spec["components"]["schemas"]
    assert "kv_transfer_params" in schemas["ChatCompletionRequest"]["properties"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert "ChatCompletionResponse" in schemas and "GenerateRequest" in schemas


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_of_one_request(mock_server: ServerProcess, path: str, stream: bool) -> None:
    """A request the engine fails gets a 500 body (or an error event); the server lives on."""
    body: dict[str, Any] = {
        "model": MOCK_MODEL,
        "max_tokens": 8,
        "stream": stream,
        "vllm_xargs": {"mock_fail_after": 3},
    }
    if path == "/v1/completions":
        body["prompt"] = "abc"
    elif path == "/v1/responses":
        body["input"] = "abc"
    else:
        body["messages"] = [{"role": "user", "content": "abc"}]
    r = _post(mock_server, path, body)
    if not stream:
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "engine_error"
    else:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.text.split("\n\n") if "data: " in ln]
        assert events[-1].endswith("[DONE]")
        assert '"engine_error"' in events[-2]
    ok = _post(mock_server, path, {**body, "vllm_xargs": None, "stream": False})
    assert ok.status_code == 200
