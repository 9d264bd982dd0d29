"""Paged KV cache bookkeeping: a block pool and per-request block tables.

Only block ids live here; the runner owns the tensors. Block 0 is reserved as
the null block that pads block tables, so a padded entry never aliases a live
block.
"""

from __future__ import annotations

from collections import deque

from ec_frontend.model.interface import KVCacheSpec

NULL_BLOCK = 0


def num_blocks_for_budget(spec: KVCacheSpec, block_size: int, memory_bytes: int) -> int:
    """How many blocks (including the null block) fit in ``memory_bytes``."""
    per_block = spec.bytes_per_block(block_size)
    return memory_bytes // per_block if per_block > 0 else 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates fixed-size blocks to requests, all or nothing.

    Invariants: a block id is either free or in exactly one request's table;
    ``num_free_blocks + sum(len(table)) == num_blocks - 1``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("a KV cache needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request could hold if it had every usable block."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in ``[0, 1]``."""
        return self.num_used_blocks / (self.num_blocks - 1)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``num_tokens`` tokens in total."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` tokens.

        Returns the newly added block ids, or ``None`` (and changes nothing)
        when there are not enough free blocks.
        """
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(need)]
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (no-op if it has none)."""
        blocks = self._tables.pop(request_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables
