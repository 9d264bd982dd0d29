"""The periodic stats line, as vLLM prints it, with the encoder cache and EC transfers.

Every interval (10 s; ``$EC_FRONTEND_LOG_STATS_INTERVAL``) while the engine has
work, or did some since the last line::

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.0 tokens/s,
    Running: 3 reqs, Waiting: 0 reqs, KV cache usage: 4.1%, Prefix cache hit rate:
    37.5%, Encoder cache usage: 12.0%, EC loads: 4, EC saves: 0, EC fallbacks: 0

(one line). The numbers are the engine's own counters (``/metrics`` exports the
same): throughputs and EC counts over the interval, the rest at its end. An idle
engine logs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ec_frontend.stats")


def _delta(now: Any, before: Any, name: str) -> int:
    return int(getattr(now, name, 0)) - int(getattr(before, name, 0))


def stats_line(now: Any, before: Any, seconds: float) -> str:
    """The line for the interval from the snapshot ``before`` to ``now``."""
    seconds = max(seconds, 1e-9)
    queries = _delta(now, before, "prefix_cache_queries_total")
    hits = _delta(now, before, "prefix_cache_hits_total")
    return (
        f"Avg prompt throughput: "
        f"{_delta(now, before, 'prompt_tokens_computed_total') / seconds:.1f} tokens/s, "
        f"Avg generation throughput: "
        f"{_delta(now, before, 'generation_tokens_total') / seconds:.1f} tokens/s, "
        f"Running: {now.num_requests_running} reqs, Waiting: {now.num_requests_waiting} reqs, "
        f"KV cache usage: {100 * now.kv_cache_usage:.1f}%, "
        f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%, "
        f"Encoder cache usage: {100 * now.encoder_cache_usage:.1f}%, "
        f"EC loads: {_delta(now, before, 'ec_items_loaded_total')}, "
        f"EC saves: {_delta(now, before, 'ec_items_saved_total')}, "
        f"EC fallbacks: {_delta(now, before, 'ec_load_fallbacks_total')}"
    )


class StatsLog:
    """Logs :func:`stats_line` every ``interval_s`` while there is something to say."""

    def __init__(self, stats: Callable[[], Any], interval_s: float) -> None:
        self.stats = stats
        self.interval_s = interval_s

    async def run(self) -> None:
        before, then = self.stats(), time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            now, at = self.stats(), time.monotonic()
            busy = now.num_requests_running or now.num_requests_waiting
            if busy or now != before:
                log.info("%s", stats_line(now, before, at - then))
            before, then = now, at
