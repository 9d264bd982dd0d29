"""AsyncEngine: streams of deltas from the background core thread, abort, stats, shutdown."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.noop import NoOpECConnector
from ec_frontend.engine.async_engine import AsyncEngine, EngineDeadError
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.outputs import RequestOutput
from ec_frontend.engine.request import Request

pytestmark = pytest.mark.slow


async def collect(stream: Any) -> tuple[RequestOutput, int]:
    acc: RequestOutput | None = None
    deltas = 0
    async for out in stream:
        deltas += 1
        if acc is None:
            acc = out
        else:
            acc.add(out)
    assert acc is not None
    return acc, deltas


def test_concurrent_streams_abort_and_stats(
    make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    core, model = make_engine()
    engine = AsyncEngine(core, processor)

    async def main() -> dict[str, Any]:
        streams = {
            f"r{i}": engine.add_request(f"r{i}", h.chat_inputs(processor, f"hi {i}", []), greedy(8))
            for i in range(3)
        }
        with pytest.raises(ValueError, match="already in flight"):
            engine.add_request("r0", h.chat_inputs(processor, "dup", []), greedy())
        long = engine.add_request(
            "long", h.chat_inputs(processor, "long", []), greedy(10_000 // 32)
        )
        first = await long.__anext__()
        await engine.abort("long")
        aborted, _ = await collect(long)
        done = await asyncio.gather(*(collect(s) for s in streams.values()))
        return {"aborted": aborted, "first": first, **dict(zip(streams, done, strict=True))}

    try:
        results = asyncio.run(main())
        for i in range(3):
            out, deltas = results[f"r{i}"]
            assert out.finished and out.finish_reason == "length"
            assert len(out.token_ids) == 8 and deltas == 8
            assert out.prompt_token_ids
        assert results["aborted"].finish_reason == "abort"
        stats = engine.stats()
        assert stats.generation_tokens_total >= 24
        assert stats.num_requests_running == 0 and stats.kv_blocks_used == 0
        assert max(model.forward_batch_sizes) >= 3
    finally:
        engine.shutdown()
    assert not engine.is_running

    async def after() -> None:
        with pytest.raises(EngineDeadError):
            engine.add_request("late", h.chat_inputs(processor, "late", []), greedy())

    asyncio.run(after())


def test_closing_a_stream_aborts_its_request(
    make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    core, _ = make_engine()
    engine = AsyncEngine(core, processor)

    async def main() -> None:
        stream = engine.add_request("r", h.chat_inputs(processor, "x", []), greedy(300))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if engine.stats().num_requests_running == 0 and engine.stats().kv_blocks_used == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("request was not aborted")

    try:
        asyncio.run(main())
        assert engine.stats().requests_finished_total == 1
    finally:
        engine.shutdown()


def test_invalid_request_fails_alone_over_the_stream(
    make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    core, _ = make_engine()
    engine = AsyncEngine(core, processor)
    bad = h.chat_inputs(processor, "x", [])
    bad.prompt_token_ids = [*bad.prompt_token_ids, -1]

    async def main() -> tuple[Any, Any]:
        bad_stream = engine.add_request("bad", bad, greedy())
        good_stream = engine.add_request("good", h.chat_inputs(processor, "y", []), greedy(4))
        return await asyncio.gather(collect(bad_stream), collect(good_stream))

    try:
        (bad_out, _), (good_out, _) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert bad_out.finish_reason == "error" and "vocabulary" in bad_out.error
    assert good_out.finish_reason == "length"


class DelayedSendEC(NoOpECConnector):
    """Holds each finished request's encoder outputs until ``hold_s`` later."""

    def __init__(self, hold_s: float) -> None:
        super().__init__(None, ECConnectorRole.SCHEDULER)
        self.hold_s = hold_s
        self.pending: dict[str, float] = {}

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self.pending[request.request_id] = time.monotonic() + self.hold_s
        return True, {"held": True}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        done = {rid for rid, t in self.pending.items() if t <= now}
        for rid in done:
            del self.pending[rid]
        return done or None, None


def test_delayed_free_is_polled_without_spinning(
    vlm: Any, processor: Any, h: Any, greedy: Any
) -> None:
    ec = DelayedSendEC(hold_s=0.3)
    model = h.CountingModel(vlm)
    core = EngineCore(h.engine_config(), model, tokenizer=processor.tokenizer,
                      ec_connectors=(ec, ec))  # fmt: skip
    engine = AsyncEngine(core, processor)
    inputs = h.chat_inputs(processor, "x", [h.image_media(5)])

    async def main() -> RequestOutput:
        out, _ = await collect(engine.add_request("r", inputs, greedy(2)))
        return out

    try:
        out = asyncio.run(main())
        assert out.ec_transfer_params == {"held": True}
        steps_at_finish = engine.stats().engine_steps_total
        assert engine.stats().encoder_cache_refs == 1  # held for the connector
        deadline = time.monotonic() + 5
        while engine.stats().encoder_cache_refs and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = engine.stats()
        assert stats.encoder_cache_refs == 0 and stats.kv_blocks_used == 0
        # ~0.3 s of polling at one step per 2 ms or slower, not a busy loop.
        assert stats.engine_steps_total - steps_at_finish < 250
    finally:
        engine.shutdown()
