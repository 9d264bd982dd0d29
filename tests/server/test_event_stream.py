"""EventStream, the SSE response: body messages in order, the end, the background
task, and a client disconnect that closes the stream instead of failing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from ec_frontend.entrypoints.openai.server import EventStream
from starlette.background import BackgroundTask


class _Client:
    """The ASGI side of one connection: ``receive`` answers ``http.disconnect``
    once :meth:`leave` is called; ``send`` records every message."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self.gone.set()


def _run(*, cancel: bool) -> dict[str, Any]:
    state: dict[str, Any] = {"closed": False, "released": False}

    async def chunks() -> AsyncGenerator[bytes, None]:
        try:
            for i in range(3):
                yield b"data: %d\n\n" % i
            await asyncio.Event().wait()  # a stream that would never end by itself
            yield b"never"
        finally:
            state["closed"] = True

    async def release() -> None:
        state["released"] = True

    async def main() -> None:
        client = _Client()
        state["client"] = client
        response = EventStream(chunks(), BackgroundTask(release))
        task = asyncio.ensure_future(response({"type": "http"}, client.receive, client.send))
        while len(client.sent) < 1 + 3:
            await asyncio.sleep(0)
        if cancel:
            task.cancel()
        else:
            client.leave()
        try:
            await task
            state["outcome"] = "returned"
        except asyncio.CancelledError:
            state["outcome"] = "cancelled"

    asyncio.run(main())
    return state


@pytest.mark.parametrize(
    ("cancel", "outcome"),
    [(False, "returned"), (True, "cancelled")],
    ids=["client disconnect: the response returns", "server cancel: propagates"],
)
def test_the_stream_is_closed_and_the_background_runs(cancel: bool, outcome: str) -> None:
    state = _run(cancel=cancel)
    sent = state["client"].sent
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert all(m["more_body"] for m in sent[1:])
    assert (state["closed"], state["released"], state["outcome"]) == (True, True, outcome)


@pytest.mark.parametrize(
    ("chunks", "bodies"),
    [
        (
            [b"data: a\n\n", b"data: [DONE]\n\n"],
            [(b"data: a\n\n", True), (b"data: [DONE]\n\n", False)],
        ),
        ([b"data: a\n\n"], [(b"data: a\n\n", True), (b"", False)]),
    ],
    ids=["[DONE] ends the body in its own message", "else an empty end"],
)
def test_the_end_of_the_body(chunks: list[bytes], bodies: list[tuple[bytes, bool]]) -> None:
    released: list[bool] = []

    async def gen() -> AsyncGenerator[bytes, None]:
        for chunk in chunks:
            yield chunk

    async def release() -> None:
        released.append(True)

    async def main() -> list[dict[str, Any]]:
        client = _Client()
        await EventStream(gen(), BackgroundTask(release))(
            {"type": "http"}, client.receive, client.send
        )
        return client.sent

    sent = asyncio.run(main())
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == bodies
    assert released == [True]
