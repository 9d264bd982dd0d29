"""Tool calls: the grammar that forces them, and the parser that reads them back.

The Qwen family (hermes style) writes each call as
``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, possibly several
in a row and with text around them. :class:`ToolPlan` is what a request asked for
(``tool_choice`` and the tools); for ``required`` and a named function the output is
constrained to exactly that format by :func:`tool_call_grammar` (a Lark grammar with
one JSON schema per tool, so the arguments validate against the tool's
``parameters``), and for ``auto`` the model writes freely and the parser picks out
what it can. :class:`HermesParser` reads a whole output; :class:`HermesStream` reads
it delta by delta and yields OpenAI stream deltas (a call's ``id``, ``type`` and
``function.name`` first, then its ``arguments`` text in pieces).

A call whose JSON does not parse, or has no string ``name``, stays in the content
as text: nothing is lost and nothing raises.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

#: ``--tool-call-parser`` values this server knows.
TOOL_PARSERS = ("hermes",)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """The tools of one request and how they may be called."""

    tools: tuple[dict[str, Any], ...]
    #: ``auto``, ``required`` or ``function`` (``none`` never makes a plan).
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The output is constrained to tool calls."""
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them (OpenAI's nested form)."""
        out = []
        for t in self.tools:
            fn = {"name": t["name"], "parameters": t.get("parameters") or _ANY_OBJECT}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            out.append({"type": "function", "function": fn})
        return out


_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def plan_from(structured: dict[str, Any] | None) -> ToolPlan | None:
    """The plan of a parsed request's ``structured`` dict; ``None`` without tools or
    with ``tool_choice: none``."""
    if not structured or not structured.get("tools"):
        return None
    choice = structured.get("tool_choice") or "auto"
    if choice == "none":
        return None
    return ToolPlan(
        tuple(structured["tools"]),
        choice,
        structured.get("tool_name"),
        bool(structured.get("parallel_tool_calls", True)),
    )


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool["name"]},
            "arguments": tool.get("parameters") or _ANY_OBJECT,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(plan: ToolPlan) -> str:
    """A Lark grammar: one call of the named function, or one or more calls (one
    when ``parallel_tool_calls`` is false) of any tool, in the hermes format."""
    tools = [t for t in plan.tools if plan.choice != "function" or t["name"] == plan.name]
    schemas = [_call_schema(t) for t in tools]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    repeat = "+" if plan.parallel and plan.choice == "required" else ""
    return (
        f"start: call{repeat}\n"
        f'call: "{OPEN}\\n" json_body "\\n{CLOSE}" "\\n"?\n'
        f"json_body: %json {json.dumps(schema)}\n"
    )


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    """One parsed call; ``arguments`` is JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _parse_call(body: str) -> ToolCall | None:
    """A call from the JSON between the tags, or ``None`` when it is not one."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    head = _header(body)
    # The arguments as the model wrote them (what a stream sends), else re-encoded.
    text = _raw_arguments(body, head[1]) if head else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


class HermesParser:
    """Whole outputs -> ``(content, calls)``."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Content (``None`` when only whitespace is left) and the calls, in order.

        An unclosed final call (the output ran out of tokens) counts when its JSON
        is complete.
        """
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                kept.append(text[pos:])
                break
            kept.append(text[pos:start])
            body_start = start + len(OPEN)
            end = text.find(CLOSE, body_start)
            body_end = len(text) if end < 0 else end
            after = len(text) if end < 0 else end + len(CLOSE)
            call = _parse_call(text[body_start:body_end])
            if call is None:
                kept.append(text[start:after])
            else:
                calls.append(call)
            pos = after
            if end < 0:
                break
        content = "".join(kept)
        if calls:
            content = content.strip()
        return (content or None), calls


@dataclass(slots=True)
class _OpenCall:
    index: int
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    #: Where the arguments' JSON starts in the call body (once known).
    args_start: int | None = None
    sent: int = 0


class HermesStream:
    """Incremental parsing: ``feed(delta)`` and then ``finish()`` return lists of
    OpenAI chat deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``).

    Text that may still become ``<tool_call>`` is held back; inside a call, the
    header is sent once ``"name"`` is complete and the arguments follow as they
    grow, holding back a trailing run of ``}`` and whitespace (it may close the
    call's object rather than the arguments).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._call: _OpenCall | None = None
        self._count = 0
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._buf += delta
        out: list[dict[str, Any]] = []
        while True:
            if not self._in_call:
                start = self._buf.find(OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    text, self._buf = (
                        self._buf[: len(self._buf) - keep],
                        self._buf[len(self._buf) - keep :],
                    )
                    if text:
                        out.append({"content": text})
                    return out
                if start > 0:
                    out.append({"content": self._buf[:start]})
                self._buf = self._buf[start + len(OPEN) :]
                self._in_call = True
                self._call = _OpenCall(self._count)
            end = self._buf.find(CLOSE)
            if end < 0:
                out.extend(self._progress(self._buf, final=False))
                return out
            out.extend(self._close(self._buf[:end]))
            self._buf = self._buf[end + len(CLOSE) :]

    def finish(self) -> list[dict[str, Any]]:
        """Flush what is held back (an unclosed call is closed if its JSON parses)."""
        out: list[dict[str, Any]] = []
        if self._in_call:
            out.extend(self._close(self._buf, closed=False))
        elif self._buf:
            out.append({"content": self._buf})
        self._buf = ""
        return out

    def _progress(self, body: str, *, final: bool) -> list[dict[str, Any]]:
        call = self._call
        if call is None:
            return []
        out: list[dict[str, Any]] = []
        if call.name is None:
            head = _header(body)
            if head is None:
                return out
            call.name, call.args_start = head
            out.append(_tool_delta(call.index, id=call.id, name=call.name, arguments=""))
        args = body[call.args_start or 0 :]
        if args.startswith('"'):
            # Arguments written as a JSON string: sent decoded, once the call closes.
            return out
        if not final:
            args = args[: len(args) - _partial_suffix(args, CLOSE)].rstrip("} \t\r\n")
        if len(args) > call.sent:
            out.append(_tool_delta(call.index, arguments=args[call.sent :]))
            call.sent = len(args)
        return out

    def _close(self, body: str, *, closed: bool = True) -> list[dict[str, Any]]:
        call, self._call, self._in_call = self._call, None, False
        if call is None:
            return []
        parsed = _parse_call(body)
        if parsed is None:
            if call.name is not None:
                # Its header already went out: the call stays as it was sent.
                self._count += 1
                return []
            return [{"content": OPEN + body + (CLOSE if closed else "")}]
        self._count += 1
        parsed.id = call.id
        self.calls.append(parsed)
        if call.name is None:
            return [
                _tool_delta(call.index, id=call.id, name=parsed.name, arguments=parsed.arguments)
            ]
        rest = parsed.arguments[call.sent :]
        return [_tool_delta(call.index, arguments=rest)] if rest else []


def _tool_delta(
    index: int, *, id: str | None = None, name: str | None = None, arguments: str
) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index}
    if id is not None:
        entry["id"] = id
        entry["type"] = "function"
    fn: dict[str, Any] = {"arguments": arguments}
    if name is not None:
        fn = {"name": name, **fn}
    entry["function"] = fn
    return {"tool_calls": [entry]}


_HEADER_PREFIX = '"name"'


def _header(body: str) -> tuple[str, int] | None:
    """``(name, where the arguments start)`` once ``{"name": "...", "arguments":`` is
    complete at the start of a call body."""
    decoder = json.JSONDecoder()
    i = _skip_ws(body, 0)
    if i >= len(body) or body[i] != "{":
        return None
    i = _skip_ws(body, i + 1)
    if not body.startswith(_HEADER_PREFIX, i):
        return None
    i = _skip_ws(body, i + len(_HEADER_PREFIX))
    if i >= len(body) or body[i] != ":":
        return None
    i = _skip_ws(body, i + 1)
    try:
        name, i = decoder.raw_decode(body, i)
    except ValueError:
        return None
    if not isinstance(name, str):
        return None
    i = _skip_ws(body, i)
    if i >= len(body) or body[i] != ",":
        return None
    i = _skip_ws(body, i + 1)
    for key in ('"arguments"', '"parameters"'):
        if body.startswith(key, i):
            j = _skip_ws(body, i + len(key))
            if j < len(body) and body[j] == ":":
                j = _skip_ws(body, j + 1)
                return (name, j) if j < len(body) else None
            return None
    return None


def _raw_arguments(body: str, start: int) -> str:
    """The arguments' JSON text as written: from ``start`` to the value's end."""
    try:
        _, end = json.JSONDecoder().raw_decode(body, start)
    except ValueError:
        return body[start:].rstrip().removesuffix("}").rstrip()
    return body[start:end]


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _finish_reason(plan: ToolPlan, finish_reason: str | None, called: bool) -> str | None:
    """``tool_calls`` when ``auto`` or ``required`` ended in calls (a named choice
    keeps ``stop``, as OpenAI reports it); ``length`` and the others stay."""
    if called and finish_reason == "stop" and plan.choice != "function":
        return "tool_calls"
    return finish_reason


def chat_message(
    plan: ToolPlan | None, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A non-stream chat ``message`` and its ``finish_reason``."""
    if plan is None:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "tool_calls": [],
        }
        return message, finish_reason
    content, calls = HermesParser().extract(text)
    message = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "tool_calls": [c.to_openai() for c in calls],
    }
    return message, _finish_reason(plan, finish_reason, bool(calls))


class ChatToolStream:
    """One streamed choice's deltas with its tool calls picked out.

    Whitespace at the end of the text so far is held back until text follows it:
    the whitespace around calls (``"\n"`` between two forced calls) is not content,
    as a non-stream message strips it. Once a call was sent, content starting
    after it has its leading whitespace dropped too; with no call at all, the held
    whitespace is sent at the end.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = HermesStream()
        self._held = ""
        self._called = False
        self._texted = False

    def _text(self, text: str) -> str:
        full = self._held + text
        body = full.rstrip()
        self._held = full[len(body) :]
        if self._called and not self._texted:
            body = body.lstrip()
        self._texted = self._texted or bool(body)
        return body

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The chat ``delta`` for ``text`` (``finished``: flush what is held)."""
        parts = self.parser.feed(text)
        if finished:
            parts += self.parser.finish()
        out: dict[str, Any] = {}
        for part in parts:
            if "content" in part:
                body = self._text(part["content"])
                if body:
                    out["content"] = out.get("content", "") + body
                continue
            self._called = True
            calls = out.setdefault("tool_calls", [])
            for entry in part["tool_calls"]:
                if calls and calls[-1]["index"] == entry["index"]:
                    fn = calls[-1]["function"]
                    fn["arguments"] += entry["function"]["arguments"]
                else:
                    calls.append(entry)
        if finished and not self._called and self._held:
            out["content"] = out.get("content", "") + self._held
            self._held = ""
        return out

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return _finish_reason(self.plan, finish_reason, bool(self.parser.calls))


class ResponseToolItems:
    """Responses API: the output items of a request with tools, built as its text
    arrives, with the events that describe each change.

    Text runs become ``message`` items and calls ``function_call`` items, in the
    order the model wrote them; a call's arguments are sent in pieces as the chat
    stream sends them (``response.function_call_arguments.delta``). Whitespace
    around calls is dropped (held back until it is known whether text follows);
    an output without calls is one message holding the whole text. A non-stream
    response feeds its whole text once, so both forms give the same items.
    """

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self.parser = HermesStream()
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._held = ""
        self._called = False

    def feed(self, text: str, finished: bool) -> list[tuple[str, dict[str, Any]]]:
        """``(event type, payload)`` pairs for ``text``; ``finished`` closes the output."""
        parts = self.parser.feed(text)
        if finished:
            parts += self.parser.finish()
        events: list[tuple[str, dict[str, Any]]] = []
        for part in parts:
            if "content" in part:
                events += self._text(part["content"])
                continue
            for entry in part["tool_calls"]:
                events += self._call(entry)
        if finished:
            if not self._called and (self._held or not self.items):
                text, self._held = self._held, ""
                events += self._message_delta(text, force=True)
            events += self._close()
        return events

    def _loc(self, item: dict[str, Any]) -> dict[str, Any]:
        index = next(i for i, x in enumerate(self.items) if x is item)
        return {"item_id": item["id"], "output_index": index}

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if self._open is not None and self._open["type"] != "message":
            events += self._close()
        full = self._held + text
        body = full.rstrip()
        self._held = full[len(body) :]
        if self._open is None and self._called:
            body = body.lstrip()
        return events + self._message_delta(body)

    def _message_delta(self, text: str, *, force: bool = False) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if not text and not force:
            return events
        if self._open is None:
            n = sum(item["type"] == "message" for item in self.items)
            msg_id = f"msg_{self._request_id}" + (f"_{n}" if n else "")
            item: dict[str, Any] = {
                "type": "message",
                "id": msg_id,
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self._open = item
            self.items.append(item)
            loc = self._loc(item)
            events.append(
                (
                    "response.output_item.added",
                    {"output_index": loc["output_index"], "item": dict(item)},
                )
            )
            item["content"] = [output_text_part("")]
            events.append(
                (
                    "response.content_part.added",
                    {**loc, "content_index": 0, "part": output_text_part("")},
                )
            )
        if text:
            self._open["content"][0]["text"] += text
            loc = {**self._loc(self._open), "content_index": 0}
            events.append(("response.output_text.delta", {**loc, "delta": text, "logprobs": []}))
        return events

    def _call(self, entry: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if "id" in entry:
            events += self._close()
            self._held = ""
            self._called = True
            suffix = entry["id"].removeprefix("chatcmpl-tool-")
            item = {
                "type": "function_call",
                "id": f"fc_{suffix}",
                "call_id": f"call_{suffix}",
                "name": entry["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self._open = item
            self.items.append(item)
            events.append(
                (
                    "response.output_item.added",
                    {"output_index": len(self.items) - 1, "item": dict(item)},
                )
            )
        args = entry["function"]["arguments"]
        if args and self._open is not None:
            self._open["arguments"] += args
            events.append(
                ("response.function_call_arguments.delta", {**self._loc(self._open), "delta": args})
            )
        return events

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item, self._open = self._open, None
        if item is None:
            return []
        loc = self._loc(item)
        item["status"] = "completed"
        events: list[tuple[str, dict[str, Any]]] = []
        if item["type"] == "message":
            part = item["content"][0]
            at = {**loc, "content_index": 0}
            events.append(
                ("response.output_text.done", {**at, "text": part["text"], "logprobs": []})
            )
            events.append(("response.content_part.done", {**at, "part": dict(part)}))
        else:
            events.append(
                ("response.function_call_arguments.done", {**loc, "arguments": item["arguments"]})
            )
        events.append(
            ("response.output_item.done", {"output_index": loc["output_index"], "item": dict(item)})
        )
        return events


def output_text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """A Responses ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
