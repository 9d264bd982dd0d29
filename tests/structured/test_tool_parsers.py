"""The hermes tool-call parser over Qwen-format outputs, whole and streamed, and the
grammar that forces tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ec_frontend.entrypoints.openai.tool_parsers import (
    ChatToolStream,
    HermesParser,
    HermesStream,
    ResponseToolItems,
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


def _responses_replay(text: str, size: int) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """Feed ``text`` to :class:`ResponseToolItems` in pieces of ``size`` characters and
    rebuild the output items from the events alone, as a client does; checks each
    event's ``output_index``/``item_id`` against the items announced so far. Returns
    the rebuilt items and the number of argument deltas per output index."""
    items = ResponseToolItems("req")
    built: list[dict[str, Any]] = []
    done: set[int] = set()
    deltas: dict[int, int] = {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    events = []
    for n, piece in enumerate(pieces):
        events += items.feed(piece, finished=n == len(pieces) - 1)
    for kind, payload in events:
        index = payload["output_index"]
        if kind == "response.output_item.added":
            assert index == len(built) and payload["item"]["status"] == "in_progress"
            built.append(json.loads(json.dumps(payload["item"])))
            continue
        item = built[index]
        assert index not in done, f"{kind} after the item was done"
        if kind != "response.output_item.done":
            assert payload["item_id"] == item["id"]
        if kind == "response.content_part.added":
            item["content"].append(payload["part"])
        elif kind == "response.output_text.delta":
            item["content"][payload["content_index"]]["text"] += payload["delta"]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += payload["delta"]
            deltas[index] = deltas.get(index, 0) + 1
        elif kind == "response.function_call_arguments.done":
            assert payload["arguments"] == item["arguments"]
        elif kind == "response.output_text.done":
            assert payload["text"] == item["content"][0]["text"]
        elif kind == "response.output_item.done":
            assert {**item, "status": "completed"} == payload["item"]
            built[index] = payload["item"]
            done.add(index)
    assert done == set(range(len(built))), "every item is done at the end"
    assert built == items.items
    return built, deltas


def _shape(items: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """``("message", text)`` or ``(name, arguments: parsed, else the raw text)``."""
    out: list[tuple[str, Any]] = []
    for i in items:
        if i["type"] == "message":
            out.append(("message", i["content"][0]["text"]))
            continue
        try:
            out.append((i["name"], json.loads(i["arguments"])))
        except ValueError:
            out.append((i["name"], i["arguments"]))
    return out


BROKEN = '<tool_call>\n{"name": "broken", "arguments": {"x": }\n</tool_call>'

# (output, items when fed whole, items when streamed character by character if they differ)
RESPONSES_CASES: list[tuple[str, list[tuple[str, Any]], list[tuple[str, Any]] | None]] = [
    ("Just text, no tools.", [("message", "Just text, no tools.")], None),
    (" \n", [("message", " \n")], None),
    ("", [("message", "")], None),
    (
        "Let me check.\n" + WEATHER + "\n" + ADD + "\nDone. ",
        [
            ("message", "Let me check."),
            ("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("add", {"a": 1, "b": {"c": [2, "}"]}}),
            ("message", "Done."),
        ],
        None,
    ),
    # A broken call is text when read whole; streamed, its header went out before
    # the JSON broke, so it stays the call that was sent.
    (
        BROKEN + "\n" + ADD,
        [("message", BROKEN), ("add", {"a": 1, "b": {"c": [2, "}"]}})],
        [("broken", '{"x":'), ("add", {"a": 1, "b": {"c": [2, "}"]}})],
    ),
]


@pytest.mark.parametrize(("text", "whole", "streamed"), RESPONSES_CASES)
@pytest.mark.parametrize("size", [1, 1 << 20])
def test_responses_items_stream_as_written(
    text: str,
    whole: list[tuple[str, Any]],
    streamed: list[tuple[str, Any]] | None,
    size: int,
) -> None:
    """Streamed in pieces or fed whole, the Responses items are the text runs and the
    calls in order; a call's arguments arrive in several deltas when the text does."""
    built, deltas = _responses_replay(text, size)
    assert _shape(built) == (whole if size > 1 or streamed is None else streamed)
    calls = [i for i, item in enumerate(built) if item["type"] == "function_call"]
    assert all(built[i]["call_id"].startswith("call_") for i in calls)
    if size == 1:
        assert all(deltas[i] > 3 for i in calls)
    assert len({item["id"] for item in built}) == len(built)


#: The cases a stream reads as a whole output does (a call whose header went out
#: before its JSON broke stays a call in a stream: tested above).
STREAM_AGREES = [case for case in CASES if '"broken"' not in case[0]]


@pytest.mark.parametrize(("text", "content", "calls"), STREAM_AGREES)
def test_chat_stream_content_equals_the_message_content(
    text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    """Streamed a character at a time, the content deltas add up to the non-stream
    message's content (whitespace around calls, such as the newline between two
    forced calls, is not content), and the calls are the same."""
    tools = ChatToolStream(PLAN)
    streamed = ""
    names: list[str] = []
    for i, ch in enumerate(text):
        delta = tools.delta(ch, finished=i == len(text) - 1)
        streamed += delta.get("content", "")
        names += [e["function"]["name"] for e in delta.get("tool_calls", []) if "id" in e]
    assert names == [name for name, _ in calls]
    assert streamed == (content or "")


def test_chat_stream_drops_the_newline_between_forced_calls() -> None:
    tools = ChatToolStream(ToolPlan(PLAN.tools, "required"))
    text = WEATHER + "\n" + ADD + "\n"
    deltas = [
        tools.delta(text[i : i + 3], finished=i + 3 >= len(text)) for i in range(0, len(text), 3)
    ]
    assert all("content" not in d for d in deltas)
    assert tools.finish_reason("stop") == "tool_calls"
