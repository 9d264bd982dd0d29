"""Routing policies of the proxy: which instance of a role gets a request.

Every policy is a pure function of the request's key, the candidates (the
healthy instances of one role, by URL) and their loads (requests in flight
from this proxy), so that several proxy replicas given the same instances
route the same keys to the same places without sharing any state:

- ``round-robin``: each candidate in turn (the key is ignored);
- ``least-loaded``: the candidate with the fewest requests in flight (ties go
  to the highest rendezvous score of the key, so they do not all land on the
  first URL);
- ``affinity`` (encoders, keyed by the item's content hash) and ``cache-aware``
  (prefill / PD, keyed by the prompt's shareable prefix): rendezvous hashing
  (highest random weight) with bounded load. Each candidate's score is a hash of
  the key and its URL; the key goes to the highest-scoring candidate whose load is
  below ``ceil(load_factor * (total + 1) / n)``. Adding or removing one candidate
  moves only the keys that it wins or won; the bound keeps one hot key from
  piling onto one instance (at most ``load_factor`` times the mean, plus one).

:func:`prefix_key` is the cache-aware key of a chat or completion body: a hash
of the body's first ``PREFIX_KEY_BYTES`` of prompt (the system prompt, the first
images' identities, the first text), which is where prompts that share a
prefix agree.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import orjson

EncoderPolicy = Literal["affinity", "round-robin"]
PrefillPolicy = Literal["cache-aware", "least-loaded", "round-robin"]
ENCODER_POLICIES: tuple[EncoderPolicy, ...] = ("affinity", "round-robin")
PREFILL_POLICIES: tuple[PrefillPolicy, ...] = ("cache-aware", "least-loaded", "round-robin")

#: How far above the mean load a keyed policy lets one candidate go before the key
#: moves on to its next candidate (bounded-load hashing's ``c``).
DEFAULT_LOAD_FACTOR = 1.25
#: How much of a prompt's canonical form the cache-aware key covers.
PREFIX_KEY_BYTES = 2048


def rendezvous_order(key: bytes, candidates: Sequence[str]) -> list[str]:
    """``candidates`` from the highest rendezvous score for ``key`` to the lowest."""

    def score(url: str) -> bytes:
        return hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest()

    return sorted(candidates, key=score, reverse=True)


def load_bound(loads: Mapping[str, int], candidates: Sequence[str], load_factor: float) -> int:
    """The most requests in flight a keyed pick lets one candidate have (the new one included)."""
    total = sum(loads.get(url, 0) for url in candidates) + 1
    return max(1, math.ceil(load_factor * total / len(candidates)))


def pick_keyed(
    key: bytes,
    candidates: Sequence[str],
    loads: Mapping[str, int],
    load_factor: float = DEFAULT_LOAD_FACTOR,
) -> str:
    """Rendezvous hashing with bounded load: the first candidate in ``key``'s order
    whose load is below :func:`load_bound`."""
    if not candidates:
        raise ValueError("no candidate to route to")
    bound = load_bound(loads, candidates, load_factor)
    order = rendezvous_order(key, candidates)
    for url in order:
        if loads.get(url, 0) < bound:
            return url
    return order[0]


def pick_least_loaded(key: bytes, candidates: Sequence[str], loads: Mapping[str, int]) -> str:
    """The least-loaded candidate, ties broken by ``key``'s rendezvous order."""
    if not candidates:
        raise ValueError("no candidate to route to")
    order = rendezvous_order(key, candidates)
    return min(order, key=lambda url: loads.get(url, 0))


class Router:
    """One role's policy, with the round-robin counter that policy needs."""

    def __init__(self, policy: str, load_factor: float = DEFAULT_LOAD_FACTOR) -> None:
        if policy not in (*ENCODER_POLICIES, *PREFILL_POLICIES):
            raise ValueError(f"unknown routing policy {policy!r}")
        if load_factor < 1.0:
            raise ValueError("load_factor must be at least 1")
        self.policy = policy
        self.load_factor = load_factor
        self._turn = itertools.count()

    def pick(self, key: bytes, candidates: Sequence[str], loads: Mapping[str, int]) -> str:
        if not candidates:
            raise ValueError("no candidate to route to")
        if self.policy == "round-robin":
            return candidates[next(self._turn) % len(candidates)]
        if self.policy == "least-loaded":
            return pick_least_loaded(key, candidates, loads)
        return pick_keyed(key, candidates, loads, self.load_factor)

    def order(self, key: bytes, candidates: Sequence[str], loads: Mapping[str, int]) -> list[str]:
        """Every candidate, the pick first and then the fallbacks in the policy's order."""
        first = self.pick(key, candidates, loads)
        rest = [u for u in rendezvous_order(key, candidates) if u != first]
        return [first, *rest]


_MEDIA_TYPES = ("image_url", "video_url", "input_audio", "image_embeds", "video_embeds")


def _part(part: Any) -> Any:
    """A content part as the key sees it: a media part by a digest of itself (its
    bytes are long and their first kilobytes alike), text as it is."""
    if isinstance(part, dict) and part.get("type") in _MEDIA_TYPES:
        blob = orjson.dumps(part, option=orjson.OPT_SORT_KEYS)
        return [part.get("type"), hashlib.blake2b(blob, digest_size=16).hexdigest()]
    return part


def prefix_key(body: Mapping[str, Any], limit: int = PREFIX_KEY_BYTES) -> bytes:
    """The cache-aware routing key of a request: a hash of the first ``limit`` bytes of
    its prompt in canonical form (each message's role and content parts in order, media
    parts by digest; or the completion prompt), with the model name, since instances
    cache per model. Messages past the limit are not looked at."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(body.get("model", "")).encode() + b"\0")
    messages = body.get("messages")
    pieces: list[Any] = []
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):
                    content = [_part(p) for p in content]
                pieces.append([m.get("role"), content])
            else:
                pieces.append(m)
    else:
        pieces.append(body.get("prompt"))
    left = limit
    for piece in pieces:
        if left <= 0:
            break
        try:
            blob = orjson.dumps(piece, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            blob = repr(piece).encode()
        h.update(blob[:left])
        left -= len(blob)
    return h.digest()
