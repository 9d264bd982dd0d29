"""A streamed response closes the stream of engine deltas beneath it as soon as it
ends, whichever way: its reader closing it at a ``yield`` (a client gone while its
response was being written), or its own early end (a choice's error while other
choices still run). Closing that stream is what aborts the engine requests; left to
the garbage collector, an abandoned request keeps generating for as long as some
reference cycle keeps its stream alive.

Each test holds a reference to the delta stream itself, as such a cycle would: only
an explicit close ends it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from ec_frontend._core import parse_request
from ec_frontend.entrypoints.openai.chat_format import chat_stream, completion_stream
from ec_frontend.entrypoints.openai.context import RequestContext
from ec_frontend.entrypoints.openai.generate_api import generate_stream
from ec_frontend.entrypoints.openai.jobs import Choice, Job
from ec_frontend.entrypoints.openai.responses_api import response_stream
from ec_frontend.entrypoints.openai.server import _guarded
from ec_frontend.entrypoints.openai.serving import DeltaStream, _Ready

#: A streamed request of each API, as the parser gives it.
_BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    "completions": {"model": "m", "prompt": "hi", "stream": True},
    "generate": {"token_ids": [1, 2, 3], "sampling_params": {}, "stream": True},
    "responses": {"model": "m", "input": "hi", "stream": True},
}


class _Deltas:
    """What ``Serving.stream`` gives the formatters: the pairs of ``outputs`` (one
    per choice each), then a wait that only a close ends. ``closed`` records it."""

    def __init__(self, jobs: list[Job], outputs: list[tuple[int, Any]]) -> None:
        self.jobs = jobs
        self.outputs = outputs
        self.closed = False
        self.given = 0
        self.stream: DeltaStream | None = None

    def stream_fn(self, jobs: list[Job], started: float, interval: int = 1) -> DeltaStream:
        choices = {j.index: Choice(j.index, j.prompt_index, j.request_id, [1, 2, 3]) for j in jobs}

        async def pairs() -> AsyncGenerator[tuple[Choice, Any], None]:
            try:
                for index, out in self.outputs:
                    choice = choices[index]
                    if getattr(out, "error", None) is not None:
                        choice.error = out.error
                    else:
                        choice.add(out)
                    self.given += 1
                    yield choice, out
                await asyncio.Event().wait()
            finally:
                self.closed = True

        self.stream = DeltaStream(pairs(), _Ready())
        return self.stream


def _job(index: int) -> Job:
    return Job(index, 0, f"r-{index}", SimpleNamespace(prompt_token_ids=[1, 2, 3]), None)


def _delta(text: str) -> Any:
    return SimpleNamespace(
        token_ids=[7], text=text, logprobs=None, finished=False, finish_reason=None,
        stop_reason=None, num_cached_tokens=0, kv_transfer_params=None,
        ec_transfer_params=None, error=None,
    )  # fmt: skip


_FORMATTERS: dict[str, Callable[..., AsyncGenerator[bytes, None]]] = {
    "chat": lambda s, c, p, j: chat_stream(s, c, p, j, "chatcmpl-1"),
    "completions": lambda s, c, p, j: completion_stream(s, c, p, j, "cmpl-1"),
    "generate": lambda s, c, p, j: generate_stream(s, c, p, j, "gen-1"),
    "responses": lambda s, c, p, j: response_stream(s, c, p, j, "resp_1"),
}


def _setup(name: str, jobs: list[Job], outputs: list[tuple[int, Any]]) -> tuple[_Deltas, Any]:
    deltas = _Deltas(jobs, outputs)
    serving = SimpleNamespace(stream=deltas.stream_fn)
    ctx = RequestContext("req-1", "m")
    parsed = parse_request(name, orjson.dumps(_BODIES[name]), model_id="m")
    return deltas, _guarded(_FORMATTERS[name](serving, ctx, parsed, jobs))


@pytest.mark.parametrize("name", list(_FORMATTERS))
def test_closing_the_body_at_a_yield_closes_the_deltas_beneath(name: str) -> None:
    async def main() -> _Deltas:
        deltas, body = _setup(name, [_job(0)], [(0, _delta("a")), (0, _delta("b"))])
        async for _ in body:
            if deltas.given == 2:
                break
        assert deltas.stream is not None and not deltas.closed
        await body.aclose()
        return deltas.closed

    # Read inside the loop: ``asyncio.run`` closes every generator left open at its end.
    assert asyncio.run(main())


@pytest.mark.parametrize("name", ["chat", "completions"])
def test_an_error_in_one_choice_closes_the_others(name: str) -> None:
    async def main() -> tuple[bool, list[bytes]]:
        error = SimpleNamespace(**{**vars(_delta("")), "error": "engine step failed: boom"})
        deltas, body = _setup(name, [_job(0), _job(1)], [(1, _delta("x")), (0, error)])
        chunks = [chunk async for chunk in body]
        return deltas.closed, chunks

    closed, chunks = asyncio.run(main())
    assert chunks[-1].endswith(b"data: [DONE]\n\n")
    assert b"engine step failed: boom" in b"".join(chunks)
    assert closed
