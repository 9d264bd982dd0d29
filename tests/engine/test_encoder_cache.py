"""Encoder cache bookkeeping: hits, refcounts, eviction of unreferenced entries, freed hashes."""

from __future__ import annotations

from typing import Any

from ec_frontend.engine.encoder_cache import EncoderCacheManager


def test_shared_entry_is_refcounted(h: Any) -> None:
    cache = EncoderCacheManager(16)
    a = h.fake_request("a", 10, images=[("img", 0, 4)])
    b = h.fake_request("b", 10, images=[("img", 0, 4)])
    assert not cache.check_and_update_cache(a, 0)
    assert cache.can_allocate(4)
    cache.allocate(a, 0)
    assert cache.check_and_update_cache(b, 0)  # same hash: a hit, no new space
    assert cache.num_free_slots == 12
    assert cache.num_references() == 2
    cache.free(a)
    assert cache.num_references() == 1
    cache.free(b)
    assert cache.num_references() == 0
    assert cache.contains(h.fake_hash("img"))  # kept for later hits until space is needed
    assert cache.take_freed_mm_hashes() == []


def test_eviction_takes_least_recently_released_first(h: Any) -> None:
    cache = EncoderCacheManager(8)
    reqs = [h.fake_request(f"r{i}", 10, images=[(f"img{i}", 0, 4)]) for i in range(3)]
    for r in reqs[:2]:
        assert cache.can_allocate(4)
        cache.allocate(r, 0)
    assert not cache.can_allocate(4)  # both referenced: nothing to evict
    cache.free(reqs[1])
    cache.free(reqs[0])
    assert cache.can_allocate(4)  # evicts img1 (released first)
    assert cache.take_freed_mm_hashes() == [h.fake_hash("img1")]
    cache.allocate(reqs[2], 0)
    assert cache.contains(h.fake_hash("img0"))
    assert not cache.contains(h.fake_hash("img1"))
    assert cache.take_freed_mm_hashes() == []


def test_rehit_of_freeable_entry_protects_it(h: Any) -> None:
    cache = EncoderCacheManager(8)
    a = h.fake_request("a", 10, images=[("img", 0, 4)])
    cache.can_allocate(4)
    cache.allocate(a, 0)
    cache.free(a)
    b = h.fake_request("b", 10, images=[("img", 0, 4)])
    assert cache.check_and_update_cache(b, 0)
    assert not cache.can_allocate(8)  # img is referenced again: not evictable
    assert cache.take_freed_mm_hashes() == []


def test_item_larger_than_cache_never_fits() -> None:
    cache = EncoderCacheManager(8)
    assert not cache.can_allocate(9)


def test_discard_only_unreferenced(h: Any) -> None:
    cache = EncoderCacheManager(8)
    a = h.fake_request("a", 10, images=[("img", 0, 4)])
    cache.can_allocate(4)
    cache.allocate(a, 0)
    cache.discard(h.fake_hash("img"))
    assert cache.contains(h.fake_hash("img"))
    cache.free(a)
    cache.discard(h.fake_hash("img"))
    assert not cache.contains(h.fake_hash("img"))
    assert cache.num_free_slots == 8
    assert cache.take_freed_mm_hashes() == [h.fake_hash("img")]


def test_counts_kept_as_entries_change_match_a_recount(h: Any) -> None:
    """The reference count and the reclaimable rows, kept as entries change, equal a
    recount of the entries after every operation of a random workload (hits, new
    items, releases, evictions, discards)."""
    import random

    rng = random.Random(3)
    cache = EncoderCacheManager(24)
    requests = [
        h.fake_request(f"r{i}", 40, images=[(f"img{rng.randrange(8)}", 0, rng.randrange(1, 9))])
        for i in range(60)
    ]
    evicted = 0
    for _ in range(400):
        request = rng.choice(requests)
        op = rng.random()
        if op < 0.5 and not cache.check_and_update_cache(request, 0):
            length = request.mm_features[0].length
            if not cache.contains(request.mm_features[0].mm_hash) and cache.can_allocate(length):
                cache.allocate(request, 0)
        elif op < 0.85:
            cache.free(request)
        else:
            cache.discard(request.mm_features[0].mm_hash)
        evicted += len(cache.take_freed_mm_hashes())
        refs = sum(len(r) for r in cache._refs.values())
        freeable = sum(cache._sizes[m] for m, r in cache._refs.items() if not r)
        assert cache.num_references() == refs
        assert cache._freeable_rows == freeable == sum(cache._freeable.values())
        assert cache.num_free_slots + sum(cache._sizes.values()) == cache.cache_size
    assert evicted > 0
