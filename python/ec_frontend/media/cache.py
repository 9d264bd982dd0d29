"""A bounded in-memory cache of fetched media bytes that honours HTTP caching headers.

Contract:

* Entries are keyed by the URL as the client sent it and hold the bytes and
  the time they stop being fresh. The cache holds at most ``capacity`` bytes
  in all; the least recently used entries are evicted first, and an item
  larger than the whole cache is not stored.
* It behaves as a shared cache (RFC 9111) that never revalidates: a response
  is stored only when it says for how long it is fresh (``s-maxage``, else
  ``max-age``, else ``Expires`` against ``Date``, less its ``Age``) and that
  time is positive; ``no-store``, ``no-cache``, ``private`` and a
  ``Vary: *`` keep it out. A response without any of these headers is never
  stored: there is no heuristic freshness, so a URL whose content changes
  (a camera's ``latest.jpg``) is fetched again unless its origin says otherwise.
* An expired entry is never returned (it is dropped when met).
* Not thread-safe: the server uses it from its event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from email.utils import parsedate_to_datetime

#: Longest freshness honoured, whatever the origin says (one day).
MAX_FRESHNESS_S = 24 * 3600.0


def _directives(value: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for raw in value.split(","):
        name, sep, arg = raw.strip().partition("=")
        if name:
            out[name.strip().lower()] = arg.strip().strip('"') if sep else None
    return out


def _seconds(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = int(value)
    except ValueError:
        return None
    return float(seconds) if seconds >= 0 else None


def _http_date(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def freshness(headers: Mapping[str, str]) -> float:
    """Seconds the response described by ``headers`` (lower-case names) stays fresh
    in a shared cache; 0 when it must not be stored or reused."""
    control = _directives(headers.get("cache-control", ""))
    if any(d in control for d in ("no-store", "no-cache", "private")):
        return 0.0
    if headers.get("vary", "").strip() == "*":
        return 0.0
    lifetime = _seconds(control.get("s-maxage"))
    if lifetime is None:
        lifetime = _seconds(control.get("max-age"))
    if lifetime is None:
        expires = _http_date(headers.get("expires"))
        if expires is None:
            return 0.0
        date = _http_date(headers.get("date")) or time.time()
        lifetime = max(0.0, expires - date)
    age = _seconds(headers.get("age")) or 0.0
    return max(0.0, min(lifetime, MAX_FRESHNESS_S) - age)


class MediaCache:
    """URL -> bytes, bounded in bytes, each entry with its own expiry."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.size = 0
        self._clock = clock
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, url: str) -> bytes | None:
        """The fresh bytes stored for ``url``, or ``None``."""
        entry = self._entries.get(url)
        if entry is None:
            return None
        data, expires = entry
        if self._clock() >= expires:
            self._drop(url)
            return None
        self._entries.move_to_end(url)
        return data

    def put(self, url: str, data: bytes, headers: Mapping[str, str]) -> bool:
        """Store ``data`` for ``url`` if ``headers`` allow it and it fits; whether it was."""
        ttl = freshness(headers)
        if ttl <= 0 or len(data) > self.capacity:
            self._drop(url)
            return False
        self._drop(url)
        while self.size + len(data) > self.capacity and self._entries:
            oldest = next(iter(self._entries))
            self._drop(oldest)
        self._entries[url] = (data, self._clock() + ttl)
        self.size += len(data)
        return True

    def _drop(self, url: str) -> None:
        entry = self._entries.pop(url, None)
        if entry is not None:
            self.size -= len(entry[0])
