"""Media by URL: the fetch policy, the fetcher, its cache and its metrics.

A low layer: it imports only ``ec_frontend._core`` and ``ec_frontend.metrics``,
never ``entrypoints``, ``engine``, ``connectors`` or ``model``. The server
builds one :class:`MediaFetcher` and resolves each request's URL items with
:func:`resolve_items` before the request's inputs are processed.
"""

from __future__ import annotations

from ec_frontend.media.fetch import MediaFetcher, RequestBudget, Resolver, system_resolver
from ec_frontend.media.items import FetchedItem, resolve_items
from ec_frontend.media.metrics import FetchMetrics
from ec_frontend.media.policy import MediaError, MediaFetchConfig, parse_domains, parse_networks

__all__ = [
    "FetchMetrics",
    "FetchedItem",
    "MediaError",
    "MediaFetchConfig",
    "MediaFetcher",
    "RequestBudget",
    "Resolver",
    "parse_domains",
    "parse_networks",
    "resolve_items",
    "system_resolver",
]
