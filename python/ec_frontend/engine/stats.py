"""A snapshot of an engine's counters and gauges, named as in DESIGN 4.8.

Counters end in ``_total`` (totals since start); every other field is a gauge
(its value at the snapshot). The server exports each field as
``ec_frontend_<name>``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: The HELP text of each :class:`EngineStats` field on ``/metrics``: what it counts.
FIELD_HELP: dict[str, str] = {
    "encoder_items_computed_total": "Media items (images, videos) this engine's vision "
    "encoder ran on.",
    "encoder_cache_hits_total": "Media items whose encoder output was already in the "
    "encoder cache (not recomputed, not loaded).",
    "ec_items_loaded_total": "Encoder outputs loaded from an encode instance through the "
    "EC connector.",
    "ec_items_saved_total": "Encoder outputs saved for consumers through the EC connector.",
    "ec_load_fallbacks_total": "EC loads that failed and were recomputed locally by the encoder.",
    "prompt_tokens_computed_total": "Prompt tokens computed in prefill (prefix-cache hits "
    "and received KV excluded).",
    "kv_tokens_received_total": "Prompt tokens whose KV was received from a prefill "
    "instance instead of computed.",
    "generation_tokens_total": "Tokens generated (sampled), all requests together.",
    "preemptions_total": "Running requests preempted to free KV-cache blocks.",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits_total": "Prompt tokens found in the prefix cache.",
    "engine_steps_total": "Engine steps (schedule, run, update) taken.",
    "lm_forward_calls_total": "Language-model forward passes.",
    "lm_graph_replays_total": "Decode forward passes that replayed a captured CUDA graph.",
    "encoder_forward_calls_total": "Vision-encoder forward passes (each may batch items).",
    "requests_finished_total": "Engine requests finished (any reason, failures included).",
    "requests_failed_total": "Engine requests that ended with an error.",
    "kv_tokens_sent_total": "Tokens whose KV a decode instance pulled from this one.",
    "kv_local_prefill_fallbacks_total": "Requests whose KV could not be received and were "
    "prefilled locally instead.",
    "transfer_params_rejected_total": "Transfer params refused (bad signature, unknown or "
    "disallowed peer).",
    "kv_holds_refused_total": "Requests whose KV this prefill instance refused to hold "
    "for a decode instance (its per-client bound).",
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests held but not yet scheduled.",
    "kv_cache_usage": "Fraction of KV-cache blocks in use (0 to 1).",
    "encoder_cache_usage": "Fraction of the encoder cache's budget in use (0 to 1).",
    "kv_blocks_used": "KV-cache blocks referenced by requests.",
    "kv_blocks_cached": "KV-cache blocks kept for prefix reuse with no request on them.",
    "encoder_cache_refs": "References held by requests on encoder-cache entries.",
    "kv_requests_held": "Finished prefill requests whose KV is held for a decode instance to pull.",
    "ec_items_held": "Encoder outputs held for consumers to pull.",
}


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
