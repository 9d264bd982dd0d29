"""Admission in the front middleware, in process (ASGI app driven by httpx)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from ec_frontend.engine.mock import MockEngine, MockEngineConfig
from ec_frontend.entrypoints.openai.server import App, ServerConfig, build_app

BODY = orjson.dumps({"prompt": "abc", "max_tokens": 5})


def make_app(max_in_flight: int = 4096) -> tuple[Any, App]:
    engine = MockEngine(MockEngineConfig(model="m", token_latency_s=0.05))
    config = ServerConfig(
        model_names=("m",),
        max_model_len=128,
        offload_processing=False,
        max_in_flight=max_in_flight,
    )
    return build_app(engine, config)


async def _overload() -> list[int]:
    app, _ = make_app(max_in_flight=1)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

        async def post(delay: float) -> httpx.Response:
            await asyncio.sleep(delay)
            return await client.post("/v1/completions", content=BODY)

        first, second = await asyncio.gather(post(0.0), post(0.1))
        third = await post(0.0)
    assert second.json()["error"]["code"] == "overloaded"
    return [first.status_code, second.status_code, third.status_code]


def test_overload_is_503_and_clears() -> None:
    assert asyncio.run(_overload()) == [200, 503, 200]


@pytest.mark.parametrize(
    ("draining", "path", "status"),
    [(True, "/health", 503), (True, "/v1/models", 503), (True, "/metrics", 200),
     (False, "/health", 200)],
)  # fmt: skip
def test_draining_refuses_all_but_metrics(draining: bool, path: str, status: int) -> None:
    app, core = make_app()
    core.state.draining = draining

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get(path)

    r = asyncio.run(get())
    assert r.status_code == status
    if status == 503:
        assert r.json()["error"]["code"] == "draining"
        assert r.headers["connection"] == "close"
