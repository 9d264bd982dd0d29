"""vLLM's output options over real HTTP (issue 8): ``/inference/v1/generate`` shaped as
vLLM 0.33's token-in/token-out protocol, and ``return_token_ids``,
``stream_interval`` and ``stream_options.continuous_usage_stats`` on chat and
completions.

The mock engine generates the prompt's characters, cycled, and its tokenizer maps
a character to its code point, so token ids and texts are known exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from .conftest import API_KEY, MOCK_MODEL, MODEL_NAME, ServerProcess, png_data_url

pytestmark = pytest.mark.slow

AUTH = {"authorization": f"Bearer {API_KEY}"}
CHAT_PROMPT = "user: hello there\nassistant: "
MESSAGES = [{"role": "user", "content": "hello there"}]
GENERATE = "/inference/v1/generate"


def post(server: ServerProcess, path: str, body: Any, auth: bool = True) -> httpx.Response:
    headers = AUTH if auth else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60.0)


def stream(server: ServerProcess, path: str, body: Any, auth: bool = True) -> list[Any]:
    """The chunks of an SSE stream (``[DONE]`` checked and dropped)."""
    headers = AUTH if auth else {}
    body = {**body, "stream": True}
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=60.0) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def ords(text: str) -> list[int]:
    return [ord(c) for c in text]


# ------------------------------------------------------------------------ generate


def test_generate_tokens_mode_is_vllms_shape(mock_server: ServerProcess) -> None:
    body = {
        "token_ids": ords("abc"),
        "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 2},
        "model": MOCK_MODEL,
    }
    r = post(mock_server, GENERATE, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_mode"] == "tokens"
    assert out["model"] == MOCK_MODEL
    assert isinstance(out["created"], int) and out["created"] > 0
    assert out["prompt_token_ids"] is None
    assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == 4
    (choice,) = out["choices"]
    assert "text" not in choice
    assert choice["token_ids"] == ords("abca")
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == ords("abca")
    for entry in content:
        assert "token" not in entry
        top = entry["top_logprobs"]
        # The sampled token first, then the other candidates, each with its id.
        assert top[0]["token_id"] == entry["token_id"]
        assert top[0]["logprob"] == entry["logprob"]
        assert all(isinstance(t["token_id"], int) for t in top)
        assert len({t["token_id"] for t in top}) == len(top)


def test_generate_text_mode_and_prompt_token_ids(mock_server: ServerProcess) -> None:
    body = {
        "token_ids": ords("xyz"),
        "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 1},
        "output_mode": "text",
        "return_token_ids": True,
    }
    out = post(mock_server, GENERATE, body).json()
    assert out["output_mode"] == "text"
    assert out["prompt_token_ids"] == ords("xyz")
    (choice,) = out["choices"]
    assert choice["text"] == "xyzxy"
    assert choice["token_ids"] == ords("xyzxy")
    assert [e["token"] for e in choice["logprobs"]["content"]] == list("xyzxy")


def test_generate_stream_chunks(mock_server: ServerProcess) -> None:
    body = {
        "token_ids": ords("hi"),
        "sampling_params": {"max_tokens": 3, "temperature": 0},
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "kv_transfer_params": {},
    }
    chunks = stream(mock_server, GENERATE, body)
    *token_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3
    assert [c["choices"][0]["token_ids"] for c in token_chunks] == [[104], [105], [104]]
    assert token_chunks[0]["prompt_token_ids"] == ords("hi")
    assert all("prompt_token_ids" not in c for c in token_chunks[1:])
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == [1, 2, 3]
    assert all(c["output_mode"] == "tokens" for c in chunks)
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert token_chunks[-1]["kv_transfer_params"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"output_mode": "derender"}, "output_mode"),
        ({"output_mode": "bytes"}, "output_mode"),
        ({"output_mode": "text", "sampling_params": {"detokenize": False}}, "output_mode"),
        ({"priority": 3}, "priority"),
        ({"return_token_ids": "perhaps"}, "return_token_ids"),
        (
            {
                "features": {
                    "mm_hashes": {"image": ["ab"]},
                    "mm_placeholders": {"image": [{"offset": 0, "length": 1}]},
                    "mm_metadata": {"image": ["bWV0YQ=="]},
                }
            },
            "features.mm_metadata.image[0]",
        ),
        (
            {
                "features": {
                    "mm_hashes": {"audio": ["ab"]},
                    "mm_placeholders": {"audio": [{"offset": 0, "length": 1}]},
                }
            },
            "features.mm_hashes.audio",
        ),
    ],
)
def test_generate_refusals_name_the_field(
    mock_server: ServerProcess, extra: dict[str, Any], param: str
) -> None:
    r = post(mock_server, GENERATE, {"token_ids": ords("ab"), **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(mock_server.url + "/health").status_code == 200


# ------------------------------------------------------------- chat and completions


def test_chat_return_token_ids(mock_server: ServerProcess) -> None:
    body = {"model": MOCK_MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    out = post(mock_server, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
    assert out["prompt_token_ids"] == ords(CHAT_PROMPT)
    assert out["choices"][0]["token_ids"] == ords(CHAT_PROMPT[:6])
    plain = post(mock_server, "/v1/chat/completions", body).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]

    chunks = stream(mock_server, "/v1/chat/completions", {**body, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == ords(CHAT_PROMPT)
    ids = [i for c in chunks[1:] for i in c["choices"][0]["token_ids"]]
    assert ids == ords(CHAT_PROMPT[:6])


def test_completions_return_token_ids(mock_server: ServerProcess) -> None:
    body = {"model": MOCK_MODEL, "prompt": ["ab", "cd"], "max_tokens": 3, "temperature": 0}
    out = post(mock_server, "/v1/completions", {**body, "return_token_ids": True}).json()
    got = [(c["prompt_token_ids"], c["token_ids"], c["text"]) for c in out["choices"]]
    assert got == [(ords("ab"), ords("aba"), "aba"), (ords("cd"), ords("cdc"), "cdc")]

    chunks = stream(mock_server, "/v1/completions", {**body, "return_token_ids": True})
    for index, prompt in ((0, "ab"), (1, "cd")):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == ords(prompt)
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [i for c in mine for i in c["token_ids"]] == ords((prompt * 2)[:3])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_interval_merges_tokens(mock_server: ServerProcess, path: str) -> None:
    if path == "/v1/completions":
        body: dict[str, Any] = {"model": MOCK_MODEL, "prompt": "abcdefgh"}
    else:
        body = {"model": MOCK_MODEL, "messages": MESSAGES}
    body |= {"max_tokens": 8, "temperature": 0, "return_token_ids": True}

    def sizes_and_text(chunks: list[Any]) -> tuple[list[int], str]:
        choices = [c["choices"][0] for c in chunks if "token_ids" in c["choices"][0]]
        text = "".join(c.get("text") or c.get("delta", {}).get("content", "") for c in choices)
        return [len(c["token_ids"]) for c in choices], text

    every, text = sizes_and_text(stream(mock_server, path, body))
    assert every == [1] * 8
    # vLLM's rule: the first token at once, then every 3 tokens, the rest at the finish.
    merged, merged_text = sizes_and_text(stream(mock_server, path, {**body, "stream_interval": 3}))
    assert merged == [1, 3, 3, 1]
    assert merged_text == text


def test_continuous_usage_stats(mock_server: ServerProcess) -> None:
    body = {
        "model": MOCK_MODEL,
        "messages": MESSAGES,
        "max_tokens": 4,
        "temperature": 0,
        "n": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = stream(mock_server, "/v1/chat/completions", body)
    *per_choice, final = chunks
    prompt = len(CHAT_PROMPT)
    for index in (0, 1):
        mine = [c for c in per_choice if c["choices"][0]["index"] == index]
        counts = [c["usage"]["completion_tokens"] for c in mine]
        assert counts == [0, 1, 2, 3, 4]  # the role chunk, then one per token
        assert all(c["usage"]["prompt_tokens"] == prompt for c in mine)
        totals = [c["usage"]["total_tokens"] for c in mine]
        assert totals == [prompt + n for n in counts]
    assert final["usage"]["completion_tokens"] == 8
    # As vLLM, the flag without include_usage adds nothing.
    body["stream_options"] = {"continuous_usage_stats": True}
    assert all("usage" not in c for c in stream(mock_server, "/v1/chat/completions", body))


# ------------------------------------------------------------------- built-in model


def test_generate_max_tokens_defaults_to_the_rest_of_the_context(
    model_server: ServerProcess, builtin_model_dir: Path
) -> None:
    """vLLM's generate gives a request without max_tokens the rest of the context
    (1024 here); the completions endpoint keeps OpenAI's 16."""
    prompt = [5 + i % 50 for i in range(1000)]
    body = {"token_ids": prompt, "sampling_params": {"temperature": 0, "ignore_eos": True}}
    r = post(model_server, GENERATE, body, auth=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 24 and choice["finish_reason"] == "length"
    body = {"model": MODEL_NAME, "prompt": prompt[:8], "ignore_eos": True}
    r = post(model_server, "/v1/completions", body, auth=False)
    assert r.json()["usage"]["completion_tokens"] == 16


def _token_text(server: ServerProcess, tid: int) -> str:
    r = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": [tid]}, auth=False)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def _tokens(server: ServerProcess, text: str) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": text, "add_special_tokens": False}
    r = post(server, "/tokenize", body, auth=False)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_bad_words_are_never_generated(model_server: ServerProcess) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    base = post(model_server, "/v1/completions", body, auth=False).json()["choices"][0]
    # A generated token whose text is a word of exactly that one token.
    k, tid, word = next(
        (k, t, w)
        for k, t in enumerate(base["token_ids"])
        if (w := _token_text(model_server, t)).strip() and _tokens(model_server, w.lstrip()) == [t]
    )
    r = post(model_server, "/v1/completions", {**body, "bad_words": [word]}, auth=False)
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert ids[:k] == base["token_ids"][:k]
    assert tid not in ids and len(ids) == 8


@pytest.mark.parametrize(
    ("fields", "prompt"),
    [
        ({"truncate_prompt_tokens": 4}, "abcd"),  # the tokenizer's side: right
        ({"truncate_prompt_tokens": 4, "truncation_side": "right"}, "abcd"),
        ({"truncate_prompt_tokens": "4", "truncation_side": "left"}, "ghij"),
        ({"truncate_prompt_tokens": 40, "truncation_side": "left"}, "abcdefghij"),
    ],
)
def test_truncate_prompt_tokens(
    mock_server: ServerProcess, fields: dict[str, Any], prompt: str
) -> None:
    body = {"model": MOCK_MODEL, "prompt": "abcdefghij", "max_tokens": 4, "temperature": 0}
    out = post(mock_server, "/v1/completions", {**body, **fields, "echo": True}).json()
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["choices"][0]["text"] == prompt + prompt[:4]


def test_truncate_to_the_context(mock_server: ServerProcess) -> None:
    """``-1`` keeps the context less one token: a prompt longer than the context fits."""
    long = "xy" * 2100  # 4,200 tokens, over the mock's 4,096
    body = {"model": MOCK_MODEL, "prompt": long, "max_tokens": 1}
    r = post(mock_server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    body |= {"truncate_prompt_tokens": -1, "truncation_side": "left"}
    r = post(mock_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4095


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "abc", "truncate_prompt_tokens": 5000},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": png_data_url()}},
                    ],
                }
            ],
            "truncate_prompt_tokens": 3,
        },
    ],
    ids=["over-the-context", "images"],
)
def test_truncation_refusals(mock_server: ServerProcess, body: dict[str, Any]) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(mock_server, path, {"model": MOCK_MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "truncate_prompt_tokens"
    assert httpx.get(mock_server.url + "/health").status_code == 200


def test_continue_final_message(mock_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]
    body = {
        "model": MOCK_MODEL,
        "messages": messages,
        "max_tokens": 2,
        "return_token_ids": True,
        "add_generation_prompt": False,
    }
    closed = post(mock_server, "/v1/chat/completions", body).json()
    assert closed["prompt_token_ids"] == ords("user: hi\nassistant: hel\n")
    body["continue_final_message"] = True
    out = post(mock_server, "/v1/chat/completions", body).json()
    assert out["prompt_token_ids"] == ords("user: hi\nassistant: hel")
    r = post(mock_server, "/tokenize", {k: v for k, v in body.items() if k != "max_tokens"})
    assert r.json()["tokens"] == ords("user: hi\nassistant: hel")
    # As vLLM: not with add_generation_prompt, which is true unless sent false.
    del body["add_generation_prompt"]
    r = post(mock_server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("words", [[""], "word", [7], ["a"] * 3 + [""]])
def test_bad_words_refusals(mock_server: ServerProcess, words: Any) -> None:
    body = {"model": MOCK_MODEL, "prompt": "abc", "max_tokens": 2, "bad_words": words}
    r = post(mock_server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("bad_words")


def test_responses_logprobs_only_with_include(mock_server: ServerProcess) -> None:
    body = {"model": MOCK_MODEL, "input": "abc", "max_output_tokens": 3, "top_logprobs": 2}
    plain = post(mock_server, "/v1/responses", body).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []
    body["include"] = ["message.output_text.logprobs"]
    out = post(mock_server, "/v1/responses", body).json()
    part = out["output"][0]["content"][0]
    assert [lp["token"] for lp in part["logprobs"]] == list(part["text"])
    assert all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    events = stream(mock_server, "/v1/responses", body)
    deltas = [e for e in events if e.get("type") == "response.output_text.delta"]
    assert [lp["token"] for e in deltas for lp in e["logprobs"]] == list(part["text"])
    r = post(mock_server, "/v1/responses", {**body, "include": ["file_search_call.results"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include"
