"""A snapshot of an engine's counters and gauges, named as in DESIGN 4.8.

Counters end in ``_total`` (totals since start); every other field is a gauge
(its value at the snapshot). The server exports each field as
``ec_frontend_<name>``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class RunnerCounters:
    """What a model runner has done since start (read into :class:`EngineStats`)."""

    encoder_items_computed: int = 0
    encoder_forward_calls: int = 0
    ec_items_loaded: int = 0
    ec_items_saved: int = 0
    ec_load_fallbacks: int = 0
    lm_forward_calls: int = 0
    #: Of ``lm_forward_calls``, the decode steps that replayed a CUDA graph.
    lm_graph_replays: int = 0
    lm_tokens: int = 0
    lm_requests: int = 0
    max_requests_per_forward: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    # counters
    encoder_items_computed_total: int = 0
    encoder_cache_hits_total: int = 0
    encoder_items_found_stored_total: int = 0
    ec_items_loaded_total: int = 0
    ec_items_saved_total: int = 0
    ec_load_fallbacks_total: int = 0
    prompt_tokens_computed_total: int = 0
    kv_tokens_received_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    engine_steps_total: int = 0
    lm_forward_calls_total: int = 0
    lm_graph_replays_total: int = 0
    encoder_forward_calls_total: int = 0
    requests_finished_total: int = 0
    requests_failed_total: int = 0
    kv_tokens_sent_total: int = 0
    kv_local_prefill_fallbacks_total: int = 0
    transfer_params_rejected_total: int = 0
    kv_holds_refused_total: int = 0
    # gauges
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    encoder_cache_usage: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    encoder_cache_refs: int = 0
    kv_requests_held: int = 0
    ec_items_held: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)
