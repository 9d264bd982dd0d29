"""Routes vLLM's API server has beside the OpenAI ones, with vLLM 0.33's shapes.

* ``POST /tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}`` ->
  ``{"count", "max_model_len", "tokens", "token_strs"}``. A chat request is
  rendered exactly as ``/v1/chat/completions`` renders it (template, image
  placeholders, ``tools`` as vLLM renders them), so ``count`` is what the model
  would see.
* ``POST /detokenize``: ``{"tokens": [int]}`` -> ``{"prompt": str}``.
* ``GET /version``: ``{"version": str}`` (ec-frontend's own version).
* ``GET|POST /ping``: 200 with an empty body while the engine runs (as ``/health``).
* ``POST /inference/v1/abort_requests``: ``{"request_ids": str | [str]}`` -> 200
  with an empty body. An id is a request's ``X-Request-Id`` (or a generate
  request's ``request_id``); the engine requests of all its choices end with
  ``finish_reason: "abort"``. Unknown ids are ignored, as in vLLM.

Errors are OpenAI-style bodies (``docs/compatibility.md`` lists where vLLM
answers differently).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from ec_frontend import __version__
from ec_frontend._core import parse_request
from ec_frontend.entrypoints.errors import APIError
from ec_frontend.entrypoints.sampling import encode_text
from ec_frontend.entrypoints.serving import continuation
from ec_frontend.entrypoints.tool_parsers import plan_from

if TYPE_CHECKING:
    from ec_frontend.entrypoints.server import App

#: vLLM's bound on a token id in ``/detokenize`` (an int64).
_MAX_TOKEN_ID = 2**63 - 1
#: What follows a request id in the ids of its engine requests: the choice index
#: (``-3``) and, after a collision, a random suffix (``-1a2b3c4d``).
_CHILD_SUFFIX = re.compile(r"(-(\d+|[0-9a-f]{8}))+")
#: Chat fields of ``/tokenize`` that go to the chat parser as they are.
_CHAT_FIELDS = ("messages", "add_generation_prompt", "chat_template_kwargs",
                "mm_processor_kwargs", "continue_final_message", "tools")  # fmt: skip


def _bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"invalid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    return data


def _flag(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean", name, "invalid_type")
    return value


def _refuse_if_set(data: dict[str, Any], name: str, why: str) -> None:
    value = data.get(name)
    if value is not None and value is not False and value != [] and value != {}:
        raise _bad(f"{name} is not supported by this server: {why}", name)


def _token_ids(value: Any, param: str, vocab_size: int | None) -> list[int]:
    if not isinstance(value, list):
        raise _bad(f"{param} must be a list of token ids", param, "invalid_type")
    bound = vocab_size if vocab_size is not None else _MAX_TOKEN_ID + 1
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise _bad(f"{param}[{i}] must be an integer", f"{param}[{i}]", "invalid_type")
        if not 0 <= t < bound:
            raise _bad(
                f"token id {t} is outside the vocabulary (0 to {bound - 1})", f"{param}[{i}]"
            )
    return value


def _token_strs(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        return [str(t) for t in convert(list(ids))]
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def _requested(engine_id: str, wanted: set[str]) -> bool:
    """Whether ``engine_id`` is one of ``wanted`` or an engine request of one of them."""
    if engine_id in wanted:
        return True
    return any(
        engine_id.startswith(w + "-") and _CHILD_SUFFIX.fullmatch(engine_id, len(w)) is not None
        for w in wanted
    )


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


class VLLMRoutes:
    """The handlers, bound to the server's :class:`~ec_frontend.entrypoints.server.App`."""

    def __init__(self, app: App) -> None:
        self.app = app

    def _check_model(self, model: Any) -> None:
        """404 for a model this server does not serve.

        The model's identity (the ``root`` of ``/v1/models``) is accepted beside the
        served names: vLLM's benchmark client names the model by ``root`` here.
        """
        if model is not None and not isinstance(model, str):
            raise _bad("model must be a string", "model", "invalid_type")
        if model is None or model != self.app.config.model_id:
            self.app.serving.check_model(model)

    def _tokenizer(self) -> Any:
        tokenizer = self.app.tokenizer
        if tokenizer is None:
            raise APIError(501, "this server has no tokenizer", code="not_implemented")
        return tokenizer

    async def _chat_ids(self, data: dict[str, Any]) -> list[int]:
        if _flag(data, "add_special_tokens", False):
            raise _bad(
                "add_special_tokens is not supported for chat messages: the chat "
                "template places the special tokens",
                "add_special_tokens",
            )
        _refuse_if_set(data, "chat_template", "the model's own chat template is used")
        _refuse_if_set(data, "media_io_kwargs", "media loading takes no options")
        app = self.app
        self._check_model(data.get("model"))
        chat = {k: data[k] for k in _CHAT_FIELDS if k in data}
        parsed = parse_request(
            "chat", orjson.dumps(chat), model_id=app.config.model_id, limits=app.limits
        )
        app.serving.check_input_limits(parsed)
        # URL items are fetched as chat fetches them, so the count is what chat feeds.
        media = await app.serving.resolve_media(parsed)
        processor = app.engine.processor
        # Tools are rendered by the chat template as a chat request renders them.
        plan = plan_from(parsed.structured)
        tools = {"tools": plan.template_tools()} if plan is not None else {}
        try:
            inputs = await app.serving.run_processing(
                processor.process_chat,
                parsed.messages,
                media,
                add_generation_prompt=parsed.add_generation_prompt,
                chat_template_kwargs=parsed.chat_template_kwargs,
                mm_processor_kwargs=parsed.mm_processor_kwargs,
                **tools,
                **continuation(parsed),
            )
        except (ValueError, OSError, IndexError) as exc:
            code = getattr(exc, "code", None)
            raise _bad(
                f"could not process the messages: {exc}",
                "messages",
                code if isinstance(code, str) else "invalid_input",
            ) from exc
        return list(inputs.prompt_token_ids)

    def _prompt_ids(self, data: dict[str, Any]) -> list[int]:
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise _bad("prompt must be a string", "prompt", "invalid_type")
        self._check_model(data.get("model"))
        self.app.serving.check_text_chars(len(prompt), "prompt")
        add_special = _flag(data, "add_special_tokens", True)
        return encode_text(self._tokenizer(), prompt, add_special)

    async def tokenize(self, request: Request) -> Response:
        data = _json_object(await self.app.read_body(request))
        return_strs = _flag(data, "return_token_strs", False)
        if "messages" in data:
            ids = await self._chat_ids(data)
        elif "prompt" in data:
            ids = self._prompt_ids(data)
        else:
            raise _bad("either prompt or messages is required", "prompt", "missing_field")
        return _json(
            {
                "count": len(ids),
                "max_model_len": self.app.config.max_model_len,
                "tokens": ids,
                "token_strs": _token_strs(self._tokenizer(), ids) if return_strs else None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        data = _json_object(await self.app.read_body(request))
        self._check_model(data.get("model"))
        if "tokens" not in data:
            raise _bad("tokens is required", "tokens", "missing_field")
        ids = _token_ids(data["tokens"], "tokens", self.app.config.vocab_size)
        try:
            text = self._tokenizer().decode(ids, skip_special_tokens=False)
        except (ValueError, OverflowError, TypeError) as exc:
            raise _bad(f"cannot decode these tokens: {exc}", "tokens") from exc
        return _json({"prompt": text})

    async def version(self, request: Request) -> Response:
        return _json({"version": __version__})

    async def ping(self, request: Request) -> Response:
        await self.app.health(request)
        return Response(status_code=200)

    async def abort_requests(self, request: Request) -> Response:
        data = _json_object(await self.app.read_body(request))
        ids = data.get("request_ids")
        if ids is None:
            raise _bad("request_ids is required", "request_ids", "missing_field")
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise _bad(
                "request_ids must be a string or a list of strings", "request_ids", "invalid_type"
            )
        wanted = set(ids)
        for rid in self.app.serving.active_ids():
            if _requested(rid, wanted):
                await self.app.engine.abort(rid)
        return Response(status_code=200)


def register(api: FastAPI, app: App) -> VLLMRoutes:
    """Add the routes to ``api``; handlers read the server state from ``app``."""
    routes = VLLMRoutes(app)
    api.add_api_route(
        "/tokenize", routes.tokenize, methods=["POST"], summary="Tokenize a prompt or messages"
    )
    api.add_api_route(
        "/detokenize", routes.detokenize, methods=["POST"], summary="Token ids to text"
    )
    api.add_api_route("/version", routes.version, methods=["GET"], summary="Server version")
    for method in ("GET", "POST"):
        api.add_api_route(
            "/ping",
            routes.ping,
            methods=[method],
            summary="Liveness (as /health)",
            operation_id=f"ping_{method.lower()}",
        )
    api.add_api_route(
        "/inference/v1/abort_requests",
        routes.abort_requests,
        methods=["POST"],
        summary="Abort requests by id",
    )
    return routes
