"""Structured outputs through prefill and decode instances (``ec-frontend proxy``).

Prefill samples the first token under the grammar; decode receives it with the KV
and constrains from its own first sampled token, its matcher caught up over the
token it was given. Greedy constrained outputs through P/D must be token-identical
to the prefill instance's own when it serves the request whole (a decode matcher
that missed prefill's token would mask differently and diverge, or write invalid
JSON), streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from ..disagg.conftest import MODEL_NAME, proxy, serve, side_channel_kv
from ..helpers.processes import Proc, start_all, stop_all

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rain": {"type": "boolean"},
        "temps": {
            "type": "array",
            "items": {"type": "integer", "minimum": -30, "maximum": 45},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["city", "rain", "temps"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string", "maxLength": 8}},
                "required": ["q"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.fixture(scope="module")
def dep(builtin_model_dir: Path) -> Iterator[dict[str, Proc]]:
    m = builtin_model_dir
    engines = {
        "p": serve(m, "p", kv=side_channel_kv("kv_producer", ttl_s=10.0)),
        "d": serve(m, "d", kv=side_channel_kv("kv_consumer")),
    }
    procs = start_all(list(engines.values()))
    px = proxy("px", prefill=[engines["p"].url], decode=[engines["d"].url])
    procs += start_all([px])
    yield {**engines, "px": px}
    stop_all(procs)


def _client(p: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(p: Proc, stream: bool, **extra: Any) -> tuple[str, list[Any], str]:
    """Text (or the tool call arguments), tool call names, finish reason."""
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Weather in Oslo as JSON."}],
        "max_tokens": 200,
        "temperature": 0,
        **extra,
    }
    with _client(p) as c:
        if not stream:
            r = c.chat.completions.create(**kwargs)
            msg = r.choices[0].message
            calls = [(t.function.name, t.function.arguments) for t in msg.tool_calls or []]  # type: ignore[union-attr]
            return msg.content or "", calls, r.choices[0].finish_reason
        text, finish = "", ""
        calls_by_index: dict[int, list[str]] = {}
        for chunk in c.chat.completions.create(stream=True, **kwargs):
            for ch in chunk.choices:
                text += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    entry = calls_by_index.setdefault(tc.index, ["", ""])
                    if tc.function is not None:
                        entry[0] += tc.function.name or ""
                        entry[1] += tc.function.arguments or ""
                finish = ch.finish_reason or finish
        return text, [tuple(calls_by_index[i]) for i in sorted(calls_by_index)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_through_prefill_and_decode(dep: dict[str, Proc], stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    want, _, want_finish = _chat(dep["p"], False, response_format=fmt)
    jsonschema.validate(json.loads(want), SCHEMA)
    received = dep["d"].metric("kv_tokens_received_total")
    got, _, finish = _chat(dep["px"], stream, response_format=fmt)
    assert (got, finish) == (want, want_finish) == (got, "stop")
    # Decode pulled the prompt's KV: it did not prefill (or sample the first token) itself.
    assert dep["d"].metric("kv_tokens_received_total") > received


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_tools_through_prefill_and_decode(dep: dict[str, Proc], stream: bool) -> None:
    regex = {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{3}"}}
    want, _, _ = _chat(dep["p"], False, extra_body=regex)
    got, _, finish = _chat(dep["px"], stream, extra_body=regex)
    assert got == want and finish == "stop" and len(got) == 7
    named = {"type": "function", "function": {"name": "lookup"}}
    _, want_calls, _ = _chat(dep["p"], False, tools=TOOLS, tool_choice=named)
    _, calls, _ = _chat(dep["px"], stream, tools=TOOLS, tool_choice=named)
    assert calls == want_calls and [c[0] for c in calls] == ["lookup"]
    jsonschema.validate(json.loads(calls[0][1]), TOOLS[0]["function"]["parameters"])
