"""Parsing many requests does not grow the process's resident memory beyond noise."""

from __future__ import annotations

import base64
import gc
import json
import os

import ec_frontend as ecf

from .bad_inputs import BAD_INPUTS

PAGE = os.sysconf("SC_PAGE_SIZE")
IMAGE = base64.b64encode(bytes(range(256)) * 64).decode()  # 16 KiB decoded


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


BODIES = [
    (
        "chat",
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief " * 20},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "describe"},
                            {
                                "type": "image_url",
                                "image_url": {"url": f"data:image/png;base64,{IMAGE}"},
                            },
                        ],
                    },
                ],
                "vllm_xargs": {"a": [1, 2, {"b": "c"}]},
                "kv_transfer_params": {"do_remote_decode": True},
                "ec_transfer_params": {},
                "stop": ["x", "y"],
            }
        ).encode(),
    ),
    ("completions", b'{"prompt": [[1, 2, 3], [4, 5]], "logprobs": 2, "echo": true}'),
    ("responses", b'{"input": "hello", "instructions": "sys", "max_output_tokens": 5}'),
    ("generate", b'{"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}'),
]
BAD = [(c.endpoint, c.body) for c in BAD_INPUTS if len(c.body) < 4096]


def _round(n: int) -> None:
    for i in range(n):
        endpoint, body = BODIES[i % len(BODIES)]
        req = ecf.parse_request(endpoint, body)
        _ = (req.sampling, req.messages, req.prompts, req.token_ids, req.media)
        for item in req.media:
            _ = (item.data, item.mm_hash)
        bad_endpoint, bad_body = BAD[i % len(BAD)]
        try:
            ecf.parse_request(bad_endpoint, bad_body)
        except ecf.RequestError as err:
            _ = (err.param, err.code, err.message)


def test_ten_thousand_requests_do_not_grow_rss() -> None:
    _round(2_000)
    gc.collect()
    before = _rss_bytes()
    _round(10_000)
    gc.collect()
    grown = _rss_bytes() - before
    # The 2,500 chat requests among them decode ~40 MiB of media: a leak of the
    # decoded image (or of the request holding it) would show as tens of MiB.
    assert grown < 4 * 1024 * 1024, f"RSS grew by {grown / 2**20:.1f} MiB"
