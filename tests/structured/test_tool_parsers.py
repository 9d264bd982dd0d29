"""The hermes tool-call parser over Qwen-format outputs, whole and streamed, and the
grammar that forces tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ec_frontend.entrypoints.tool_parsers import (
    ChatToolStream,
    HermesParser,
    HermesStream,
    ToolPlan,
    chat_message,
    plan_from,
    tool_call_grammar,
)

WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": [2, "}"]}}}\n</tool_call>'

# (output, expected content, expected [(name, arguments as parsed JSON)])
CASES: list[tuple[str, str | None, list[tuple[str, Any]]]] = [
    ("Just text, no tools.", "Just text, no tools.", []),
    (WEATHER, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (
        WEATHER + "\n" + ADD,
        None,
        [
            ("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("add", {"a": 1, "b": {"c": [2, "}"]}}),
        ],
    ),
    (
        "Let me check.\n" + WEATHER + "\nDone.",
        "Let me check.\n\nDone.",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    # Malformed JSON stays in the content; the good call next to it is still a call.
    (
        '<tool_call>\n{"name": "broken", "arguments": {"x": }\n</tool_call>\n' + ADD,
        '<tool_call>\n{"name": "broken", "arguments": {"x": }\n</tool_call>',
        [("add", {"a": 1, "b": {"c": [2, "}"]}})],
    ),
    # JSON that is not a call (no string name) is content too.
    ('<tool_call>\n["a", 1]\n</tool_call>', '<tool_call>\n["a", 1]\n</tool_call>', []),
    # An unclosed last call (the output ran out) counts when its JSON is whole.
    ('<tool_call>\n{"name": "f", "arguments": {}}', None, [("f", {})]),
    ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    # Arguments given as a JSON string (some fine-tunes do) are kept as that string.
    (
        '<tool_call>\n{"name": "f", "arguments": "{\\"k\\": 2}"}\n</tool_call>',
        None,
        [("f", {"k": 2})],
    ),
    # Unicode and escapes in arguments.
    (
        '<tool_call>\n{"name": "say", "arguments": {"t": "h\\u00e9 \\"q\\" ü"}}\n</tool_call>',
        None,
        [("say", {"t": 'hé "q" ü'})],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_output(text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    got_content, got = HermesParser().extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


def _replay(text: str, sizes: list[int]) -> tuple[str, list[dict[str, Any]]]:
    """Feed ``text`` in pieces of the given sizes (cycled); the content and the calls
    as an OpenAI client accumulates them."""
    stream = HermesStream()
    parts: list[dict[str, Any]] = []
    pos = i = 0
    while pos < len(text):
        n = sizes[i % len(sizes)]
        parts += stream.feed(text[pos : pos + n])
        pos += n
        i += 1
    parts += stream.finish()
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for part in parts:
        if "content" in part:
            content += part["content"]
            continue
        for entry in part["tool_calls"]:
            call = calls.setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in entry:
                assert call["id"] is None, "a call's id is sent once"
                call["id"] = entry["id"]
                call["name"] = entry["function"]["name"]
            call["arguments"] += entry["function"]["arguments"]
    return content, [calls[k] for k in sorted(calls)]


BROKEN_AFTER_HEADER = CASES[4][0]


@pytest.mark.parametrize(
    ("text", "content", "calls"), [c for c in CASES if c[0] != BROKEN_AFTER_HEADER]
)
@pytest.mark.parametrize("sizes", [[1], [2, 3], [7], [1000]])
def test_stream_matches_whole(
    text: str, content: str | None, calls: list[tuple[str, Any]], sizes: list[int]
) -> None:
    streamed_content, streamed = _replay(text, sizes)
    whole_content, whole = HermesParser().extract(text)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls
    # The streamed argument text is exactly what a non-stream response carries.
    assert [c["arguments"] for c in streamed] == [c.arguments for c in whole]
    if calls:
        assert streamed_content.strip() == (whole_content or "")
    else:
        assert streamed_content == text


@pytest.mark.parametrize("sizes", [[1], [5], [1000]])
def test_stream_cannot_take_back_a_call_whose_json_breaks(sizes: list[int]) -> None:
    """Once a call's header went out, malformed arguments that follow stay in that
    call (a stream cannot retract it); the next call gets the next index. Fed whole,
    the broken call has no header yet and stays content, as in a non-stream body."""
    content, calls = _replay(BROKEN_AFTER_HEADER, sizes)
    if sizes == [1000]:
        assert [c["name"] for c in calls] == ["add"]
        assert content.strip() == CASES[4][1]
        return
    assert [c["name"] for c in calls] == ["broken", "add"]
    assert calls[0]["arguments"] == '{"x":'
    assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": {"c": [2, "}"]}}


def test_arguments_stream_before_the_call_closes() -> None:
    stream = HermesStream()
    out = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    entries = [e for part in out for e in part.get("tool_calls", [])]
    assert entries[0]["id"].startswith("chatcmpl-tool-")
    assert entries[0]["function"]["name"] == "get_weather"
    assert "".join(e["function"]["arguments"] for e in entries) == '{"city": "Par'
    # A trailing '}' may close the call rather than the arguments: held back.
    out = stream.feed('is"}')
    assert "".join(e["function"]["arguments"] for p in out for e in p["tool_calls"]) == 'is"'
    out = stream.feed("}\n</tool_call>")
    assert "".join(e["function"]["arguments"] for p in out for e in p["tool_calls"]) == "}"


def test_partial_open_tag_is_held_back() -> None:
    stream = HermesStream()
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]
    assert stream.feed("kit") == [{"content": "<toolkit"}]
    assert stream.finish() == []


PLAN = ToolPlan(
    (
        {"name": "get_weather", "description": None, "parameters": {"type": "object"}},
        {"name": "add", "description": "sum", "parameters": None},
    ),
    "auto",
)


def test_chat_message_and_finish_reason() -> None:
    message, reason = chat_message(PLAN, "ok " + WEATHER, "stop")
    assert reason == "tool_calls"
    assert message["content"] == "ok"
    assert message["tool_calls"][0]["type"] == "function"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
    # No calls: plain content, finish reason unchanged; length is never rewritten.
    assert chat_message(PLAN, "hi", "stop") == (
        {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": []},
        "stop",
    )
    assert chat_message(PLAN, WEATHER, "length")[1] == "length"
    named = ToolPlan(PLAN.tools, "function", "add")
    assert chat_message(named, ADD, "stop")[1] == "stop"
    # Without a plan the text is the content, whatever it looks like.
    assert chat_message(None, WEATHER, "stop")[0]["content"] == WEATHER


def test_chat_tool_stream_merges_a_call_into_one_entry() -> None:
    tools = ChatToolStream(PLAN)
    delta = tools.delta(WEATHER, finished=True)
    (entry,) = delta["tool_calls"]
    assert entry["function"]["name"] == "get_weather"
    assert json.loads(entry["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert tools.finish_reason("stop") == "tool_calls"


def test_plan_from_parsed() -> None:
    assert plan_from(None) is None
    tools = [{"name": "f", "description": None, "parameters": None, "strict": False}]
    assert plan_from({"tools": tools, "tool_choice": "none"}) is None
    plan = plan_from({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert plan is not None and plan.forced and not plan.parallel
    assert plan.template_tools() == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]


def test_tool_call_grammar_names_every_tool_or_the_chosen_one() -> None:
    both = tool_call_grammar(ToolPlan(PLAN.tools, "required"))
    assert both.startswith("start: call+\n") and '"get_weather"' in both and '"add"' in both
    one = tool_call_grammar(ToolPlan(PLAN.tools, "required", parallel=False))
    assert one.startswith("start: call\n")
    named = tool_call_grammar(ToolPlan(PLAN.tools, "function", "add"))
    assert '"add"' in named and "get_weather" not in named
