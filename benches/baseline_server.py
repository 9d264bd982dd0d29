"""A FastAPI + pydantic baseline server, the way most OpenAI-compatible servers are built.

It serves ``/v1/chat/completions`` on the same mock engine as
``ec-frontend serve --mock-engine`` (same tokens, same delays), but parses the
body into a pydantic model that mirrors vLLM's ``ChatCompletionRequest`` fields,
builds the sampling params from it, and answers with a pydantic response model
dumped through ``JSONResponse`` (vLLM's pattern); streams are ``model_dump_json``
per chunk. Only the HTTP layer differs from ours, which is what the benchmark
compares.

Run: ``python benches/baseline_server.py --port 8001``.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import uvicorn
from ec_frontend.engine.mock import MockEngine, MockEngineConfig
from ec_frontend.engine.sampling_params import SamplingParams
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL
    uuid: str | None = None


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart | ImagePart]


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        extra = dict(self.vllm_xargs) if self.vllm_xargs else None
        if self.kv_transfer_params is not None:
            extra = {**(extra or {}), "kv_transfer_params": self.kv_transfer_params}
        if self.ec_transfer_params is not None:
            extra = {**(extra or {}), "ec_transfer_params": self.ec_transfer_params}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            logprobs=self.top_logprobs if self.logprobs else None,
            ignore_eos=self.ignore_eos,
            extra_args=extra,
        )


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Any = None
    finish_reason: str | None
    stop_reason: str | int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None


class StreamChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[StreamChoice]
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


def build_app(model: str, token_latency_s: float) -> FastAPI:
    engine = MockEngine(MockEngineConfig(model=model, token_latency_s=token_latency_s))
    app = FastAPI()

    def prompt_inputs(req: ChatCompletionRequest) -> Any:
        messages = []
        for m in req.messages:
            if isinstance(m.content, str):
                parts = [{"type": "text", "text": m.content}]
            else:
                parts = [
                    {"type": "text", "text": p.text} if isinstance(p, TextPart) else {}
                    for p in m.content
                ]
            messages.append({"role": m.role, "content": parts})
        return engine.processor.process_chat(messages, [])

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Any:
        rid = uuid.uuid4().hex
        inputs = prompt_inputs(req)
        params = req.to_sampling_params()
        created = int(time.time())
        if req.stream:

            async def events() -> AsyncIterator[str]:
                first = ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=model,
                    choices=[StreamChoice(index=0, delta=Delta(role="assistant", content=""))],
                )
                yield f"data: {first.model_dump_json(exclude_unset=True)}\n\n"
                async for out in engine.add_request(rid, inputs, params):
                    chunk = ChatCompletionChunk(
                        id=rid,
                        created=created,
                        model=model,
                        choices=[
                            StreamChoice(
                                index=0,
                                delta=Delta(content=out.text),
                                finish_reason=out.finish_reason,
                            )
                        ],
                    )
                    if out.finished:
                        chunk.kv_transfer_params = out.kv_transfer_params
                        chunk.ec_transfer_params = out.ec_transfer_params
                    yield f"data: {chunk.model_dump_json()}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text = ""
        tokens = 0
        final: Any = None
        async for out in engine.add_request(rid, inputs, params):
            text += out.text
            tokens += len(out.token_ids)
            final = out
        plen = len(inputs.prompt_token_ids)
        resp = ChatCompletionResponse(
            id=f"chatcmpl-{rid}",
            created=created,
            model=model,
            choices=[
                Choice(
                    index=0,
                    message=AssistantMessage(content=text),
                    finish_reason=final.finish_reason,
                    stop_reason=final.stop_reason,
                )
            ],
            usage=Usage(prompt_tokens=plen, completion_tokens=tokens, total_tokens=plen + tokens),
            kv_transfer_params=final.kv_transfer_params,
            ec_transfer_params=final.ec_transfer_params,
        )
        return JSONResponse(content=resp.model_dump())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--model", default="mock-model")
    p.add_argument("--mock-token-latency-ms", type=float, default=0.0)
    args = p.parse_args()
    app = build_app(args.model, args.mock_token_latency_ms / 1000.0)
    loop = "uvloop"
    http = "httptools"
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        loop=loop,
        http=http,
    )


if __name__ == "__main__":
    main()
