"""vLLM 0.33's metric names on ``/metrics``, beside the ``ec_frontend_*`` ones.

vLLM's dashboards (its ``examples/observability`` Grafana JSON) query series named
``vllm:<name>`` with a ``model_name`` label (the first served model name) and an
``engine`` label (the engine index; always ``"0"`` here: one engine per server).
For what both servers measure, this module exports the same values under those
names, types and label sets, so such a dashboard can be pointed at an
ec-frontend instance unchanged. What vLLM has and ec-frontend does not measure
(speculative decoding, LoRA, KV offload tiers, ...) is not exported.

Two sources feed it:

* :class:`VLLMRequestMetrics`: the per-request histograms and the finish-reason
  counter, observed by the HTTP server when an engine request ends. The server
  sees arrival, the hand-off to the engine, the first and the last token; the
  phases are measured from those (each HELP text says from which).
* :func:`render_engine_stats`: the engine's own counters and gauges (an
  ``EngineStats`` snapshot) under vLLM's names.

Values are shared across a group of API server processes the way
:mod:`ec_frontend.metrics` shares its own (the histograms and counters write to
the process's shared file).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ec_frontend.metrics import LATENCY_BUCKETS, Counter, Histogram, Snapshot, _fmt, _labels

PREFIX = "vllm:"
#: vLLM's finish reasons, each exported from the start (0 until one happens).
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")

#: Engine statistic -> (vLLM name, type, HELP text). Counters keep the
#: ``_total`` suffix Prometheus' text format gives them.
_ENGINE_SERIES: tuple[tuple[str, str, str, str], ...] = (
    (
        "num_requests_running",
        "num_requests_running",
        "gauge",
        "Requests in the engine's running batch (scheduled for model execution).",
    ),
    (
        "num_requests_waiting",
        "num_requests_waiting",
        "gauge",
        "Requests the engine holds but has not scheduled yet (waiting for KV cache "
        "space, a batch slot or a KV/EC transfer).",
    ),
    (
        "kv_cache_usage",
        "kv_cache_usage_perc",
        "gauge",
        "Fraction of KV-cache blocks in use (1 means 100 percent).",
    ),
    (
        "prefix_cache_queries_total",
        "prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache when requests were scheduled.",
    ),
    (
        "prefix_cache_hits_total",
        "prefix_cache_hits_total",
        "counter",
        "Prompt tokens found in the prefix cache (not recomputed).",
    ),
    (
        "preemptions_total",
        "num_preemptions_total",
        "counter",
        "Times the engine preempted a running request to free KV-cache blocks.",
    ),
    (
        "prompt_tokens_computed_total",
        "prompt_tokens_total",
        "counter",
        "Prompt tokens the engine computed in prefill (prefix-cache hits and KV "
        "received from a prefill instance excluded).",
    ),
    (
        "generation_tokens_total",
        "generation_tokens_total",
        "counter",
        "Tokens the engine generated (sampled), all requests together.",
    ),
)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        scale *= 10


class VLLMRequestMetrics:
    """Per-request series under vLLM's names, observed by the HTTP server."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        labels = (("model_name", model_name), ("engine", "0"))
        self._label_values = (model_name, "0")
        tokens = token_buckets(max(max_model_len, 1))

        def hist(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, help_text, buckets, const_labels=labels)

        self.ttft = hist(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival at the HTTP server to its first generated token.",
            LATENCY_BUCKETS,
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one request (a delta of k "
            "tokens counts k gaps of its time / k).",
            LATENCY_BUCKETS,
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Per finished request: seconds from its first to its last token divided by its "
            "generated tokens after the first.",
            LATENCY_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Per finished request: seconds from arrival at the HTTP server to its last token.",
            LATENCY_BUCKETS,
        )
        self.queue = hist(
            "request_queue_time_seconds",
            "Per finished request: seconds from arrival at the HTTP server to its hand-off "
            "to the engine (parsing, media fetch, preprocessing and the server's admission).",
            LATENCY_BUCKETS,
        )
        self.inference = hist(
            "request_inference_time_seconds",
            "Per finished request: seconds from its hand-off to the engine to its last token.",
            LATENCY_BUCKETS,
        )
        self.prefill = hist(
            "request_prefill_time_seconds",
            "Per finished request: seconds from its hand-off to the engine to its first "
            "token (engine queueing, encoder, EC/KV transfers and prefill).",
            LATENCY_BUCKETS,
        )
        self.decode = hist(
            "request_decode_time_seconds",
            "Per finished request: seconds from its first to its last token.",
            LATENCY_BUCKETS,
        )
        self.prompt_tokens = hist(
            "request_prompt_tokens",
            "Per finished request: prompt length in tokens (cached ones included).",
            tokens,
        )
        self.generation_tokens = hist(
            "request_generation_tokens",
            "Per finished request: tokens generated.",
            tokens,
        )
        self.max_generation_tokens = hist(
            "request_max_num_generation_tokens",
            "Per finished engine request: tokens generated (vLLM takes the largest of a "
            "parallel-sampling group; here each choice of n counts on its own).",
            tokens,
        )
        self.max_tokens_param = hist(
            "request_params_max_tokens",
            "Per finished request that set it: the max_tokens sampling parameter.",
            tokens,
        )
        self.success = Counter(
            PREFIX + "request_success_total",
            "Finished engine requests by finish reason (stop, length, abort, error).",
            ("model_name", "engine", "finished_reason"),
        )
        for reason in FINISH_REASONS:
            self.success.inc((model_name, "0", reason), 0.0)

    def finished(
        self,
        *,
        arrived: float,
        handed_off: float,
        first_token: float,
        last_token: float,
        prompt_tokens: int,
        generated: int,
        finish_reason: str | None,
        max_tokens: int | None,
    ) -> None:
        """Observe one finished engine request (``perf_counter`` times).

        ``first_token`` and ``last_token`` equal ``handed_off`` when nothing was generated.
        """
        self.e2e.observe(last_token - arrived)
        self.queue.observe(handed_off - arrived)
        self.inference.observe(last_token - handed_off)
        self.prefill.observe(first_token - handed_off)
        self.decode.observe(last_token - first_token)
        if generated > 1:
            self.tpot.observe((last_token - first_token) / (generated - 1))
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generated)
        self.max_generation_tokens.observe(generated)
        if max_tokens is not None:
            self.max_tokens_param.observe(max_tokens)
        self.success.inc((*self._label_values, finish_reason or "stop"))

    def render(self, snapshot: Snapshot | None = None) -> Iterable[str]:
        """The exposition lines (this process's, or the group's from ``snapshot``)."""
        yield from self.success.render(snapshot)
        for hist in (
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue,
            self.inference,
            self.prefill,
            self.decode,
            self.prompt_tokens,
            self.generation_tokens,
            self.max_generation_tokens,
            self.max_tokens_param,
        ):
            yield from hist.render(snapshot)


def render_engine_stats(stats: Any, model_name: str) -> Iterable[str]:
    """The engine's counters and gauges that vLLM also has, under vLLM's names."""
    labels = _labels(("model_name", "engine"), (model_name, "0"))
    for field, name, kind, help_text in _ENGINE_SERIES:
        value = getattr(stats, field, None)
        if not isinstance(value, int | float):
            continue
        full = PREFIX + name
        yield f"# HELP {full} {help_text}"
        yield f"# TYPE {full} {kind}"
        yield f"{full}{labels} {_fmt(float(value))}"
    steps = getattr(stats, "engine_steps_total", None)
    if isinstance(steps, int):
        tokens = getattr(stats, "prompt_tokens_computed_total", 0) + getattr(
            stats, "generation_tokens_total", 0
        )
        name = PREFIX + "iteration_tokens_total"
        inner = labels[1:-1]
        yield (
            f"# HELP {name} Tokens computed per engine step (prompt and generated): the "
            "count is the engine's steps, the sum their tokens; the engine keeps no "
            "per-step distribution, so only the +Inf bucket is exported."
        )
        yield f"# TYPE {name} histogram"
        yield f'{name}_bucket{{{inner},le="+Inf"}} {steps}'
        yield f"{name}_sum{labels} {_fmt(float(tokens))}"
        yield f"{name}_count{labels} {steps}"
