"""The media fetcher's Prometheus series (rendered on the server's ``/metrics``).

Contract: one :class:`FetchMetrics` per server process; every name starts with
``ec_frontend_media_``; updates happen on the event loop. Through
:mod:`ec_frontend.metrics` the values are summed over a group of API servers
like the server's own series.
"""

from __future__ import annotations

from collections.abc import Iterable

from ec_frontend.metrics import LATENCY_BUCKETS, PREFIX, Counter, Histogram, Snapshot


class FetchMetrics:
    """Fetches, bytes, latency, cache hits and refusals of the media fetcher."""

    def __init__(self) -> None:
        self.fetches = Counter(
            PREFIX + "media_fetches_total",
            "Media items fetched from their origin (cache hits excluded), by scheme.",
            ("scheme",),
        )
        self.bytes = Counter(
            PREFIX + "media_fetched_bytes_total",
            "Bytes of media items fetched from their origin.",
        )
        self.latency = Histogram(
            PREFIX + "media_fetch_seconds",
            "Time to fetch one media item from its origin (successful fetches).",
            LATENCY_BUCKETS,
        )
        self.cache_hits = Counter(
            PREFIX + "media_cache_hits_total",
            "Media items served from the in-memory media cache.",
        )
        self.refused = Counter(
            PREFIX + "media_fetch_refused_total",
            "Media URLs that gave no bytes, by reason (policy, caps, origin errors).",
            ("reason",),
        )

    def render(self, snapshot: Snapshot | None = None) -> Iterable[str]:
        for series in (self.fetches, self.bytes, self.cache_hits, self.refused, self.latency):
            yield from series.render(snapshot)
