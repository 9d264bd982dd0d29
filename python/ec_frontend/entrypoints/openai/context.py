"""Per-request state shared by the endpoint formatters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class RequestContext:
    """Who asked, for which model, since when.

    ``request_id`` is the ``X-Request-Id`` the client sent (or a fresh one); it is
    echoed in the response header and is the base of the engine request ids.
    """

    request_id: str
    model: str
    started: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    tokenizer: Any = None


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_event(event: str, obj: Any) -> bytes:
    """A named server-sent event (Responses API style)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token, for logprobs."""
    if tokenizer is None:
        return ""
    return tokenizer.decode([token_id])
