"""HTTP errors in OpenAI's shape, raised anywhere and rendered by one handler.

Every error a client can cause is an :class:`APIError` (or the parser's
``RequestError``, mapped to 400 here). The server installs
:func:`error_response` as its only exception handler, so a body always has the
shape ``{"error": {"message", "type", "param", "code"}}`` and nothing a client
sends turns into a 500.
"""

from __future__ import annotations

import orjson
from starlette.responses import Response

from ec_frontend._core import RequestError
from ec_frontend.errors import GRAMMAR_FAILURE_PREFIX

_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "invalid_request_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with an HTTP status, rendered as an OpenAI error body.

    ``param`` names the offending request field (a path such as
    ``messages[0].content``) or is ``None``; ``code`` is a short
    machine-readable reason.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None, code: str | None) -> bytes:
    """The serialized OpenAI error object for ``status``."""
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "invalid_request_error"),
                "param": param,
                "code": code,
            }
        }
    )


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the :class:`APIError` a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    return APIError(500, "internal server error", code="internal_error")


def error_response(exc: BaseException) -> Response:
    """Render ``exc`` as a JSON error response."""
    err = to_api_error(exc)
    return Response(
        error_body(err.status, err.message, err.param, err.code),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers,
    )


#: Engine failures of one request that its own input caused (answered 400, not 500).
_INPUT_FAILURES: tuple[str, ...] = ("media item ", "prompt token id ", "the prompt ")


#: A KV pull that failed; the connector says whether a transfer secret vouched for the params.
_KV_PULL_FAILURE = "KV transfer from the prefill instance "

#: A media item the request carries no image for (a metadata-only reference) whose
#: encoder output cannot be had: the connector's load failed (an upstream failure,
#: 502), or no connector holds it (400). Either way a proxy that made the reference
#: can send the image itself instead (``ec_item_unavailable``).
_EC_LOAD_FAILURE = "EC transfer of media item "
_EC_UNAVAILABLE = "media reference "


def engine_failure(message: str) -> APIError:
    """The HTTP error for an engine request that failed alone with ``message``."""
    if message.startswith(_EC_LOAD_FAILURE):
        return APIError(502, message, code="ec_item_unavailable")
    if message.startswith(_EC_UNAVAILABLE):
        return APIError(400, message, code="ec_item_unavailable")
    if message.startswith(GRAMMAR_FAILURE_PREFIX):
        return APIError(400, message, code="grammar_error")
    if message.startswith(_INPUT_FAILURES):
        return APIError(400, f"the engine cannot serve this input: {message}", code="invalid_input")
    if message.startswith(_KV_PULL_FAILURE):
        if "(signed kv_transfer_params)" in message:
            return APIError(502, message, code="kv_transfer_failed")
        return APIError(400, message, code="kv_transfer_failed", param="kv_transfer_params")
    return APIError(500, f"engine error: {message}", code="engine_error")
