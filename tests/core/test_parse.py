"""parse_request through the bindings: results, media, hashes, error mapping, limits, GIL."""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from typing import Any

import ec_frontend as ecf
import pytest

from .bad_inputs import PNG_B64

PNG = base64.b64decode(PNG_B64)
PNG_URL = f"data:image/png;base64,{PNG_B64}"


def _body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


@pytest.mark.parametrize(
    ("endpoint", "fields", "attr", "expected"),
    [
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi"}]},
            "messages",
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            "model",
            "m",
        ),
        (
            "chat",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            "include_usage",
            True,
        ),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", 2),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "user": "u-1"}, "user", "u-1"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi"}], "mystery": 1},
            "unknown_fields",
            ["mystery"],
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": [1]}},
            "chat_template_kwargs",
            {"x": [1]},
        ),
        (
            "chat",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "mm_processor_kwargs": {"max_pixels": 100},
            },
            "mm_processor_kwargs",
            {"max_pixels": 100},
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
            "add_generation_prompt",
            False,
        ),
        ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "prompts", None),
        ("completions", {"prompt": "abc", "echo": True}, "echo", True),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompts", ["a", "b"]),
        ("completions", {"prompt": [[1, 2], [3]]}, "prompts", [[1, 2], [3]]),
        ("completions", {"prompt": "x"}, "messages", None),
        ("responses", {"input": "q", "instructions": "sys"}, "instructions", "sys"),
        (
            "/v1/responses",
            {"input": "q", "instructions": "sys"},
            "messages",
            [
                {"role": "system", "content": [{"type": "text", "text": "sys"}]},
                {"role": "user", "content": [{"type": "text", "text": "q"}]},
            ],
        ),
        ("generate", {"request_id": "r-9", "token_ids": [1, 2]}, "request_id", "r-9"),
        ("/inference/v1/generate", {"token_ids": [1, 2]}, "token_ids", [1, 2]),
        (
            "generate",
            {
                "token_ids": [1, 2, 3],
                "features": {"mm_hashes": ["ab"], "mm_placeholders": [{"offset": 1, "length": 2}]},
            },
            "features",
            {
                "mm_hashes": ["ab"],
                "mm_placeholders": [{"offset": 1, "length": 2}],
                "mm_grid_thw": None,
            },
        ),
        (
            "generate",
            {"token_ids": [1], "kv_transfer_params": {"do_remote_prefill": True}},
            "kv_transfer_params",
            {"do_remote_prefill": True},
        ),
        ("generate", {"token_ids": [1], "ec_transfer_params": {}}, "ec_transfer_params", {}),
        ("generate", {"token_ids": [1]}, "ec_transfer_params", None),
    ],
)
def test_parsed_fields(endpoint: str, fields: dict[str, Any], attr: str, expected: Any) -> None:
    req = ecf.parse_request(endpoint, _body(**fields))
    assert getattr(req, attr) == expected


@pytest.mark.parametrize(
    ("endpoint", "fields", "expected"),
    [
        (
            "chat",
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 5,
                "max_tokens": 9,
            },
            {"max_tokens": 5},
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "stop": "END"},
            {"stop": ["END"]},
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4},
            {"logprobs": 4},
        ),
        ("completions", {"prompt": "x"}, {"max_tokens": 16, "logprobs": None}),
        (
            "completions",
            {"prompt": "x", "logprobs": 3, "echo": True},
            {"logprobs": 3, "prompt_logprobs": 3},
        ),
        (
            "responses",
            {"input": "x", "max_output_tokens": 8, "top_logprobs": 2},
            {"max_tokens": 8, "logprobs": None},  # as vLLM: only with `include`
        ),
        (
            "responses",
            {"input": "x", "top_logprobs": 2, "include": ["message.output_text.logprobs"]},
            {"logprobs": 2},
        ),
        (
            "generate",
            {
                "token_ids": [1],
                "sampling_params": {"temperature": 0.5, "seed": 7, "stop_token_ids": [2]},
            },
            # As vLLM: no max_tokens on generate leaves the rest of the context.
            {"temperature": 0.5, "seed": 7, "stop_token_ids": [2], "max_tokens": None},
        ),
        (
            "chat",
            {
                "messages": [{"role": "user", "content": "x"}],
                "vllm_xargs": {"a": 1},
                "kv_transfer_params": {},
                "ec_transfer_params": {"h": 1},
            },
            {"extra_args": {"a": 1, "kv_transfer_params": {}, "ec_transfer_params": {"h": 1}}},
        ),
        ("chat", {"messages": [{"role": "user", "content": "x"}]}, {"extra_args": None}),
    ],
)
def test_sampling(endpoint: str, fields: dict[str, Any], expected: dict[str, Any]) -> None:
    sampling = ecf.parse_request(endpoint, _body(**fields)).sampling
    assert set(sampling) == {
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
        "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logprobs", "prompt_logprobs", "ignore_eos", "skip_special_tokens",
        "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "min_tokens",
        "bad_words", "extra_args",
    }  # fmt: skip
    assert {k: sampling[k] for k in expected} == expected


def test_sampling_is_a_fresh_dict() -> None:
    req = ecf.parse_request("chat", _body(messages=[{"role": "user", "content": "x"}]))
    first = req.sampling
    first["temperature"] = 99
    assert req.sampling["temperature"] == 1.0


def test_media_items() -> None:
    content = [
        {"type": "text", "text": "compare"},
        _image_part(PNG_URL),
        _image_part("https://example.com/cat.png"),
        _image_part(PNG_URL, uuid="Custom ID"),
        _image_part(PNG_URL, uuid="ab" * 32),
    ]
    req = ecf.parse_request(
        "chat", _body(messages=[{"role": "user", "content": content}]), model_id="m1"
    )
    inline, remote, named, hexnamed = req.media
    assert req.messages is not None
    assert [p.get("media_index") for p in req.messages[0]["content"]] == [None, 0, 1, 2, 3]
    assert (inline.kind, inline.mime_type, inline.data, len(inline)) == (
        "image", "image/png", PNG, len(PNG),
    )  # fmt: skip
    assert inline.data is inline.data, "the bytes object is created once"
    assert inline.url is None and inline.uuid is None
    assert inline.param == "messages[0].content[1].image_url"
    assert inline.mm_hash == ecf.compute_mm_hash(PNG, model_id="m1")
    assert inline.mm_hash != ecf.compute_mm_hash(PNG, model_id="m2")
    assert (remote.data, remote.url, remote.mime_type, len(remote)) == (
        None, "https://example.com/cat.png", None, 0,
    )  # fmt: skip
    assert ecf.is_valid_mm_hash(remote.mm_hash) and remote.mm_hash != inline.mm_hash
    assert named.uuid == "Custom ID" and ecf.is_valid_mm_hash(named.mm_hash)
    assert named.mm_hash not in (inline.mm_hash, "Custom ID")
    assert named.mm_hash == ecf.hash_for_uuid("Custom ID", model_id="m1")
    assert hexnamed.mm_hash == ecf.hash_for_uuid("ab" * 32, model_id="m1") != "ab" * 32
    for item in req.media:
        assert item.mm_hash == item.mm_hash.lower()


def test_processor_kwargs_enter_the_hash_in_any_key_order() -> None:
    def media_hash(kwargs_json: str) -> str:
        body = (
            '{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"'
            + PNG_URL
            + '"}}]}],"mm_processor_kwargs":'
            + kwargs_json
            + "}"
        )
        return ecf.parse_request("chat", body.encode()).media[0].mm_hash

    a = media_hash('{"min_pixels": 4, "max_pixels": 1024}')
    b = media_hash('{"max_pixels": 1024, "min_pixels": 4}')
    assert a == b
    assert a == ecf.compute_mm_hash(PNG, processor_kwargs={"max_pixels": 1024, "min_pixels": 4})
    assert a != ecf.compute_mm_hash(PNG)


def test_decode_data_url_and_hash_helpers() -> None:
    mime, data = ecf.decode_data_url(PNG_URL)
    assert (mime, data) == ("image/png", PNG)
    with pytest.raises(ecf.RequestError) as info:
        ecf.decode_data_url("data:image/png;base64,@@")
    assert info.value.code == "invalid_base64" and info.value.param is None
    assert [ecf.is_valid_mm_hash(v) for v in ("0af", "0AF", "", "g", "a" * 129)] == [
        True, False, False, False, False,
    ]  # fmt: skip


def test_error_mapping() -> None:
    body = _body(messages=[{"role": "user", "content": "x"}], temperature=3)
    with pytest.raises(ValueError, match="temperature") as info:
        ecf.parse_request("chat", body)
    err = info.value
    assert isinstance(err, ecf.RequestError)
    assert type(err).__module__ == "ec_frontend._core"
    assert (err.param, err.code) == ("temperature", "out_of_range")
    assert err.message == str(err) and "2" in err.message
    with pytest.raises(ecf.RequestError) as info:
        ecf.parse_request("embeddings", b"{}")
    assert (info.value.code, info.value.param) == ("unknown_endpoint", None)
    with pytest.raises(TypeError):
        ecf.parse_request("chat", 42)  # type: ignore[arg-type]


def test_str_body_is_accepted() -> None:
    req = ecf.parse_request("completions", '{"prompt": "é"}')
    assert req.prompts == ["é"]
    with pytest.raises(ecf.RequestError) as info:
        ecf.parse_request("completions", '{"prompt": "\ud800"}')
    assert info.value.code == "invalid_utf8"


def test_limits_object() -> None:
    limits = ecf.Limits(max_messages=1)
    assert limits.max_messages == 1 and limits.max_depth == 64
    limits.max_depth = 3
    assert limits.max_depth == 3
    assert "max_messages=1" in repr(limits)
    two = _body(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ecf.RequestError) as info:
        ecf.parse_request("chat", two, limits=limits)
    assert (info.value.code, info.value.param) == ("limit_exceeded", "messages")
    deep = _body(messages=[{"role": "user", "content": "a"}], vllm_xargs={"a": [[1]]})
    with pytest.raises(ecf.RequestError) as info:
        ecf.parse_request("chat", deep, limits=limits)
    assert info.value.code == "limit_exceeded"
    assert ecf.parse_request("chat", two).messages is not None


def test_repr_and_json() -> None:
    req = ecf.parse_request("chat", _body(model="m", messages=[{"role": "user", "content": "x"}]))
    assert repr(req).startswith("ParsedRequest(endpoint='chat', model=\"m\"")
    assert json.loads(req.to_json())["sampling"]["temperature"] == 1.0


def test_gil_is_released_while_a_large_body_parses() -> None:
    """A Python thread keeps its pace while the native parser works on a big body.

    With the GIL held for the whole call the counting thread could only run during
    the ~0.1 ms switch slices around it, a small fraction of the call's duration.
    """
    blob = base64.b64encode(bytes(range(256)) * (40 * 1024)).decode()  # 10 MiB decoded
    part = _image_part(f"data:image/png;base64,{blob}")
    body = _body(messages=[{"role": "user", "content": [part, part, part]}])
    ticks = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    worker = threading.Thread(target=count)
    worker.start()
    try:
        start_ticks, started = ticks[0], time.perf_counter()
        time.sleep(0.05)
        rate = (ticks[0] - start_ticks) / (time.perf_counter() - started)
        before, started = ticks[0], time.perf_counter()
        req = ecf.parse_request("chat", body)
        elapsed = time.perf_counter() - started
        during = ticks[0] - before
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(old)
    assert [len(m) for m in req.media] == [256 * 40 * 1024] * 3
    assert elapsed > 0.005, "the parse is long enough to observe"
    share = during / (rate * elapsed)
    assert share > 0.15, f"the other thread ran {share:.0%} of its pace during the parse"
