"""The Responses API (``/v1/responses``): one assistant message with ``output_text``.

Non-stream: a ``response`` object. Stream: named SSE events
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (one per engine
step that generated tokens, with ``""`` when their text is empty: see
``docs/compatibility.md``), ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed``, then ``data: [DONE]``.
The ``response`` objects carry ``kv_transfer_params`` / ``ec_transfer_params``
at the top level (``null`` until known); the completed one has the final values.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from ec_frontend._core import ParsedRequest
from ec_frontend.entrypoints.context import DONE, RequestContext, sse_event
from ec_frontend.entrypoints.errors import engine_failure, error_body
from ec_frontend.entrypoints.jobs import Choice, Job, usage
from ec_frontend.entrypoints.serving import Serving


def _usage(choice: Choice) -> dict[str, Any]:
    u = usage([choice])
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _message(msg_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_part(text)]
    return {
        "type": "message",
        "id": msg_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


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
        "parallel_tool_calls": False,
        "temperature": sampling.get("temperature"),
        "top_p": sampling.get("top_p"),
        "tool_choice": "none",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "usage": usage,
        "user": parsed.user,
        "metadata": None,
        "kv_transfer_params": choice.kv_transfer_params if choice else None,
        "ec_transfer_params": choice.ec_transfer_params if choice else None,
    }


def response_body(
    serving: Serving, ctx: RequestContext, parsed: ParsedRequest, choice: Choice, resp_id: str
) -> bytes:
    """A non-stream ``response`` object."""
    msg = _message(f"msg_{ctx.request_id}", choice.text, "completed")
    return orjson.dumps(
        response_object(
            ctx,
            parsed,
            resp_id,
            status="completed",
            output=[msg],
            usage=_usage(choice),
            choice=choice,
        )
    )


async def response_stream(
    serving: Serving, ctx: RequestContext, parsed: ParsedRequest, jobs: list[Job], resp_id: str
) -> AsyncIterator[bytes]:
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
    loc = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    yield event(
        "response.output_item.added",
        {"output_index": 0, "item": _message(msg_id, "", "in_progress")},
    )
    yield event("response.content_part.added", {**loc, "part": _part("")})
    final: Choice | None = None
    async for c, out in serving.stream(jobs, ctx.started):
        if c.error is not None:
            e = engine_failure(c.error)
            body = orjson.loads(error_body(e.status, e.message, e.param, e.code))["error"]
            yield event("error", body)
            yield DONE
            return
        if out.text or out.token_ids:
            yield event("response.output_text.delta", {**loc, "delta": out.text, "logprobs": []})
        if out.finished:
            final = c
    if final is None:
        return
    yield event("response.output_text.done", {**loc, "text": final.text, "logprobs": []})
    yield event("response.content_part.done", {**loc, "part": _part(final.text)})
    item = _message(msg_id, final.text, "completed")
    yield event("response.output_item.done", {"output_index": 0, "item": item})
    done = response_object(
        ctx,
        parsed,
        resp_id,
        status="completed",
        output=[item],
        usage=_usage(final),
        choice=final,
    )
    kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
    yield event(kind, {"response": done})
    yield DONE
