"""``--max-engine-requests`` counts a request's whole fan-out on arrival (issue 28).

In process, with input processing on the worker pool (the real engine's path), so
that admitted requests are suspended between their admission and their engine
requests: that window let four simultaneous 256-way requests all pass a limit of
512. The engine counts what it receives.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
from ec_frontend.engine.mock import MockEngine, MockEngineConfig, MockInputs
from ec_frontend.entrypoints.openai.limits import ResourceLimits
from ec_frontend.entrypoints.openai.server import ServerConfig, build_app


class CountingEngine(MockEngine):
    """The mock engine, counting the requests it was given and the most at once."""

    def __init__(self) -> None:
        super().__init__(MockEngineConfig(model="m", token_latency_s=0.01))
        self.added = 0
        self.peak = 0

    def _acquire(self, request_id: str, inputs: MockInputs) -> None:
        super()._acquire(request_id, inputs)
        self.added += 1
        self.peak = max(self.peak, len(self._running))


#: A 256-way request: two prompts, n=128 (the most ``n`` the parser takes).
BODY = orjson.dumps({"prompt": ["abc", "abd"], "n": 128, "max_tokens": 3})


async def _four_at_once(engine: CountingEngine) -> list[httpx.Response]:
    limits = ResourceLimits(max_engine_requests=512, max_processing_queue=64)
    config = ServerConfig(model_names=("m",), max_model_len=128, limits=limits)
    app, core = build_app(engine, config)
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            responses = await asyncio.gather(
                *(c.post("/v1/completions", content=BODY) for _ in range(4))
            )
            assert core.serving.engine_requests() == 0  # every slot given back
            after = await c.post("/v1/completions", content=BODY)
            assert after.status_code == 200, after.text
        return list(responses)
    finally:
        core.serving.shutdown()


def test_simultaneous_fanouts_are_counted_before_any_awaits() -> None:
    engine = CountingEngine()
    responses = asyncio.run(_four_at_once(engine))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 429, 429], [r.text[:200] for r in responses]
    refused: Any = [r.json()["error"] for r in responses if r.status_code == 429]
    assert {e["code"] for e in refused} == {"too_many_engine_requests"}
    assert engine.peak <= 512
    assert engine.added == 512 + 256  # the two admitted, then the one after
