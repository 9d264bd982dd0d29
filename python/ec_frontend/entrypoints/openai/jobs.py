"""What one HTTP request becomes: :class:`Job` per engine request, :class:`Choice` per output."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Job:
    """One engine request: choice ``index`` of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    request_id: str
    inputs: Any
    params: Any
    prompt_text: str | None = None
    started: bool = False
    #: The request's :class:`~ec_frontend.entrypoints.openai.tool_parsers.ToolPlan`, if any.
    tools: Any = None
    #: The client request this job is a choice of (its ``X-Request-Id`` or generate
    #: ``request_id``): what ``/inference/v1/abort_requests`` names.
    group: str | None = None


@dataclass(slots=True)
class Choice:
    """The accumulated output of one engine request."""

    index: int
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    prompt_text: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    #: The request's :class:`~ec_frontend.entrypoints.openai.tool_parsers.ToolPlan`, if any.
    tools: Any = None

    def add(self, out: Any) -> None:
        """Merge one engine delta; a later ``None`` never erases a param."""
        if out.token_ids:
            self.token_ids += out.token_ids
        if out.text:
            self.text += out.text
        if out.logprobs:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += out.logprobs
        if out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            if out.error:
                self.error = out.error
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.ec_transfer_params is not None:
            self.ec_transfer_params = out.ec_transfer_params


@dataclass(slots=True)
class Timing:
    """Latency bookkeeping of one engine request (for the latency histograms).

    Times are ``time.perf_counter()`` values: ``started`` when the HTTP request
    arrived, ``handed_off`` when the engine got the request, ``first`` and ``last``
    at its first and latest generated token (0.0 before).
    """

    started: float
    handed_off: float = 0.0
    first: float = 0.0
    last: float = 0.0
    generated: int = 0
    prompt_tokens: int = 0
    #: The request's ``max_tokens`` sampling parameter, when set.
    max_tokens: int | None = None
    finished: bool = False


def first_param(choices: list[Choice], name: str) -> dict[str, Any] | None:
    """The first non-``None`` transfer param among ``choices`` (index order)."""
    for c in choices:
        value = getattr(c, name)
        if value is not None:
            return value
    return None


def new_id() -> str:
    return uuid.uuid4().hex


def usage(choices: list[Choice]) -> dict[str, Any]:
    """OpenAI usage: each distinct prompt counted once."""
    seen: dict[int, Choice] = {}
    for c in choices:
        seen.setdefault(c.prompt_index, c)
    prompt = sum(len(c.prompt_token_ids) for c in seen.values())
    cached = sum(c.num_cached_tokens for c in seen.values())
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
