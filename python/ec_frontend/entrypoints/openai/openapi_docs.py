"""Pydantic models that describe the API on ``/docs``; never used to parse a body.

``/docs`` (and ``/redoc``) is one HTML page rendered here from the OpenAPI document,
with no script and no asset from another host.

Bodies are parsed by ``ec_frontend._core``. These models mirror what it accepts
and what the formatters emit, so the OpenAPI document is a true description of
the wire format: request bodies are attached through ``openapi_extra`` and
response bodies through ``responses``.
"""

from __future__ import annotations

import html
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

JSONObject = dict[str, Any]


class _Doc(BaseModel):
    model_config = {"extra": "allow"}


class ImageURL(_Doc):
    url: str = Field(description="A base64 `data:` URL (image/png, image/jpeg, ...).")


class ContentPart(_Doc):
    type: Literal["text", "image_url", "input_text", "input_image"]
    text: str | None = None
    image_url: ImageURL | str | None = None
    uuid: str | None = Field(None, description="Replaces the content hash as the item's mm_hash.")


class ChatMessage(_Doc):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class StreamOptions(_Doc):
    include_usage: bool = False


class TransferFields(_Doc):
    kv_transfer_params: JSONObject | None = Field(
        None, description="KV hand-off (NIXL-compatible keys); `{}` is forwarded as `{}`."
    )
    ec_transfer_params: JSONObject | None = Field(
        None, description="Encoder-output hand-off, keyed by mm_hash."
    )
    vllm_xargs: JSONObject | None = Field(None, description="Extra engine arguments.")


class SamplingFields(TransferFields):
    model: str | None = None
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
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ResponsesRequest(SamplingFields):
    input: str | list[ChatMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)


class Placeholder(_Doc):
    offset: int
    length: int


class GenerateFeatures(_Doc):
    mm_hashes: list[str]
    mm_placeholders: list[Placeholder]


class GenerateSampling(_Doc):
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, description="Must be 1.")
    logprobs: int | None = None


class GenerateRequest(TransferFields):
    request_id: str | None = None
    model: str | None = None
    token_ids: list[int]
    features: GenerateFeatures | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobDoc(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprobDoc]


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None


class TransferOut(_Doc):
    kv_transfer_params: JSONObject | None
    ec_transfer_params: JSONObject | None


class ChatCompletionResponse(TransferOut):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: JSONObject | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None


class CompletionResponse(TransferOut):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class OutputText(_Doc):
    type: Literal["output_text"]
    text: str


class OutputMessage(_Doc):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: str
    content: list[OutputText]


class ResponseObject(TransferOut):
    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "in_progress"]
    output: list[OutputMessage]
    usage: JSONObject | None


class GenerateChoice(_Doc):
    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None


class GenerateResponse(TransferOut):
    request_id: str
    choices: list[GenerateChoice]
    usage: Usage


class Model(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Doc):
    object: Literal["list"]
    data: list[Model]


class ErrorInfo(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    error: ErrorInfo


_REQUESTS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "responses": ResponsesRequest,
    "generate": GenerateRequest,
}
_RESPONSES: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionResponse,
    "completions": CompletionResponse,
    "responses": ResponseObject,
    "generate": GenerateResponse,
    "models": ModelList,
}
_SUMMARIES: dict[str, str] = {
    "chat": "Chat completion (text and images); `stream: true` for SSE chunks",
    "completions": "Text completion of one or more prompts",
    "responses": "Responses API: one assistant message with output_text",
    "generate": "Token ids in, token ids out (disaggregated serving)",
    "models": "The served models",
    "health": "200 while the server accepts requests, 503 while draining",
    "metrics": "Prometheus text exposition",
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "Invalid request; `param` names the field"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Body over the limit"),
        (415, "Content-Type is not JSON"),
        (503, "Overloaded or draining"),
    )
}


def route_docs(kind: str) -> dict[str, Any]:
    """Keyword arguments for ``add_api_route`` that document route ``kind``."""
    docs: dict[str, Any] = {"summary": _SUMMARIES[kind], "response_model": None}
    if kind in _RESPONSES:
        docs["responses"] = {200: {"model": _RESPONSES[kind]}}
    if kind in _REQUESTS:
        name = _REQUESTS[kind].__name__
        schema = {"$ref": f"#/components/schemas/{name}"}
        docs["openapi_extra"] = {
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}
        }
        docs["responses"] = {**docs.get("responses", {}), **_ERRORS}
    return docs


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` include the request schemas referenced by the routes, and
    serve ``/docs`` and ``/redoc`` as :func:`render_page` (``app`` is built with
    ``docs_url=None, redoc_url=None``)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, summary=app.summary, routes=app.routes
        )
        _, defs = models_json_schema(
            [(m, "validation") for m in _REQUESTS.values()],
            ref_template="#/components/schemas/{model}",
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, value in defs.get("$defs", {}).items():
            components.setdefault(name, value)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

    async def docs() -> HTMLResponse:
        return HTMLResponse(render_page(app.openapi()))

    for path in ("/docs", "/redoc"):
        app.add_api_route(path, docs, methods=["GET"], include_in_schema=False)


def _schema_rows(spec: dict[str, Any], schema: dict[str, Any]) -> str:
    """The properties of a request schema as table rows (name, type, description)."""
    ref = schema.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        schema = spec.get("components", {}).get("schemas", {}).get(ref.rsplit("/", 1)[1], {})
    rows = []
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        kinds = [
            p.get("type") or p.get("$ref", "").rsplit("/", 1)[-1] for p in prop.get("anyOf", [prop])
        ]
        kind = " | ".join(k for k in kinds if k) or "any"
        mark = " (required)" if name in required else ""
        rows.append(
            f"<tr><td><code>{html.escape(name)}</code>{mark}</td><td>{html.escape(kind)}</td>"
            f"<td>{html.escape(prop.get('description', ''))}</td></tr>"
        )
    return "".join(rows)


def render_page(spec: dict[str, Any]) -> str:
    """``/docs``: the OpenAPI document as one HTML page, rendered here with no script
    and nothing fetched from another host (the server may have no internet access,
    and a CDN would see every operator who opens it)."""
    info = spec.get("info", {})
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(info.get('title', 'API'))} API</title><style>",
        "body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}",
        "code{background:#f3f3f3;padding:0 .2em}table{border-collapse:collapse;width:100%}",
        "td{border-top:1px solid #ddd;padding:.2em .4em;vertical-align:top}",
        ".m{font-weight:bold;text-transform:uppercase;display:inline-block;width:4.5em}",
        "</style></head><body>",
        f"<h1>{html.escape(info.get('title', 'API'))} {html.escape(info.get('version', ''))}</h1>",
        f"<p>{html.escape(info.get('summary', ''))}</p>",
        "<p>The machine-readable description: <a href='openapi.json'>openapi.json</a>.</p>",
    ]
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            parts.append(
                f"<details><summary><span class='m'>{html.escape(method)}</span> "
                f"<code>{html.escape(path)}</code> {html.escape(op.get('summary', ''))}</summary>"
            )
            if op.get("description"):
                parts.append(f"<p>{html.escape(op['description'])}</p>")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            rows = _schema_rows(spec, body.get("schema", {})) if body else ""
            if rows:
                parts.append(f"<table>{rows}</table>")
            parts.append("</details>")
    parts.append("</body></html>")
    return "".join(parts)
