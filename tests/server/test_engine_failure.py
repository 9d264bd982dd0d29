"""How a request the engine failed alone is answered: the failure's cause picks the status."""

from __future__ import annotations

import orjson
import pytest
from ec_frontend.entrypoints.http.errors import engine_failure
from ec_frontend.entrypoints.openai.chat_format import stream_error

KV = "KV transfer from the prefill instance 127.0.0.1:9"


@pytest.mark.parametrize(
    ("message", "status", "code", "param"),
    [
        ("media item 0 could not be encoded: bad grid", 400, "invalid_input", None),
        # An item the request only references: a failed load is the upstream's failure,
        # an item nobody holds is the request's; a proxy answers both by sending the image.
        (
            "EC transfer of media item ab failed, and the request carries no image to encode",
            502,
            "ec_item_unavailable",
            None,
        ),
        (
            "media reference ab is neither cached nor loadable here, and the request carries "
            "no image to encode",
            400,
            "ec_item_unavailable",
            None,
        ),
        ("prompt token id 99999 is outside the vocabulary", 400, "invalid_input", None),
        # Unverified params may be a client's: the failure is the request's own.
        (
            f"{KV} (unverified kv_transfer_params) failed: refused",
            400,
            "kv_transfer_failed",
            "kv_transfer_params",
        ),
        # Signed params came from a trusted prefill instance, which failed.
        (f"{KV} (signed kv_transfer_params) failed: timed out", 502, "kv_transfer_failed", None),
        ("CUDA error: an illegal memory access", 500, "engine_error", None),
    ],
)
def test_engine_failure_status(message: str, status: int, code: str, param: str | None) -> None:
    e = engine_failure(message)
    assert (e.status, e.code, e.param) == (status, code, param)
    event = stream_error(message)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    error = orjson.loads(event[6:])["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert message in error["message"]
