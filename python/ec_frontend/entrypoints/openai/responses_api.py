"""The Responses API (``/v1/responses``): one assistant message with ``output_text``.

Non-stream: a ``response`` object. Stream: named SSE events
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (one per engine
step that generated tokens, with ``""`` when their text is empty: see
``docs/compatibility.md``), ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed``, then ``data: [DONE]``.
With tools, the text runs and calls come as their own items, in the order the model
wrote them: a call's ``response.output_item.added`` (``function_call``), its
arguments in ``response.function_call_arguments.delta`` pieces, then ``.done`` and
``response.output_item.done``, each with its ``output_index`` and ``item_id``.
The ``response`` objects carry ``kv_transfer_params`` / ``ec_transfer_params``
at the top level (``null`` until known); the completed one has the final values.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson

from ec_frontend._core import ParsedRequest
from ec_frontend.entrypoints.http.errors import engine_failure, error_body
from ec_frontend.entrypoints.openai.chat_format import chat_logprobs
from ec_frontend.entrypoints.openai.context import DONE, RequestContext, sse_event
from ec_frontend.entrypoints.openai.jobs import Choice, Job, usage
from ec_frontend.entrypoints.openai.serving import Serving
from ec_frontend.entrypoints.openai.tool_parsers import ResponseToolItems, output_text_part


def _usage(choice: Choice) -> dict[str, Any]:
    u = usage([choice])
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _message(
    msg_id: str, text: str, status: str, logprobs: list[Any] | None = None
) -> dict[str, Any]:
    content = [] if status == "in_progress" else [output_text_part(text, logprobs)]
    return {
        "type": "message",
        "id": msg_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _logprobs(ctx: RequestContext, logprobs: list[Any] | None) -> list[Any]:
    """OpenAI's output-text logprobs (computed only when ``include`` asks for them)."""
    return chat_logprobs(ctx.tokenizer, logprobs)["content"] if logprobs else []


def response_object(
    ctx: RequestContext,
    parsed: ParsedRequest,
    resp_id: str,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    choice: Choice | None,
) -> dict[str, Any]:
    sampling = parsed.sampling
    incomplete = None
    if choice is not None and choice.finish_reason == "length":
        status = "incomplete"
        incomplete = {"reason": "max_output_tokens"}
    return {
        "id": resp_id,
        "object": "response",
        "created_at": ctx.created,
        "model": ctx.model,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": parsed.instructions,
        "max_output_tokens": sampling.get("max_tokens"),
        "output": output,
        **_tools_echo(parsed.structured),
        "temperature": sampling.get("temperature"),
        "top_p": sampling.get("top_p"),
        "text": {"format": {"type": "text"}},
        "usage": usage,
        "user": parsed.user,
        "metadata": None,
        "kv_transfer_params": choice.kv_transfer_params if choice else None,
        "ec_transfer_params": choice.ec_transfer_params if choice else None,
    }


def _tools_echo(structured: dict[str, Any] | None) -> dict[str, Any]:
    """``parallel_tool_calls``, ``tool_choice`` and ``tools`` as the request set them."""
    structured = structured or {}
    choice: Any = structured.get("tool_choice") or "none"
    if choice == "function":
        choice = {"type": "function", "name": structured.get("tool_name")}
    tools = [{"type": "function", **t} for t in structured.get("tools") or []]
    return {
        "parallel_tool_calls": bool(structured.get("parallel_tool_calls", False)),
        "tool_choice": choice,
        "tools": tools,
    }


def _error_payload(message: str) -> dict[str, Any]:
    """The ``error`` event of a request the engine failed, classified as its response."""
    e = engine_failure(message)
    return orjson.loads(error_body(e.status, e.message, e.param, e.code))["error"]


def _output(ctx: RequestContext, choice: Choice) -> list[dict[str, Any]]:
    """The output items: the message, or with tools the text runs and the calls in
    the order written (built as a stream builds them)."""
    if choice.tools is None:
        msg_id = f"msg_{ctx.request_id}"
        return [_message(msg_id, choice.text, "completed", _logprobs(ctx, choice.logprobs))]
    items = ResponseToolItems(ctx.request_id)
    items.feed(choice.text, finished=True)
    return items.items


def response_body(
    serving: Serving, ctx: RequestContext, parsed: ParsedRequest, choice: Choice, resp_id: str
) -> bytes:
    """A non-stream ``response`` object."""
    return orjson.dumps(
        response_object(
            ctx,
            parsed,
            resp_id,
            status="completed",
            output=_output(ctx, choice),
            usage=_usage(choice),
            choice=choice,
        )
    )


async def response_stream(
    serving: Serving, ctx: RequestContext, parsed: ParsedRequest, jobs: list[Job], resp_id: str
) -> AsyncGenerator[bytes, None]:
    """The Responses API event stream for a single-choice request."""
    seq = 0
    msg_id = f"msg_{ctx.request_id}"

    def event(kind: str, payload: dict[str, Any]) -> bytes:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **payload}
        seq += 1
        return sse_event(kind, data)

    start = response_object(
        ctx, parsed, resp_id, status="in_progress", output=[], usage=None, choice=None
    )
    yield event("response.created", {"response": start})
    yield event("response.in_progress", {"response": start})
    if jobs and jobs[0].tools is not None:
        async with aclosing(_tool_events(serving, ctx, parsed, jobs, resp_id, event)) as events:
            async for chunk in events:
                yield chunk
        return
    loc = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    yield event(
        "response.output_item.added",
        {"output_index": 0, "item": _message(msg_id, "", "in_progress")},
    )
    yield event("response.content_part.added", {**loc, "part": output_text_part("")})
    final: Choice | None = None
    async with aclosing(serving.stream(jobs, ctx.started)) as deltas:
        async for c, out in deltas:
            if c.error is not None:
                yield event("error", _error_payload(c.error))
                yield DONE
                return
            if out.text or out.token_ids:
                delta = {**loc, "delta": out.text, "logprobs": _logprobs(ctx, out.logprobs)}
                yield event("response.output_text.delta", delta)
            if out.finished:
                final = c
    if final is None:
        return
    logprobs = _logprobs(ctx, final.logprobs)
    yield event("response.output_text.done", {**loc, "text": final.text, "logprobs": logprobs})
    yield event(
        "response.content_part.done", {**loc, "part": output_text_part(final.text, logprobs)}
    )
    item = _message(msg_id, final.text, "completed", logprobs)
    yield event("response.output_item.done", {"output_index": 0, "item": item})
    yield _completed(ctx, parsed, resp_id, [item], final, event)
    yield DONE


def _completed(
    ctx: RequestContext,
    parsed: ParsedRequest,
    resp_id: str,
    output: list[dict[str, Any]],
    final: Choice,
    event: Any,
) -> bytes:
    """The closing ``response.completed`` (or ``response.incomplete``) event."""
    done = response_object(
        ctx, parsed, resp_id, status="completed", output=output, usage=_usage(final), choice=final
    )
    kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
    return event(kind, {"response": done})


async def _tool_events(
    serving: Serving,
    ctx: RequestContext,
    parsed: ParsedRequest,
    jobs: list[Job],
    resp_id: str,
    event: Any,
) -> AsyncGenerator[bytes, None]:
    """With tools: each step's text is parsed as it arrives; a text run streams as a
    message, a call as a ``function_call`` item whose arguments come in pieces."""
    items = ResponseToolItems(ctx.request_id)
    final: Choice | None = None
    async with aclosing(serving.stream(jobs, ctx.started)) as deltas:
        async for c, out in deltas:
            if c.error is not None:
                yield event("error", _error_payload(c.error))
                yield DONE
                return
            for kind, payload in items.feed(out.text, out.finished):
                yield event(kind, payload)
            if out.finished:
                final = c
    if final is None:
        return
    yield _completed(ctx, parsed, resp_id, items.items, final, event)
    yield DONE
