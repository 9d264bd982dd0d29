"""A consumer without vision weights whose side-channel peer is gone: a clean error, in time.

In-process engine on the built-in model, loaded without its vision tower
(``load_vision=False``): the item can only come from the peer, so when the
peer refuses or stays silent the request finishes with ``finish_reason
"error"`` and a message, within the pull timeout, and the engine goes on.
"""

from __future__ import annotations

import io
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ec_frontend.config import (
    ECTransferConfig,
    EngineConfig,
    SchedulerConfig,
    TransferTrust,
)
from ec_frontend.connectors.transfer_trust import new_token, signed
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.outputs import RequestOutput
from ec_frontend.engine.sampling_params import SamplingParams
from PIL import Image

pytestmark = pytest.mark.slow

PULL_TIMEOUT_S = 1.0
SECRET = b"no-vision-test-secret-0123456789"


@dataclass(frozen=True, slots=True)
class Media:
    data: bytes
    mm_hash: str


def png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def engine(builtin_model_dir: Path) -> tuple[EngineCore, Any]:
    config = EngineConfig(
        model=str(builtin_model_dir),
        device="cpu",
        load_vision=False,
        scheduler=SchedulerConfig(max_model_len=1024),
        ec_transfer=ECTransferConfig(
            "ECSideChannelConnector",
            "ec_consumer",
            {"timeout_s": PULL_TIMEOUT_S},
            trust=TransferTrust(secret=SECRET),
        ),
    )
    return EngineCore.from_config(config)


def run(core: EngineCore, rid: str, deadline_s: float) -> RequestOutput:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for out in core.step():
            if out.request_id == rid and out.finished:
                return out
        time.sleep(0.002)
    raise AssertionError(f"{rid} did not finish within {deadline_s}s")


@pytest.mark.parametrize("peer", ["refused", "silent"])
def test_peer_gone_without_vision_weights_is_a_clean_error(
    engine: tuple[EngineCore, Any], peer: str
) -> None:
    core, processor = engine
    color = (10, 200, 30) if peer == "refused" else (200, 10, 30)
    mm_hash = f"{sum(color):032x}"
    messages = [{"role": "user", "content": [{"type": "image", "media_index": 0},
                                             {"type": "text", "text": "hi"}]}]  # fmt: skip
    inputs = processor.process_chat(messages, [Media(png(color), mm_hash)])
    (feature,) = inputs.mm_features
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    if peer == "silent":
        silent.listen(4)
    port = silent.getsockname()[1]
    entry = {"peer_host": "127.0.0.1", "peer_port": port, "num_tokens": feature.length,
             "dtype": "float32", "shape": [feature.length, core.model.hidden_size],
             "token": new_token()}  # fmt: skip
    params = {mm_hash: signed(SECRET, "ec", mm_hash, entry, 60.0)}
    try:
        started = time.monotonic()
        core.add_request(
            peer, inputs, SamplingParams(max_tokens=4, extra_args={"ec_transfer_params": params})
        )
        out = run(core, peer, PULL_TIMEOUT_S + 10)
        elapsed = time.monotonic() - started
    finally:
        silent.close()
    assert out.finish_reason == "error"
    assert out.error is not None and "vision tower" in out.error
    assert elapsed < PULL_TIMEOUT_S + 5
    stats = core.stats()
    assert stats.ec_load_fallbacks_total >= 1
    assert stats.kv_blocks_used == 0 and stats.num_requests_running == 0
