"""Processed videos by content, so that a video sent again is not decoded again.

A multi-turn chat about one video sends the video with every turn; its prefix is
then in the KV cache, yet each turn would decode and preprocess the whole clip
(about a second of CPU for 32 frames of 720p H.264). :class:`ProcessedVideoCache`
keeps what the processor made of a video (grid, pixel values, sampled frames)
under a key of its bytes' digest, its frame sampling and its pixel range (the
inputs of decoding and preprocessing, so that a hit is exactly what a decode
would give) and the request's ``mm_hash``. The digest keeps a ``uuid`` that a
client reuses for other bytes from reaching this video; the ``mm_hash`` keeps
requests of different ``cache_salt`` apart, as the prefix cache does.

Bounded by the bytes of the pixel values it holds (``--mm-processor-cache-gb``,
vLLM's flag and default); least recently used entries go first. Thread-safe: the
server's processing threads share one cache. The cached tensors are shared, and
nothing downstream writes to its inputs.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["DEFAULT_CACHE_GB", "ProcessedVideoCache", "content_key"]

#: vLLM's ``--mm-processor-cache-gb`` default.
DEFAULT_CACHE_GB = 4.0

V = TypeVar("V")


def content_key(data: bytes, *parts: object) -> tuple[object, ...]:
    """A key for ``data`` processed with ``parts`` (the options that change the result)."""
    return (hashlib.blake2b(data, digest_size=16).digest(), len(data), *parts)


class ProcessedVideoCache(Generic[V]):
    """An LRU map from :func:`content_key` keys to processed videos, at most
    ``capacity_bytes`` of them as each entry's ``nbytes`` counts them."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes is {capacity_bytes}; it must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[object, ...], tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[object, ...]) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: tuple[object, ...], value: V, nbytes: int) -> bool:
        """Keep ``value``; ``False`` when it alone exceeds the capacity (not kept)."""
        if nbytes > self.capacity_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used_bytes -= old[1]
            self._entries[key] = (value, nbytes)
            self.used_bytes += nbytes
            while self.used_bytes > self.capacity_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self.used_bytes -= size
        return True
