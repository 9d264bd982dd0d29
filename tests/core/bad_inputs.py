"""A corpus of malformed request bodies, each with the error the parser must give.

Importable by other suites (the HTTP tests post every case to its endpoint and expect
a 4xx OpenAI error body). Nothing here needs the native extension.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BadInput:
    """One malformed body: ``endpoint`` is ``chat``, ``completions``, ``responses`` or
    ``generate``; ``code`` and ``param`` are what ``RequestError`` must carry."""

    id: str
    endpoint: str
    body: bytes
    code: str
    param: str | None


PNG_B64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
USER_HI = {"role": "user", "content": "hi"}


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [USER_HI], **fields}).encode()


def _image(url: str, **part: Any) -> bytes:
    content = [{"type": "image_url", "image_url": {"url": url}, **part}]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def _features(hashes: list[str], placeholders: list[dict[str, int]]) -> bytes:
    features = {"mm_hashes": hashes, "mm_placeholders": placeholders}
    return json.dumps({"token_ids": [1, 2], "features": features}).encode()


_URL = "messages[0].content[0].image_url.url"
_DEEP = 10_000

_CASES: list[tuple[str, str, bytes, str, str | None]] = [
    # Not JSON at all, or not quite.
    ("empty-body", "chat", b"", "invalid_json", None),
    ("whitespace-body", "chat", b"  \n ", "invalid_json", None),
    (
        "truncated-object",
        "chat",
        b'{"model": "m", "messages": [{"role": "user"',
        "invalid_json",
        None,
    ),
    ("truncated-string", "chat", b'{"model": "m", "messages": [{"role": "us', "invalid_json", None),
    ("truncated-number", "completions", b'{"prompt": "x", "max_tokens": 1', "invalid_json", None),
    ("trailing-comma", "chat", b'{"messages": [], }', "invalid_json", None),
    ("single-quotes", "chat", b"{'messages': []}", "invalid_json", None),
    ("trailing-garbage", "chat", _chat() + b" extra", "invalid_json", None),
    ("two-documents", "chat", _chat() + _chat(), "invalid_json", None),
    ("bare-word", "chat", b"messages", "invalid_json", None),
    ("nan-literal", "chat", _chat()[:-1] + b', "temperature": NaN}', "invalid_json", None),
    ("infinity-literal", "chat", _chat()[:-1] + b', "top_p": Infinity}', "invalid_json", None),
    (
        "neg-infinity",
        "completions",
        b'{"prompt": "x", "temperature": -Infinity}',
        "invalid_json",
        None,
    ),
    ("float-overflow", "chat", _chat()[:-1] + b', "temperature": 1e400}', "invalid_json", None),
    (
        "bad-escape",
        "chat",
        b'{"messages": [{"role": "user", "content": "\\q"}]}',
        "invalid_json",
        None,
    ),
    (
        "lone-surrogate",
        "chat",
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "invalid_json",
        None,
    ),
    (
        "control-char",
        "chat",
        b'{"messages": [{"role": "user", "content": "a\x01b"}]}',
        "invalid_json",
        None,
    ),
    ("leading-zero", "completions", b'{"prompt": "x", "max_tokens": 012}', "invalid_json", None),
    (
        "invalid-utf8",
        "chat",
        b'{"messages": [{"role": "user", "content": "caf\xc3\x28"}]}',
        "invalid_utf8",
        None,
    ),
    ("utf16-bom-body", "chat", "\ufeff".encode("utf-16") + _chat(), "invalid_utf8", None),
    ("deep-arrays", "chat", b"[" * _DEEP + b"]" * _DEEP, "limit_exceeded", None),
    ("deep-objects", "chat", b'{"a":' * _DEEP + b"1" + b"}" * _DEEP, "limit_exceeded", None),
    (
        "deep-xargs",
        "chat",
        _chat()[:-1] + b', "vllm_xargs": {"a": ' + b"[" * _DEEP + b"]" * _DEEP + b"}}",
        "limit_exceeded",
        None,
    ),
    (
        "deep-kv-params",
        "generate",
        b'{"token_ids": [1], "kv_transfer_params": {"a": ' + b"[" * 200 + b"]" * 200 + b"}}",
        "limit_exceeded",
        None,
    ),
    (
        "huge-integer-5000-digits",
        "chat",
        _chat()[:-1] + b', "vllm_xargs": {"a": ' + b"9" * 5000 + b"}}",
        "limit_exceeded",
        None,
    ),
    # Valid JSON, wrong shape.
    ("array-body", "chat", b"[1, 2]", "invalid_type", None),
    ("string-body", "completions", b'"prompt"', "invalid_type", None),
    ("null-body", "generate", b"null", "invalid_type", None),
    ("missing-messages", "chat", b'{"model": "m"}', "missing_field", "messages"),
    ("null-messages", "chat", b'{"messages": null}', "missing_field", "messages"),
    ("empty-messages", "chat", b'{"model": "m", "messages": []}', "invalid_value", "messages"),
    ("messages-string", "chat", b'{"messages": "hi"}', "invalid_type", "messages"),
    ("message-not-object", "chat", b'{"messages": [42]}', "invalid_type", "messages[0]"),
    (
        "missing-role",
        "chat",
        b'{"messages": [{"content": "hi"}]}',
        "missing_field",
        "messages[0].role",
    ),
    (
        "bad-role",
        "chat",
        b'{"messages": [{"role": "root", "content": "hi"}]}',
        "invalid_value",
        "messages[0].role",
    ),
    (
        "content-number",
        "chat",
        b'{"messages": [{"role": "user", "content": 1}]}',
        "invalid_type",
        "messages[0].content",
    ),
    (
        "part-without-type",
        "chat",
        b'{"messages": [{"role": "user", "content": [{"text": "a"}]}]}',
        "missing_field",
        "messages[0].content[0].type",
    ),
    (
        "part-unknown-type",
        "chat",
        b'{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}',
        "invalid_value",
        "messages[0].content[0].type",
    ),
    (
        "text-part-number",
        "chat",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        "invalid_type",
        "messages[0].content[0].text",
    ),
    (
        "image-missing-url",
        "chat",
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
        "missing_field",
        _URL,
    ),
    (
        "invalid-base64",
        "chat",
        _image("data:image/png;base64,%%%not-base64%%%"),
        "invalid_base64",
        _URL,
    ),
    (
        "base64-bad-padding",
        "chat",
        _image("data:image/png;base64,aGVsbG8==="),
        "invalid_base64",
        _URL,
    ),
    ("data-url-empty", "chat", _image("data:image/png;base64,"), "invalid_data_url", _URL),
    ("data-url-not-base64", "chat", _image("data:image/png,rawbytes"), "invalid_data_url", _URL),
    ("data-url-no-comma", "chat", _image("data:image/png;base64"), "invalid_data_url", _URL),
    (
        "data-url-not-image",
        "chat",
        _image(f"data:application/pdf;base64,{PNG_B64}"),
        "invalid_data_url",
        _URL,
    ),
    ("ftp-url", "chat", _image("ftp://example.com/a.png"), "invalid_value", _URL),
    (
        "uuid-number",
        "chat",
        _image("https://example.com/a.png", uuid=5),
        "invalid_type",
        "messages[0].content[0].uuid",
    ),
    ("model-number", "chat", _chat(model=3), "invalid_type", "model"),
    ("max-tokens-negative", "chat", _chat(max_tokens=-1), "out_of_range", "max_tokens"),
    (
        "max-tokens-zero",
        "completions",
        b'{"prompt": "x", "max_tokens": 0}',
        "out_of_range",
        "max_tokens",
    ),
    ("max-tokens-string", "chat", _chat(max_tokens="10.5"), "invalid_type", "max_tokens"),
    ("max-tokens-fraction", "chat", _chat(max_tokens=1.5), "invalid_type", "max_tokens"),
    (
        "max-tokens-huge",
        "chat",
        _chat()[:-1] + b', "max_tokens": 1' + b"0" * 40 + b"}",
        "out_of_range",
        "max_tokens",
    ),
    (
        "max-completion-tokens-negative",
        "chat",
        _chat(max_completion_tokens=-3),
        "out_of_range",
        "max_completion_tokens",
    ),
    ("temperature-high", "chat", _chat(temperature=2.5), "out_of_range", "temperature"),
    ("temperature-negative", "chat", _chat(temperature=-1), "out_of_range", "temperature"),
    ("temperature-list", "chat", _chat(temperature=[1]), "invalid_type", "temperature"),
    ("top-p-zero", "chat", _chat(top_p=0), "out_of_range", "top_p"),
    ("top-k-low", "chat", _chat(top_k=-5), "out_of_range", "top_k"),
    ("min-p-high", "chat", _chat(min_p=2), "out_of_range", "min_p"),
    ("n-zero", "chat", _chat(n=0), "out_of_range", "n"),
    (
        "presence-penalty-high",
        "chat",
        _chat(presence_penalty=9),
        "out_of_range",
        "presence_penalty",
    ),
    (
        "repetition-penalty-zero",
        "chat",
        _chat(repetition_penalty=0),
        "out_of_range",
        "repetition_penalty",
    ),
    (
        "top-logprobs-high",
        "chat",
        _chat(logprobs=True, top_logprobs=50),
        "out_of_range",
        "top_logprobs",
    ),
    (
        "top-logprobs-without-logprobs",
        "chat",
        _chat(top_logprobs=2),
        "invalid_value",
        "top_logprobs",
    ),
    ("seed-too-big", "chat", _chat(seed=2**64), "out_of_range", "seed"),
    ("stop-number", "chat", _chat(stop=7), "invalid_type", "stop"),
    ("stop-list-mixed", "chat", _chat(stop=["a", 1]), "invalid_type", "stop[1]"),
    (
        "stop-token-negative",
        "chat",
        _chat(stop_token_ids=[-1]),
        "out_of_range",
        "stop_token_ids[0]",
    ),
    ("stream-string", "chat", _chat(stream="maybe"), "invalid_type", "stream"),
    (
        "stream-options-no-stream",
        "chat",
        _chat(stream_options={"include_usage": True}),
        "invalid_value",
        "stream_options",
    ),
    ("kv-params-list", "chat", _chat(kv_transfer_params=[1]), "invalid_type", "kv_transfer_params"),
    (
        "ec-params-string",
        "chat",
        _chat(ec_transfer_params="x"),
        "invalid_type",
        "ec_transfer_params",
    ),
    ("xargs-number", "chat", _chat(vllm_xargs=1), "invalid_type", "vllm_xargs"),
    ("prompt-missing", "completions", b'{"model": "m"}', "missing_field", "prompt"),
    ("prompt-empty-list", "completions", b'{"prompt": []}', "invalid_value", "prompt"),
    ("prompt-object", "completions", b'{"prompt": {"text": "x"}}', "invalid_type", "prompt"),
    ("prompt-mixed", "completions", b'{"prompt": ["a", 2]}', "invalid_type", "prompt[1]"),
    ("prompt-negative-token", "completions", b'{"prompt": [1, -2]}', "out_of_range", "prompt[1]"),
    (
        "prompt-empty-token-list",
        "completions",
        b'{"prompt": [[1], []]}',
        "invalid_value",
        "prompt[1]",
    ),
    (
        "completions-logprobs-string",
        "completions",
        b'{"prompt": "x", "logprobs": "all"}',
        "invalid_type",
        "logprobs",
    ),
    ("input-missing", "responses", b'{"model": "m"}', "missing_field", "input"),
    ("input-number", "responses", b'{"input": 1}', "invalid_type", "input"),
    ("input-empty", "responses", b'{"input": []}', "invalid_value", "input"),
    (
        "input-item-type",
        "responses",
        b'{"input": [{"type": "reasoning", "role": "user", "content": "x"}]}',
        "invalid_value",
        "input[0].type",
    ),
    (
        "input-image-object",
        "responses",
        b'{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": {"url": "https://x"}}]}]}',
        "invalid_type",
        "input[0].content[0].image_url",
    ),
    (
        "max-output-tokens-zero",
        "responses",
        b'{"input": "x", "max_output_tokens": 0}',
        "out_of_range",
        "max_output_tokens",
    ),
    ("token-ids-missing", "generate", b'{"request_id": "r"}', "missing_field", "token_ids"),
    ("token-ids-empty", "generate", b'{"token_ids": []}', "invalid_value", "token_ids"),
    ("token-ids-strings", "generate", b'{"token_ids": ["one"]}', "invalid_type", "token_ids[0]"),
    (
        "token-id-too-big",
        "generate",
        b'{"token_ids": [4294967296]}',
        "out_of_range",
        "token_ids[0]",
    ),
    (
        "generate-n-2",
        "generate",
        b'{"token_ids": [1], "sampling_params": {"n": 2}}',
        "invalid_value",
        "sampling_params.n",
    ),
    (
        "generate-sampling-list",
        "generate",
        b'{"token_ids": [1], "sampling_params": []}',
        "invalid_type",
        "sampling_params",
    ),
    (
        "generate-bad-hash",
        "generate",
        _features(["../etc"], [{"offset": 0, "length": 1}]),
        "invalid_value",
        "features.mm_hashes[0]",
    ),
    (
        "generate-placeholder-past-end",
        "generate",
        _features(["ab"], [{"offset": 1, "length": 9}]),
        "invalid_value",
        "features.mm_placeholders[0]",
    ),
]

BAD_INPUTS: list[BadInput] = [BadInput(*case) for case in _CASES]
"""At least 50 malformed bodies across the four endpoints."""
