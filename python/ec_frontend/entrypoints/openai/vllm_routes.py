"""Routes vLLM's API server has beside the OpenAI ones, with vLLM 0.33's shapes.

* ``POST /tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}`` ->
  ``{"count", "max_model_len", "tokens", "token_strs"}``. A chat request is
  rendered exactly as ``/v1/chat/completions`` renders it (template, image and
  video placeholders, videos sampled by ``media_io_kwargs``, ``tools`` as vLLM
  renders them), so ``count`` is what the model would see.
* ``POST /detokenize``: ``{"tokens": [int]}`` -> ``{"prompt": str}``; at most
  ``--max-prompt-chars`` ids (as many as ``/tokenize`` can give), else 400
  ``too_many_tokens`` (a body too large to hold that many is refused unparsed).
* ``GET /version``: ``{"version": str}`` (ec-frontend's own version).
* ``GET|POST /ping``: 200 with an empty body while the engine runs (as ``/health``).
* ``POST /inference/v1/abort_requests``: ``{"request_ids": str | [str]}`` -> 200
  with an empty body. An id is a request's ``X-Request-Id`` (or a generate
  request's ``request_id``), matched exactly; the engine requests of all its
  choices end with ``finish_reason: "abort"``, on whichever API server of a
  ``--api-server-count`` group runs them (the engine applies the abort). Unknown
  ids are ignored, as in vLLM; at most ``MAX_ABORT_IDS`` ids per call, each
  following the ``X-Request-Id`` rule (400 otherwise).

The tokenizer work of ``/tokenize`` and ``/detokenize`` (and the parsing of
their larger bodies) runs on the server's bounded processing pool
(:meth:`~ec_frontend.entrypoints.openai.serving.Serving.offload`; 429 when it is
full), never on the event loop, so ``/health`` and the streams of other clients
keep answering while it runs.

Errors are OpenAI-style bodies (``docs/compatibility.md`` lists where vLLM
answers differently).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from ec_frontend import __version__
from ec_frontend._core import parse_request
from ec_frontend.entrypoints.http.errors import APIError
from ec_frontend.entrypoints.http.middleware import MAX_REQUEST_ID_CHARS, valid_request_id
from ec_frontend.entrypoints.openai.sampling import encode_text
from ec_frontend.entrypoints.openai.serving import continuation
from ec_frontend.entrypoints.openai.tool_parsers import plan_from

if TYPE_CHECKING:
    from ec_frontend.entrypoints.openai.server import App

#: Bodies above this size are parsed on the processing pool, off the event loop.
_INLINE_JSON_BYTES = 64 * 1024
#: Bytes one id may take in a ``/detokenize`` body (digits, a comma, a space) ...
_DETOKENIZE_BYTES_PER_ID = 16
#: ... and what the rest of the body may take.
_DETOKENIZE_SLACK_BYTES = 64 * 1024
#: vLLM's bound on a token id in ``/detokenize`` (an int64).
_MAX_TOKEN_ID = 2**63 - 1
#: Ids one ``/inference/v1/abort_requests`` call may name.
MAX_ABORT_IDS = 1024
#: JSON values a utility route's body may hold beyond its own payload.
_SLACK_VALUES = 65536
#: Chat fields of ``/tokenize`` that go to the chat parser as they are.
_CHAT_FIELDS = ("messages", "add_generation_prompt", "chat_template_kwargs",
                "mm_processor_kwargs", "media_io_kwargs", "continue_final_message",
                "tools")  # fmt: skip


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


def _bounded_json_object(body: bytes, max_values: int) -> dict[str, Any]:
    """:func:`_json_object`, refusing first (400 ``too_many_values``) a body with more
    than ``max_values`` commas: a JSON parser holds the interpreter while it builds a
    value, and millions of small values (``[1,1,1,...]`` in a field the route ignores)
    would hold it, and the event loop with it, for seconds. Counting commas is a
    memory scan; a route's legitimate values are bounded (text by
    ``--max-prompt-chars``; base64 image data has no commas)."""
    commas = body.count(b",")
    if commas > max_values:
        raise _bad(
            f"the request body holds {commas} JSON values or more; this route takes at "
            f"most {max_values}",
            None,
            "too_many_values",
        )
    return _json_object(body)


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


def _json_bytes(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def _too_many_ids(limit: int, count: int | None) -> APIError:
    """400 for a ``/detokenize`` over ``limit`` ids (``count`` ``None``: the body is too
    large to hold at most ``limit``, and was not parsed)."""
    has = f"has {count} token ids" if count is not None else "body is too large for that many"
    return _bad(
        f"/detokenize takes at most {limit} token ids (--max-prompt-chars); the request {has}",
        "tokens",
        "too_many_tokens",
    )


class VLLMRoutes:
    """The handlers, bound to the server's :class:`~ec_frontend.entrypoints.openai.server.App`."""

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

    async def _load(self, body: bytes, max_values: int) -> dict[str, Any]:
        """The body's JSON object; a large body is parsed off the event loop, and only
        when it holds at most about ``max_values`` values (:func:`_bounded_json_object`)."""
        if len(body) > _INLINE_JSON_BYTES:
            return await self.app.serving.offload(_bounded_json_object, body, max_values)
        return _json_object(body)

    def _tokenize_values(self) -> int:
        """JSON values a ``/tokenize`` body may hold: its text (at most
        ``--max-prompt-chars``, one value per character at worst) and the structure
        around it (messages, parts, images, tools)."""
        app = self.app
        return app.serving.config.limits.prompt_chars(app.config.max_model_len) + _SLACK_VALUES

    def _parse_chat(self, data: dict[str, Any]) -> Any:
        """The chat part of a ``/tokenize`` body, parsed and checked (a worker thread)."""
        if _flag(data, "add_special_tokens", False):
            raise _bad(
                "add_special_tokens is not supported for chat messages: the chat "
                "template places the special tokens",
                "add_special_tokens",
            )
        _refuse_if_set(data, "chat_template", "the model's own chat template is used")
        app = self.app
        self._check_model(data.get("model"))
        chat = {k: data[k] for k in _CHAT_FIELDS if k in data}
        parsed = parse_request(
            "chat", orjson.dumps(chat), model_id=app.config.model_id, limits=app.limits
        )
        app.serving.check_input_limits(parsed)
        return parsed

    async def _chat_ids(self, data: dict[str, Any]) -> list[int]:
        serving = self.app.serving
        parsed = await serving.offload(self._parse_chat, data)
        # URL items are fetched as chat fetches them, so the count is what chat feeds.
        media = await serving.resolve_media(parsed)
        processor = self.app.engine.processor
        # Tools are rendered by the chat template as a chat request renders them.
        plan = plan_from(parsed.structured)
        tools = {"tools": plan.template_tools()} if plan is not None else {}
        try:
            inputs = await serving.offload(
                processor.process_chat,
                parsed.messages,
                media,
                add_generation_prompt=parsed.add_generation_prompt,
                chat_template_kwargs=parsed.chat_template_kwargs,
                mm_processor_kwargs=parsed.mm_processor_kwargs,
                media_io_kwargs=parsed.media_io_kwargs,
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
        """A worker thread: the tokenizer runs over up to ``--max-prompt-chars``."""
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise _bad("prompt must be a string", "prompt", "invalid_type")
        self._check_model(data.get("model"))
        self.app.serving.check_text_chars(len(prompt), "prompt")
        add_special = _flag(data, "add_special_tokens", True)
        return encode_text(self._tokenizer(), prompt, add_special)

    def _tokenize_body(self, ids: list[int], return_strs: bool) -> bytes:
        """The response (a worker thread: its size is the client's choice)."""
        strs = _token_strs(self._tokenizer(), ids) if return_strs else None
        return orjson.dumps(
            {
                "count": len(ids),
                "max_model_len": self.app.config.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def tokenize(self, request: Request) -> Response:
        data = await self._load(await self.app.read_body(request), self._tokenize_values())
        return_strs = _flag(data, "return_token_strs", False)
        serving = self.app.serving
        if "messages" in data:
            ids = await self._chat_ids(data)
        elif "prompt" in data:
            ids = await serving.offload(self._prompt_ids, data)
        else:
            raise _bad("either prompt or messages is required", "prompt", "missing_field")
        return _json_bytes(await serving.offload(self._tokenize_body, ids, return_strs))

    def max_detokenize_ids(self) -> int:
        """The most ids one ``/detokenize`` takes: as many as ``/tokenize`` can give,
        ``--max-prompt-chars`` (16 x ``--max-model-len`` by default)."""
        app = self.app
        return app.serving.config.limits.prompt_chars(app.config.max_model_len)

    def _detokenize(self, body: bytes, limit: int) -> bytes:
        """Parse, check and decode (a worker thread); the response body."""
        data = _json_object(body)
        self._check_model(data.get("model"))
        if "tokens" not in data:
            raise _bad("tokens is required", "tokens", "missing_field")
        tokens = data["tokens"]
        if isinstance(tokens, list) and len(tokens) > limit:
            raise _too_many_ids(limit, len(tokens))
        ids = _token_ids(tokens, "tokens", self.app.config.vocab_size)
        try:
            text = self._tokenizer().decode(ids, skip_special_tokens=False)
        except (ValueError, OverflowError, TypeError) as exc:
            raise _bad(f"cannot decode these tokens: {exc}", "tokens") from exc
        return orjson.dumps({"prompt": text})

    async def detokenize(self, request: Request) -> Response:
        body = await self.app.read_body(request)
        limit = self.max_detokenize_ids()
        # A body that cannot hold at most ``limit`` ids is refused unparsed: parsing a
        # JSON list of millions of numbers holds the interpreter for seconds.
        if len(body) > _DETOKENIZE_BYTES_PER_ID * limit + _DETOKENIZE_SLACK_BYTES:
            raise _too_many_ids(limit, None)
        return _json_bytes(await self.app.serving.offload(self._detokenize, body, limit))

    async def version(self, request: Request) -> Response:
        return _json_bytes(orjson.dumps({"version": __version__}))

    async def ping(self, request: Request) -> Response:
        await self.app.health(request)
        return Response(status_code=200)

    async def abort_requests(self, request: Request) -> Response:
        body = await self.app.read_body(request)
        data = await self._load(body, MAX_ABORT_IDS * (MAX_REQUEST_ID_CHARS + 1) + _SLACK_VALUES)
        ids = data.get("request_ids")
        if ids is None:
            raise _bad("request_ids is required", "request_ids", "missing_field")
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise _bad(
                "request_ids must be a string or a list of strings", "request_ids", "invalid_type"
            )
        if len(ids) > MAX_ABORT_IDS:
            raise _bad(
                f"request_ids has {len(ids)} ids; at most {MAX_ABORT_IDS} are allowed per call",
                "request_ids",
                "too_many_ids",
            )
        for i, rid in enumerate(ids):
            if not valid_request_id(rid):
                raise _bad(
                    "a request id is 1 to 256 visible ASCII characters (the X-Request-Id rule)",
                    f"request_ids[{i}]",
                )
        await self.app.serving.abort_requests(list(dict.fromkeys(ids)))
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
