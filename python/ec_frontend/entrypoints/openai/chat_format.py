"""Chat completions and completions bodies: non-stream JSON and SSE chunks.

Shapes follow OpenAI's API as vLLM serves it, plus the transfer params of
DESIGN.md 4.2: top-level ``kv_transfer_params`` / ``ec_transfer_params`` in a
non-stream body (``null`` when none), and on the stream chunk that carries a
choice's ``finish_reason``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, overload

import orjson

from ec_frontend._core import ParsedRequest
from ec_frontend.entrypoints.http.errors import engine_failure, error_body
from ec_frontend.entrypoints.openai.context import DONE, RequestContext, sse, token_text
from ec_frontend.entrypoints.openai.jobs import Choice, Job, first_param, usage
from ec_frontend.entrypoints.openai.serving import Serving
from ec_frontend.entrypoints.openai.tool_parsers import ChatToolStream, chat_message


def _chat_logprob_entry(tokenizer: Any, lp: Any) -> dict[str, Any]:
    tok = token_text(tokenizer, lp.token_id)
    return {
        "token": tok,
        "logprob": lp.logprob,
        "bytes": list(tok.encode()),
        "top_logprobs": [
            {"token": (t := token_text(tokenizer, tid)), "logprob": v, "bytes": list(t.encode())}
            for tid, v in lp.top
        ],
    }


@overload
def chat_logprobs(tokenizer: Any, logprobs: list[Any]) -> dict[str, Any]: ...
@overload
def chat_logprobs(tokenizer: Any, logprobs: None) -> None: ...
@overload
def chat_logprobs(tokenizer: Any, logprobs: list[Any] | None) -> dict[str, Any] | None: ...
def chat_logprobs(tokenizer: Any, logprobs: list[Any] | None) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    return {"content": [_chat_logprob_entry(tokenizer, lp) for lp in logprobs]}


def completion_logprobs(
    tokenizer: Any, logprobs: list[Any] | None, offset: int
) -> dict[str, Any] | None:
    """The legacy completions logprobs object; ``offset`` is the text offset of the first."""
    if logprobs is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in logprobs:
        tok = token_text(tokenizer, lp.token_id)
        tokens.append(tok)
        token_logprobs.append(lp.logprob)
        top.append({token_text(tokenizer, tid): v for tid, v in lp.top})
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_body(
    ctx: RequestContext,
    choices: list[Choice],
    usage: dict[str, Any],
    ids: str,
    token_ids: bool = False,
) -> bytes:
    """A non-stream ``chat.completion`` body; with ``token_ids`` (vLLM's
    ``return_token_ids``) the prompt's ids at the top and each choice's own."""
    body = orjson.dumps(
        {
            "id": ids,
            "object": "chat.completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": [
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(ctx.tokenizer, c.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
                for message, finish_reason in [chat_message(c.tools, c.text, c.finish_reason)]
            ],
            "usage": usage,
            "system_fingerprint": None,
            "kv_transfer_params": first_param(choices, "kv_transfer_params"),
            "ec_transfer_params": first_param(choices, "ec_transfer_params"),
        }
    )
    if not token_ids:
        return body
    obj = orjson.loads(body)
    obj["prompt_token_ids"] = choices[0].prompt_token_ids if choices else None
    for c, out in zip(choices, obj["choices"], strict=True):
        out["token_ids"] = c.token_ids
    return orjson.dumps(obj)


def completion_body(
    ctx: RequestContext,
    choices: list[Choice],
    usage: dict[str, Any],
    ids: str,
    echo: bool,
    token_ids: bool = False,
) -> bytes:
    """A non-stream ``text_completion`` body; with ``token_ids`` (vLLM's
    ``return_token_ids``) each choice has its prompt's ids and its own."""
    out = []
    for c in choices:
        prefix = c.prompt_text if echo and c.prompt_text is not None else ""
        out.append(
            {
                "index": c.index,
                "text": prefix + c.text,
                "logprobs": completion_logprobs(ctx.tokenizer, c.logprobs, len(prefix)),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
        if token_ids:
            out[-1]["prompt_token_ids"] = c.prompt_token_ids
            out[-1]["token_ids"] = c.token_ids
    return orjson.dumps(
        {
            "id": ids,
            "object": "text_completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": out,
            "usage": usage,
            "system_fingerprint": None,
            "kv_transfer_params": first_param(choices, "kv_transfer_params"),
            "ec_transfer_params": first_param(choices, "ec_transfer_params"),
        }
    )


def stream_error(message: str) -> bytes:
    """An SSE error event for a request the engine failed, classified as its response would be."""
    e = engine_failure(message)
    return b"data: " + error_body(e.status, e.message, e.param, e.code) + b"\n\n"


async def _stream(
    serving: Serving,
    ctx: RequestContext,
    parsed: ParsedRequest,
    jobs: list[Job],
    ids: str,
    object_name: str,
    opening: list[dict[str, Any]],
    fields: Callable[[Choice, Any], dict[str, Any]],
) -> AsyncGenerator[bytes, None]:
    """SSE chunks shared by both streamed APIs, ending with ``data: [DONE]``.

    ``opening`` choices are sent first, one chunk each. Then, as vLLM does, one
    chunk per engine output that generated tokens, even when their text is empty
    (a special token, or text held back for a stop string or an incomplete
    character), or that carries text, logprobs or the finish; outputs with none
    of these (progress of a chunked prefill) send nothing. ``fields(choice,
    output)`` gives the API-specific keys placed between ``index`` and
    ``finish_reason``; it is called once per chunk, in stream order. The
    finishing chunk of a choice also carries its ``stop_reason`` and transfer
    params. As vLLM: ``stream_interval`` merges a choice's outputs, with
    ``continuous_usage_stats`` every chunk has the choice's usage so far, and with
    ``return_token_ids`` every choice chunk has its new ``token_ids``.
    """
    usage_on = parsed.include_usage
    continuous = parsed.continuous_usage_stats
    with_ids = parsed.return_token_ids
    prompt_ids = {j.index: j.inputs.prompt_token_ids for j in jobs}
    prompt_len = {k: len(v) for k, v in prompt_ids.items()}
    base: dict[str, Any] = {
        "id": ids,
        "object": object_name,
        "created": ctx.created,
        "model": ctx.model,
    }
    # Every chunk starts with ``base`` and, without continuous usage, ends alike:
    # those bytes are made once, and a chunk serializes only its choice.
    head = b"data: " + orjson.dumps(base)[:-1] + b',"choices":['
    tail = b'],"usage":null}\n\n' if usage_on else b"]}\n\n"

    def chunk(
        choice: dict[str, Any], extra: dict[str, Any] | None = None, generated: int = 0
    ) -> bytes:
        if not (extra or continuous):
            return head + orjson.dumps(choice) + tail
        obj = {**base, "choices": [choice]}
        if extra:
            obj.update(extra)
        if continuous:
            prompt = prompt_len[choice["index"]]
            obj["usage"] = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + generated,
                "completion_tokens": generated,
            }
        elif usage_on:
            obj["usage"] = None
        return sse(obj)

    for choice in opening:
        ids_extra = {"prompt_token_ids": prompt_ids[choice["index"]]} if with_ids else None
        yield chunk(choice, ids_extra)
    seen: dict[int, Choice] = {}
    # The events of the deltas that are already there go out in one write; the
    # last choice's finish waits for the usage chunk and ``[DONE]`` behind it.
    pending: list[bytes] = []
    unfinished = len(jobs)
    # Closed here, whichever way this generator ends (its own early return, or its
    # reader closing it at a yield): the jobs still running are aborted at once rather
    # than whenever the collector finalises an abandoned stream.
    async with aclosing(serving.stream(jobs, ctx.started, parsed.stream_interval)) as deltas:
        try:
            async for c, out in deltas:
                if c.error is not None:
                    yield b"".join([*pending, stream_error(c.error), DONE])
                    return
                seen[c.index] = c
                finished = out.finished
                if out.token_ids or out.text or out.logprobs or finished:
                    choice = {
                        "index": c.index,
                        **fields(c, out),
                        "finish_reason": c.finish_reason if finished else None,
                    }
                    if with_ids:
                        choice["token_ids"] = list(out.token_ids)
                    generated = len(c.token_ids)
                    if finished:
                        unfinished -= 1
                        choice["stop_reason"] = c.stop_reason
                        params = {
                            "kv_transfer_params": c.kv_transfer_params,
                            "ec_transfer_params": c.ec_transfer_params,
                        }
                        pending.append(chunk(choice, params, generated))
                    else:
                        pending.append(chunk(choice, None, generated))
                if pending and unfinished and not deltas.ready:
                    yield b"".join(pending)
                    pending.clear()
        except Exception:
            if pending:  # what was ready goes out before the error event
                yield b"".join(pending)
            raise
    if usage_on:
        pending.append(sse({**base, "choices": [], "usage": usage(list(seen.values()))}))
    pending.append(DONE)
    yield b"".join(pending)


def chat_stream(
    serving: Serving, ctx: RequestContext, parsed: ParsedRequest, jobs: list[Job], ids: str
) -> AsyncGenerator[bytes, None]:
    """SSE chunks of a streamed chat completion, ending with ``data: [DONE]``."""
    opening = [
        {
            "index": j.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for j in jobs
    ]

    tool_streams = {j.index: ChatToolStream(j.tools) for j in jobs if j.tools is not None}

    def fields(c: Choice, out: Any) -> dict[str, Any]:
        # vLLM's delta: the text, even when empty; ``{}`` only for a choice that
        # finishes without having generated anything (an abort before the first token).
        produced = bool(out.text or c.token_ids)
        delta = {"content": out.text} if produced else {}
        tools = tool_streams.get(c.index)
        if tools is not None:
            delta = tools.delta(out.text, out.finished)
            if out.finished:
                # Read by the caller right after this returns (the chunk's finish_reason).
                c.finish_reason = tools.finish_reason(c.finish_reason)
        return {
            "delta": delta,
            "logprobs": chat_logprobs(ctx.tokenizer, out.logprobs) if out.logprobs else None,
        }

    return _stream(serving, ctx, parsed, jobs, ids, "chat.completion.chunk", opening, fields)


def completion_stream(
    serving: Serving, ctx: RequestContext, parsed: ParsedRequest, jobs: list[Job], ids: str
) -> AsyncGenerator[bytes, None]:
    """SSE chunks of a streamed completion, ending with ``data: [DONE]``.

    With ``echo``, as in vLLM, a choice's first chunk carries its prompt text
    followed by the first generated text, and logprob text offsets count from
    the end of the prompt.
    """
    echo = {j.index: j.prompt_text for j in jobs if parsed.echo and j.prompt_text}
    offsets = {j.index: len(echo.get(j.index, "")) for j in jobs}
    first = {j.index for j in jobs} if parsed.return_token_ids else set()

    def fields(c: Choice, out: Any) -> dict[str, Any]:
        logprobs = None
        if out.logprobs:
            logprobs = completion_logprobs(ctx.tokenizer, out.logprobs, offsets[c.index])
        offsets[c.index] += len(out.text)
        got = {"text": echo.pop(c.index, "") + out.text, "logprobs": logprobs}
        if c.index in first:
            first.discard(c.index)
            got["prompt_token_ids"] = c.prompt_token_ids
        return got

    return _stream(serving, ctx, parsed, jobs, ids, "text_completion", [], fields)
