"""Decode's view of NIXL-style ``kv_transfer_params``: validated against the request.

Prefill adds to NIXL's keys what decode needs to continue without computing a
prompt token: ``remote_num_tokens``, ``first_token_id``,
``mrope_position_delta`` (absent: 0, as for every 1-D RoPE family),
``prompt_hash`` (a digest of the prompt's token ids) and ``token`` (the
credential prefill asks for before it sends the KV).
:func:`parse_remote_prefill` accepts params only when they describe the
very request decode is serving.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ec_frontend.connectors.transfer_trust import TOKEN_KEY, valid_token
from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    from ec_frontend.engine.request import Request


#: The key under which the API server names the client of a ``do_remote_decode``
#: request (its address), overwriting whatever the client wrote there: prefill bounds
#: the KV each client holds (:class:`~ec_frontend.connectors.kv_pull.PullState`).
HOLD_CLIENT_KEY = "hold_client"


def stamp_hold_client(params: JSONObject | None, client: str) -> JSONObject | None:
    """``params`` with ``client`` under :data:`HOLD_CLIENT_KEY` when they ask prefill to
    hold KV (``do_remote_decode``), with that key removed otherwise."""
    if not isinstance(params, dict):
        return params
    if params.get("do_remote_decode") is True:
        return {**params, HOLD_CLIENT_KEY: client}
    if HOLD_CLIENT_KEY in params:
        return {k: v for k, v in params.items() if k != HOLD_CLIENT_KEY}
    return params


def prompt_hash(token_ids: list[int]) -> str:
    """A short digest of a prompt's token ids: decode checks it is continuing the same prompt."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Validated ``kv_transfer_params`` of a request whose prompt was computed elsewhere."""

    host: str
    port: int
    engine_id: str
    request_id: str
    num_blocks: int
    num_tokens: int
    first_token_id: int
    token: str


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_remote_prefill(params: JSONObject, request: Request) -> RemotePrefill | str:
    """The remote prefill ``params`` describe, or why they cannot be used for ``request``."""
    host, port = params.get("remote_host"), _int(params.get("remote_port"))
    engine_id, rid = params.get("remote_engine_id"), params.get("remote_request_id")
    blocks, num_tokens = params.get("remote_block_ids"), _int(params.get("remote_num_tokens"))
    first, delta = _int(params.get("first_token_id")), _int(params.get("mrope_position_delta", 0))
    if not isinstance(host, str) or not host or len(host) > 255:
        return "remote_host / remote_port missing or invalid"
    if port is None or not 0 < port < 65536:
        return "remote_host / remote_port missing or invalid"
    if not isinstance(engine_id, str) or not isinstance(rid, str) or not rid:
        return "remote_engine_id / remote_request_id missing or invalid"
    if not isinstance(blocks, list) or not blocks or any(_int(b) is None for b in blocks):
        return "remote_block_ids missing or invalid"
    if num_tokens is None or first is None or delta is None:
        return "remote_num_tokens / first_token_id / mrope_position_delta missing or invalid"
    if num_tokens != request.num_prompt_tokens:
        return f"prefill computed {num_tokens} tokens; this prompt has {request.num_prompt_tokens}"
    if params.get("prompt_hash") != prompt_hash(request.prompt_token_ids):
        return "prompt_hash does not match this prompt"
    if delta != request.mrope_position_delta:
        return f"mrope_position_delta {delta} != {request.mrope_position_delta} here"
    if first < 0:
        return "first_token_id is negative"
    token = params.get(TOKEN_KEY)
    if not valid_token(token):
        return "token missing or invalid"
    return RemotePrefill(host, port, engine_id, rid, len(blocks), num_tokens, first, token)
