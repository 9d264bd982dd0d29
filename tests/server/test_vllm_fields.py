"""vLLM's request conventions over real HTTP (issue 8): numbers and booleans sent as
strings or bools are coerced as vLLM's pydantic models do, and every field vLLM
applies that this server does not is a 400 naming it (never silently dropped).

The mock engine generates the prompt's characters, cycled, so a coerced
``max_tokens`` or ``n`` shows in the output exactly; ``logit_bias``,
``allowed_token_ids`` and ``min_tokens`` are checked on the built-in model, whose
sampler applies them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from .conftest import API_KEY, MOCK_MODEL, MODEL_NAME, ServerProcess

pytestmark = pytest.mark.slow

AUTH = {"authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "hello there"}]
CHAT_PROMPT = "user: hello there\nassistant: "


@pytest.fixture(scope="module")
def client(mock_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=mock_server.url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=30.0)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MOCK_MODEL, "messages": MESSAGES, **fields}


def test_numeric_strings_and_bools_are_coerced(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MOCK_MODEL,
        messages=MESSAGES,
        extra_body={"max_tokens": "5", "temperature": "0", "n": "2", "ignore_eos": "yes"},
    )
    assert [c.message.content for c in r.choices] == [CHAT_PROMPT[:5]] * 2
    r2 = client.completions.create(
        model=MOCK_MODEL,
        prompt="abc",
        extra_body={"max_tokens": "4.0", "temperature": False, "n": True, "echo": "on"},
    )
    assert [c.text for c in r2.choices] == ["abc" + "abca"]


def test_stream_given_as_one_streams(mock_server: ServerProcess) -> None:
    body = chat(max_tokens="3", temperature="0", stream=1, stream_options={"include_usage": "1"})
    with httpx.stream(
        "POST", mock_server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30.0
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [orjson.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == CHAT_PROMPT[:3]
    assert chunks[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(max_tokens="5.5"), "max_tokens"),
        (chat(temperature="warm"), "temperature"),
        (chat(stream=2), "stream"),
        (chat(n=1.5), "n"),
    ],
)
def test_values_pydantic_refuses_are_400(
    mock_server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    r = post(mock_server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


UNSUPPORTED = [
    ("/v1/chat/completions", chat(continue_final_message=True), "continue_final_message"),
    ("/v1/chat/completions", chat(priority=1), "priority"),
    ("/v1/chat/completions", chat(echo=True), "echo"),
    ("/v1/chat/completions", chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("/inference/v1/generate", {"token_ids": [104, 105], "priority": -1}, "priority"),
    ("/v1/completions", {"model": MOCK_MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    (
        "/v1/completions",
        {"model": MOCK_MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
        "stop",
    ),
    (
        "/v1/responses",
        {"model": MOCK_MODEL, "input": "x", "previous_response_id": "resp_1"},
        "previous_response_id",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), UNSUPPORTED, ids=[f"{p}-{n}" for p, _, n in UNSUPPORTED]
)
def test_unapplied_fields_are_400_naming_them(
    mock_server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    r = post(mock_server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param.split(".")[-1] in error["message"]
    assert httpx.get(mock_server.url + "/health").status_code == 200


def test_openai_client_sees_the_refused_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MOCK_MODEL,
            messages=MESSAGES,
            extra_body={"priority": 3},
        )
    assert info.value.body["param"] == "priority"  # type: ignore[index]


def test_harmless_values_of_unapplied_fields_pass(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MOCK_MODEL,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        response_format={"type": "text"},
        tool_choice="none",
        stop=["x", "y", "z", "w"],
        extra_body={"min_tokens": 0, "priority": 0, "continue_final_message": False},
    )
    assert r.choices[0].message.content == CHAT_PROMPT[:4]


# ------------------------------------------------------------------ built-in model


def _token_of(server: ServerProcess, text: str) -> tuple[int, str]:
    r = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": text})
    assert r.status_code == 200, r.text
    tid = r.json()["tokens"][0]
    r = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": [tid]})
    assert r.status_code == 200, r.text
    return tid, r.json()["prompt"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_restrict_the_output(
    model_server: ServerProcess, temperature: float
) -> None:
    a, a_text = _token_of(model_server, "a")
    b, b_text = _token_of(model_server, " the")
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": temperature,
        "seed": 3,
        "logprobs": 0,
        "allowed_token_ids": [str(a), b],
        "ignore_eos": True,
    }
    r = post(model_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6
    assert set(tokens) <= {a_text, b_text}, tokens


def test_logit_bias_steers_greedy_output(model_server: ServerProcess) -> None:
    a, a_text = _token_of(model_server, "a")
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    plain = post(model_server, "/v1/completions", {**body, "logprobs": 0}).json()
    assert set(plain["choices"][0]["logprobs"]["tokens"]) != {a_text}
    r = post(model_server, "/v1/completions", {**body, "logprobs": 0, "logit_bias": {str(a): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [a_text] * 4


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_are_400(model_server: ServerProcess, field: str) -> None:
    value: Any = {"1000000000": 1} if field == "logit_bias" else [1, 1_000_000_000]
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, field: value}
    r = post(model_server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert httpx.get(model_server.url + "/health").status_code == 200


def _generate(server: ServerProcess, **sampling: Any) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "token_ids": [1, 2, 3, 4, 5],
        "sampling_params": {"temperature": 0, "max_tokens": 8, **sampling},
    }
    r = post(server, "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_min_tokens_holds_back_stop_token_ids(model_server: ServerProcess) -> None:
    first = _generate(model_server)["token_ids"][0]
    stopped = _generate(model_server, stop_token_ids=[first])
    assert stopped["token_ids"] == [first] and stopped["finish_reason"] == "stop"
    held = _generate(model_server, stop_token_ids=[first], min_tokens="4")
    assert len(held["token_ids"]) >= 4
    assert first not in held["token_ids"][:4]


def test_min_tokens_holds_back_stop_strings(model_server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    plain = post(model_server, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]
    stop = next(t for t in plain["logprobs"]["tokens"] if t.strip())
    cut = post(model_server, "/v1/completions", {**body, "stop": [stop]}).json()
    assert cut["usage"]["completion_tokens"] < 8
    assert cut["choices"][0]["finish_reason"] == "stop"
    r = post(model_server, "/v1/completions", {**body, "stop": [stop], "min_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


def test_min_tokens_over_max_tokens_is_400(model_server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "min_tokens": 3}
    r = post(model_server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_tokens"
