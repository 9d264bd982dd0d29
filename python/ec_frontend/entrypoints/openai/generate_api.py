"""``/inference/v1/generate``: token ids in, token ids out (vLLM's disaggregated API).

Shapes follow vLLM 0.33's ``GenerateTokensResponse`` / ``GenerateTextResponse``
(``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``):

* non-stream: ``{"request_id", "model", "created", "output_mode", "choices":
  [{"index", "finish_reason", "stop_reason", "token_ids", "logprobs", ...}],
  "usage", "prompt_logprobs", "prompt_token_ids", "kv_transfer_params",
  "ec_transfer_params", ...}``; ``prompt_token_ids`` only with
  ``return_token_ids``;
* ``output_mode: "tokens"`` (the default): logprobs carry integer ``token_id``s
  (the sampled token first in ``top_logprobs``, then the top k); ``"text"`` adds
  each choice's ``text`` and gives chat-style logprobs with token strings;
* stream: a chunk per engine step that produced tokens (and the finishing one),
  ``prompt_token_ids`` on the first chunk with ``return_token_ids``, usage on every
  chunk with ``continuous_usage_stats``, a final usage-only chunk with
  ``include_usage``. Unlike vLLM, the finishing chunk carries the transfer params
  (DESIGN.md 4.2).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson

from ec_frontend._core import ParsedRequest
from ec_frontend.entrypoints.openai.chat_format import chat_logprobs, stream_error
from ec_frontend.entrypoints.openai.context import DONE, RequestContext, sse
from ec_frontend.entrypoints.openai.jobs import Choice, Job
from ec_frontend.entrypoints.openai.serving import Serving

#: Choice fields vLLM reports that this server never fills.
_UNREPORTED = {"routed_experts": None, "sampling_mask": None, "weight_versions": None}


def _token_logprob(lp: Any) -> dict[str, Any]:
    top = [{"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank}]
    top += [
        {"token_id": tid, "logprob": v, "rank": r}
        for r, (tid, v) in enumerate(lp.top, start=1)
        if tid != lp.token_id
    ]
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top_logprobs": top}


def _logprobs(ctx: RequestContext, text_mode: bool, logprobs: list[Any] | None) -> Any:
    if logprobs is None:
        return None
    if text_mode:
        return chat_logprobs(ctx.tokenizer, logprobs)
    return {"content": [_token_logprob(lp) for lp in logprobs]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def generate_body(
    ctx: RequestContext, parsed: ParsedRequest, choice: Choice, request_id: str
) -> bytes:
    text_mode = parsed.output_mode == "text"
    out: dict[str, Any] = {
        "index": 0,
        "finish_reason": choice.finish_reason or "stop",
        "stop_reason": choice.stop_reason,
        "token_ids": choice.token_ids,
        **_UNREPORTED,
        "logprobs": _logprobs(ctx, text_mode, choice.logprobs),
    }
    if text_mode:
        out["text"] = choice.text
    prompt = choice.prompt_token_ids
    return orjson.dumps(
        {
            "request_id": request_id,
            "model": ctx.model,
            "created": ctx.created,
            "usage": _usage(len(prompt), len(choice.token_ids)),
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": prompt if parsed.return_token_ids else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": choice.kv_transfer_params,
            "ec_transfer_params": choice.ec_transfer_params,
            "output_mode": parsed.output_mode,
            "choices": [out],
        }
    )


async def generate_stream(
    serving: Serving,
    ctx: RequestContext,
    parsed: ParsedRequest,
    jobs: list[Job],
    request_id: str,
) -> AsyncGenerator[bytes, None]:
    text_mode = parsed.output_mode == "text"
    send_prompt = parsed.return_token_ids
    generated = 0
    prompt_tokens = 0
    async with aclosing(serving.stream(jobs, ctx.started, parsed.stream_interval)) as deltas:
        async for c, out in deltas:
            if c.error is not None:
                yield stream_error(c.error)
                yield DONE
                return
            prompt_tokens = len(c.prompt_token_ids)
            generated += len(out.token_ids)
            if not (out.token_ids or out.finished or (text_mode and out.text)):
                continue
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None,
                "token_ids": list(out.token_ids),
                **_UNREPORTED,
                "logprobs": _logprobs(ctx, text_mode, out.logprobs),
            }
            if text_mode:
                choice["text"] = out.text
            chunk: dict[str, Any] = {
                "request_id": request_id,
                "usage": (
                    _usage(prompt_tokens, generated) if parsed.continuous_usage_stats else None
                ),
                "output_mode": parsed.output_mode,
                "choices": [choice],
            }
            if send_prompt:
                chunk["prompt_token_ids"] = c.prompt_token_ids
                send_prompt = False
            if out.finished:
                chunk["kv_transfer_params"] = c.kv_transfer_params
                chunk["ec_transfer_params"] = c.ec_transfer_params
            yield sse(chunk)
    if parsed.include_usage:
        final = {"request_id": request_id, "usage": _usage(prompt_tokens, generated)}
        yield sse({**final, "output_mode": parsed.output_mode, "choices": []})
    yield DONE
