"""``/inference/v1/generate``: token ids in, token ids out (vLLM's disaggregated API).

Non-stream body: ``{"request_id", "choices": [{"index": 0, "token_ids",
"finish_reason", "stop_reason", "logprobs"}], "prompt_logprobs": null, "usage",
"kv_transfer_params", "ec_transfer_params"}``; each choice also has ``text``
when the request asked for it. Stream: chunks of the same shape with the new
token ids; the chunk with ``finish_reason`` carries the transfer params.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from ec_frontend._core import ParsedRequest
from ec_frontend.entrypoints.context import DONE, RequestContext, sse
from ec_frontend.entrypoints.jobs import Choice, Job, usage
from ec_frontend.entrypoints.openai_format import chat_logprobs, stream_error
from ec_frontend.entrypoints.serving import Serving


def _choice(
    ctx: RequestContext, c: Choice, token_ids: list[int], text: str | None, logprobs: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": 0,
        "token_ids": token_ids,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "logprobs": chat_logprobs(ctx.tokenizer, logprobs),
    }
    if text is not None:
        out["text"] = text
    return out


def generate_body(
    serving: Serving, ctx: RequestContext, choice: Choice, request_id: str, with_text: bool
) -> bytes:
    return orjson.dumps(
        {
            "request_id": request_id,
            "choices": [
                _choice(
                    ctx,
                    choice,
                    choice.token_ids,
                    choice.text if with_text else None,
                    choice.logprobs,
                )
            ],
            "prompt_logprobs": None,
            "usage": usage([choice]),
            "kv_transfer_params": choice.kv_transfer_params,
            "ec_transfer_params": choice.ec_transfer_params,
        }
    )


async def generate_stream(
    serving: Serving,
    ctx: RequestContext,
    parsed: ParsedRequest,
    jobs: list[Job],
    request_id: str,
    with_text: bool,
) -> AsyncIterator[bytes]:
    async for c, out in serving.stream(jobs, ctx.started):
        if c.error is not None:
            yield stream_error(c.error)
            yield DONE
            return
        if not out.token_ids and not out.finished:
            continue
        choice = _choice(ctx, c, list(out.token_ids), out.text if with_text else None, out.logprobs)
        chunk: dict[str, Any] = {"request_id": request_id, "choices": [choice]}
        if out.finished:
            chunk["kv_transfer_params"] = c.kv_transfer_params
            chunk["ec_transfer_params"] = c.ec_transfer_params
            if parsed.include_usage:
                chunk["usage"] = usage([c])
        else:
            choice["finish_reason"] = None
            choice["stop_reason"] = None
        yield sse(chunk)
    yield DONE
