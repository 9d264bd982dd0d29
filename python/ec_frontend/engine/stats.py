"""A snapshot of an engine's counters and gauges, named as in DESIGN 4.8.

Counters are totals since start; gauges are values at the snapshot. The server
exports them as ``ec_frontend_<name>`` (counters with ``_total``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineStats:
    # counters
    encoder_items_computed: int = 0
    encoder_cache_hits: int = 0
    ec_items_loaded: int = 0
    ec_items_saved: int = 0
    ec_load_fallbacks: int = 0
    prompt_tokens_computed: int = 0
    kv_tokens_received: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    lm_forward_calls: int = 0
    encoder_forward_calls: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    # gauges
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    encoder_cache_usage: float = 0.0

    #: Names of the fields that are gauges; every other field is a counter.
    GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage",
              "encoder_cache_usage")  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
