"""Bad input over HTTP: every case gets a 4xx OpenAI error body, and the server lives on.

The parser's bad-input corpus (``tests/core/bad_inputs.py``) is posted to the
endpoint it targets; HTTP-level cases (content type, size, model, key, method,
route) are listed here. After each batch ``/health`` is 200 and a normal request
succeeds.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from typing import Any

import ec_frontend as ecf
import httpx
import openai
import orjson
import pytest

from .conftest import API_KEY, MAX_BODY, MOCK_MODEL, ServerProcess

pytestmark = pytest.mark.slow

GOOD_CHAT = orjson.dumps(
    {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
)
AUTH = {"authorization": f"Bearer {API_KEY}"}
JSON = {"content-type": "application/json"}
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "generate": "/inference/v1/generate",
}


def _load_corpus() -> list[tuple[str, str, bytes]]:
    """``(id, endpoint, body)`` from the parser's corpus."""
    path = Path(__file__).parents[1] / "core" / "bad_inputs.py"
    spec = importlib.util.spec_from_file_location("ec_bad_inputs", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return [(c.id, c.endpoint, c.body) for c in module.BAD_INPUTS]


CORPUS = _load_corpus()


def assert_error_body(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def assert_alive(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.url + "/v1/chat/completions", content=GOOD_CHAT, headers={**AUTH, **JSON})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("case_id", "endpoint", "body"), CORPUS, ids=[c[0] for c in CORPUS])
def test_parser_corpus_over_http(
    mock_server: ServerProcess, case_id: str, endpoint: str, body: bytes
) -> None:
    """Each malformed body is a 400 carrying the parser's code and parameter path.

    The expected values are what ``parse_request`` raises in this process (the
    corpus's own expectations are the parser suite's business).
    """
    with pytest.raises(ecf.RequestError) as expected:
        ecf.parse_request(endpoint, body, limits=ecf.Limits(max_body_bytes=MAX_BODY))
    with httpx.Client(base_url=mock_server.url, headers={**AUTH, **JSON}, timeout=30) as c:
        r = c.post(PATHS[endpoint], content=body)
    err = assert_error_body(r, 400)
    assert (err["code"], err["param"]) == (expected.value.code, expected.value.param)
    assert err["message"] == expected.value.message


def test_alive_after_corpus(mock_server: ServerProcess) -> None:
    assert_alive(mock_server)


CASES: list[tuple[str, str, str, dict[str, str], bytes, int, str | None]] = [
    # id, method, path, headers, body, status, param
    (
        "text-plain",
        "POST",
        "/v1/chat/completions",
        {**AUTH, "content-type": "text/plain"},
        GOOD_CHAT,
        415,
        None,
    ),
    (
        "form",
        "POST",
        "/v1/completions",
        {**AUTH, "content-type": "application/x-www-form-urlencoded"},
        b"a=b",
        415,
        None,
    ),
    (
        "oversize-content-length",
        "POST",
        "/v1/chat/completions",
        {**AUTH, **JSON},
        b"{" + b" " * (MAX_BODY + 10) + b"}",
        413,
        None,
    ),
    (
        "unknown-model",
        "POST",
        "/v1/chat/completions",
        {**AUTH, **JSON},
        orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
        404,
        "model",
    ),
    ("no-key", "POST", "/v1/chat/completions", JSON, GOOD_CHAT, 401, None),
    (
        "wrong-key",
        "POST",
        "/v1/chat/completions",
        {"authorization": "Bearer nope", **JSON},
        GOOD_CHAT,
        401,
        None,
    ),
    ("key-on-models", "GET", "/v1/models", {}, b"", 401, None),
    ("get-on-post", "GET", "/v1/chat/completions", AUTH, b"", 405, None),
    ("put-on-post", "PUT", "/v1/completions", AUTH, b"", 405, None),
    ("unknown-route", "POST", "/v1/nothing", {**AUTH, **JSON}, b"{}", 404, None),
    ("invalid-json", "POST", "/v1/chat/completions", {**AUTH, **JSON}, b"{nope", 400, None),
    ("empty-body", "POST", "/v1/completions", {**AUTH, **JSON}, b"", 400, None),
    (
        "max-tokens-past-context",
        "POST",
        "/v1/completions",
        {**AUTH, **JSON},
        orjson.dumps({"model": MOCK_MODEL, "prompt": "x", "max_tokens": 10_000}),
        400,
        "max_tokens",
    ),
    (
        "remote-image-url",
        "POST",
        "/v1/chat/completions",
        {**AUTH, **JSON},
        orjson.dumps(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "http://media.invalid/a.png"},
                            }
                        ],
                    }
                ]
            }
        ),
        400,
        "messages[0].content[0].image_url",
    ),
]


@pytest.mark.parametrize(
    ("case_id", "method", "path", "headers", "body", "status", "param"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_http_errors(
    mock_server: ServerProcess,
    case_id: str,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
    status: int,
    param: str | None,
) -> None:
    r = httpx.request(method, mock_server.url + path, content=body, headers=headers, timeout=30)
    err = assert_error_body(r, status)
    if param is not None:
        assert err["param"] == param
    assert_alive(mock_server)


def test_oversize_streamed_body_without_length(mock_server: ServerProcess) -> None:
    """A chunked body is cut off at the limit while it streams in (no Content-Length)."""

    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"model": "mock-model", "prompt": "'
        for _ in range(MAX_BODY // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(mock_server.url + "/v1/completions", content=chunks(), headers={**AUTH, **JSON})
    assert "content-length" not in r.request.headers
    assert_error_body(r, 413)
    assert_alive(mock_server)


def test_truncated_request_on_raw_socket(mock_server: ServerProcess) -> None:
    """A client that sends half a body and hangs up does not hurt the server."""
    with socket.create_connection(("127.0.0.1", mock_server.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b'\r\nContent-Length: 500\r\n\r\n{"mo'
        )
    assert_alive(mock_server)


def test_openai_client_sees_typed_errors(mock_server: ServerProcess) -> None:
    url = mock_server.url + "/v1"
    with (
        openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0) as client,
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad_key,
    ):
        _typed_errors(client, bad_key)
    assert_alive(mock_server)


def _typed_errors(client: openai.OpenAI, bad_key: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MOCK_MODEL, messages=[{"role": "user", "content": "x"}], temperature=5
        )
    assert bad.value.body is not None
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
