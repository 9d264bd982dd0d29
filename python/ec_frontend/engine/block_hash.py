"""Content keys of full KV blocks, for prefix caching.

The key of block ``i`` of a request is SHA-256 over the key of block ``i - 1``
(a chain, so equal keys mean equal whole prefixes), the block's token ids, and
for every media item whose placeholders overlap the block its ``mm_hash``,
offset and grid (two images with equal placeholder runs never share). Block 0
also takes the request's ``cache_salt``: requests of tenants with different
salts share no block. Every field is framed (fixed widths or a length prefix),
so no two different inputs feed the same bytes to the hash.

One instance serves one model, so the model's identity is not part of the key.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ec_frontend.engine.request import Request

_ROOT = b"\x00" * 32
_SALT = struct.Struct("<BQ")
_ITEM = struct.Struct("<BQqqqq")


def _framed_salt(salt: str | None) -> bytes:
    if salt is None:
        return _SALT.pack(0, 0)
    data = salt.encode("utf-8", "surrogatepass")
    return _SALT.pack(1, len(data)) + data


def block_key(
    parent: bytes, token_ids: list[int], items: list[tuple[str, int, tuple[int, ...]]]
) -> bytes:
    """The key of one full block after ``parent`` (``_ROOT`` for block 0, with the salt)."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    for mm_hash, offset, (t, gh, gw) in items:
        data = mm_hash.encode("ascii", "replace")
        h.update(_ITEM.pack(2, len(data), offset, t, gh, gw))
        h.update(data)
    return h.digest()


def extend_block_hashes(request: Request, block_size: int, num_blocks: int) -> list[bytes]:
    """``request.block_hashes`` grown to cover its first ``num_blocks`` full blocks
    (fewer when it has fewer full blocks). Token ids only grow, so keys computed
    once stay valid for the request's life."""
    keys = request.block_hashes
    num_blocks = min(num_blocks, request.num_tokens // block_size)
    features = request.mm_features
    while len(keys) < num_blocks:
        i = len(keys)
        start, end = i * block_size, (i + 1) * block_size
        items = [
            (f.mm_hash, f.offset, tuple(f.image_grid_thw))
            for f in features
            if f.offset < end and f.offset + f.length > start
        ]
        parent = (
            keys[-1] if keys else hashlib.sha256(_ROOT + _framed_salt(request.cache_salt)).digest()
        )
        keys.append(block_key(parent, request.token_ids_range(start, end), items))
    return keys
