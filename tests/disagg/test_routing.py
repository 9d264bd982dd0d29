"""The proxy's routing policies (``entrypoints/proxy/routing.py``), as pure functions."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from ec_frontend.entrypoints.proxy.routing import (
    Router,
    load_bound,
    pick_keyed,
    pick_least_loaded,
    prefix_key,
    rendezvous_order,
)

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 9)]
KEYS = [f"item-{i}".encode() for i in range(4000)]


def owners(urls: list[str]) -> dict[bytes, str]:
    return {k: pick_keyed(k, urls, {}) for k in KEYS}


def test_keys_spread_over_every_candidate() -> None:
    counts = Counter(owners(URLS).values())
    assert set(counts) == set(URLS)
    mean = len(KEYS) / len(URLS)
    assert all(0.75 * mean < c < 1.25 * mean for c in counts.values()), counts


def test_removing_a_candidate_moves_only_its_keys() -> None:
    before = owners(URLS)
    gone = URLS[3]
    after = owners([u for u in URLS if u != gone])
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == gone}
    assert moved  # the removed one did own keys
    assert {after[k] for k in moved} == set(URLS) - {gone}  # its share spreads


def test_adding_a_candidate_takes_keys_only_for_itself() -> None:
    before = owners(URLS)
    new = "http://10.0.0.99:8000"
    after = owners([*URLS, new])
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved and all(after[k] == new for k in moved)
    assert 0.5 * len(KEYS) / 9 < len(moved) < 1.5 * len(KEYS) / 9


def test_the_order_of_candidates_does_not_matter() -> None:
    shuffled = URLS[:]
    random.Random(3).shuffle(shuffled)
    assert owners(shuffled) == owners(URLS)


def test_a_candidate_at_the_bound_passes_the_key_on() -> None:
    key = b"hot image"
    first, second = rendezvous_order(key, URLS)[:2]
    loads = {u: 1 for u in URLS}
    assert pick_keyed(key, URLS, loads) == first
    loads[first] = load_bound(loads, URLS, 1.25)
    assert pick_keyed(key, URLS, loads) == second


def test_one_hot_key_stays_within_the_load_bound() -> None:
    """Requests that never finish, 90% of them for one key: every candidate's load
    stays within ceil(1.25 * total / n) at every step."""
    rng = random.Random(7)
    loads: Counter[str] = Counter()
    for i in range(2000):
        key = b"hot" if rng.random() < 0.9 else f"cold-{i}".encode()
        url = pick_keyed(key, URLS, loads, 1.25)
        loads[url] += 1
        total = sum(loads.values())
        assert max(loads.values()) <= -(-125 * total // (100 * len(URLS))), loads
    assert max(loads.values()) / (sum(loads.values()) / len(URLS)) <= 1.26


def test_least_loaded_breaks_ties_by_key() -> None:
    loads = {u: 2 for u in URLS}
    picks = {pick_least_loaded(k, URLS, loads) for k in KEYS[:200]}
    assert len(picks) == len(URLS)
    loads[URLS[5]] = 1
    assert pick_least_loaded(b"any", URLS, loads) == URLS[5]


def test_round_robin_takes_turns() -> None:
    router = Router("round-robin")
    assert [router.pick(b"k", URLS[:3], {}) for _ in range(6)] == URLS[:3] * 2


def test_router_order_starts_with_the_pick_and_covers_every_candidate() -> None:
    router = Router("affinity")
    order = router.order(b"k", URLS, {})
    assert order[0] == pick_keyed(b"k", URLS, {}) and sorted(order) == sorted(URLS)


def test_router_refuses_unknown_policies_and_empty_candidates() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("random")
    with pytest.raises(ValueError, match="load_factor"):
        Router("affinity", load_factor=0.5)
    with pytest.raises(ValueError, match="no candidate"):
        Router("cache-aware").pick(b"k", [], {})


def chat(system: str, user: str, model: str = "m", image: str | None = None) -> dict[str, object]:
    content: list[dict[str, object]] = [{"type": "text", "text": user}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": content},
        ],
    }


def test_prefix_key_is_shared_by_prompts_that_agree_on_their_first_2_kb() -> None:
    system = "You are a careful assistant. " * 100  # 2,900 bytes
    assert prefix_key(chat(system, "first question")) == prefix_key(chat(system, "second"))
    assert prefix_key(chat(system, "q")) != prefix_key(chat(system[::-1], "q"))
    assert prefix_key(chat(system, "q")) != prefix_key(chat(system, "q", model="other"))


def test_prefix_key_sees_short_prompts_whole_and_media_by_digest() -> None:
    assert prefix_key(chat("short", "a")) != prefix_key(chat("short", "b"))
    one = "data:image/png;base64," + "A" * 5000 + "B"
    two = "data:image/png;base64," + "A" * 5000 + "C"
    assert prefix_key(chat("s", "q", image=one)) != prefix_key(chat("s", "q", image=two))
    assert prefix_key(chat("s", "q", image=one)) == prefix_key(chat("s", "q", image=one))


def test_prefix_key_of_completions_and_odd_bodies() -> None:
    assert prefix_key({"model": "m", "prompt": "x" * 3000 + "a"}) == prefix_key(
        {"model": "m", "prompt": "x" * 3000 + "b"}
    )
    assert prefix_key({"model": "m", "messages": ["not a message", 3]})  # no crash
