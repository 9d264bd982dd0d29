"""Encoder cache bookkeeping, keyed by ``mm_hash``.

The manager tracks which encoder outputs the runner holds, how many rows
(placeholder tokens) each takes and which requests reference them. It never
sees tensors. An entry with no references stays cached (a later request with
the same image hits it) until space is needed; then the least recently
released entries are evicted and their hashes reported to the runner through
:meth:`EncoderCacheManager.take_freed_mm_hashes`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ec_frontend.engine.request import Request


class EncoderCacheManager:
    """Space accounting and refcounts of cached encoder outputs.

    Invariants: ``num_free_slots + sum(sizes of cached entries) == cache_size``;
    an entry is in ``_freeable`` exactly when no request references it.
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self._refs: dict[str, set[str]] = {}
        self._sizes: dict[str, int] = {}
        self._freeable: OrderedDict[str, int] = OrderedDict()
        self._freed: list[str] = []
        #: Kept as entries change, so that a step's stats read them in O(1).
        self._num_refs = 0
        self._freeable_rows = 0

    def contains(self, mm_hash: str) -> bool:
        return mm_hash in self._sizes

    def check_and_update_cache(self, request: Request, index: int) -> bool:
        """If item ``index`` of ``request`` is cached, reference it and return True."""
        mm_hash = request.mm_features[index].mm_hash
        refs = self._refs.get(mm_hash)
        if refs is None:
            return False
        if request.request_id not in refs:
            if not refs:
                self._freeable_rows -= self._freeable.pop(mm_hash, 0)
            refs.add(request.request_id)
            self._num_refs += 1
        return True

    def has_ref(self, request: Request, index: int) -> bool:
        refs = self._refs.get(request.mm_features[index].mm_hash)
        return refs is not None and request.request_id in refs

    def can_allocate(self, num_rows: int) -> bool:
        """Whether ``num_rows`` fit now, after evicting unreferenced entries if needed.

        Evicts (least recently released first) only when that makes the item fit.
        """
        if num_rows > self.cache_size:
            return False
        if num_rows <= self.num_free_slots:
            return True
        if num_rows > self.num_free_slots + self._freeable_rows:
            return False
        while num_rows > self.num_free_slots:
            mm_hash, size = self._freeable.popitem(last=False)
            self._freeable_rows -= size
            del self._refs[mm_hash]
            del self._sizes[mm_hash]
            self.num_free_slots += size
            self._freed.append(mm_hash)
        return True

    def allocate(self, request: Request, index: int) -> None:
        """Reserve space for item ``index`` and reference it (call ``can_allocate`` first)."""
        feature = request.mm_features[index]
        if feature.mm_hash in self._sizes:
            raise ValueError(f"encoder output {feature.mm_hash} is already cached")
        if feature.length > self.num_free_slots:
            raise ValueError("encoder cache has no room; call can_allocate first")
        self.num_free_slots -= feature.length
        self._sizes[feature.mm_hash] = feature.length
        self._refs[feature.mm_hash] = {request.request_id}
        self._num_refs += 1

    def free_encoder_input(self, request: Request, index: int) -> None:
        """Drop the request's reference to item ``index`` (no-op if it has none)."""
        mm_hash = request.mm_features[index].mm_hash
        refs = self._refs.get(mm_hash)
        if refs is None or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        self._num_refs -= 1
        if not refs:
            size = self._sizes[mm_hash]
            self._freeable[mm_hash] = size
            self._freeable_rows += size

    def free(self, request: Request) -> None:
        """Drop every reference the request holds."""
        for index in range(len(request.mm_features)):
            self.free_encoder_input(request, index)

    def discard(self, mm_hash: str) -> None:
        """Forget an unreferenced entry the runner could not produce."""
        if self._refs.get(mm_hash):
            return
        size = self._sizes.pop(mm_hash, None)
        if size is None:
            return
        self._refs.pop(mm_hash, None)
        self._freeable_rows -= self._freeable.pop(mm_hash, 0)
        self.num_free_slots += size
        self._freed.append(mm_hash)

    def take_freed_mm_hashes(self) -> list[str]:
        """Hashes evicted since the last call; the runner drops their tensors."""
        freed, self._freed = self._freed, []
        return freed

    def num_references(self) -> int:
        """Total references held by requests (0 when no request holds any)."""
        return self._num_refs

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_slots / self.cache_size

    @property
    def num_cached(self) -> int:
        return len(self._sizes)
