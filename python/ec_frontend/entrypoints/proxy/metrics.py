"""The proxy's Prometheus counters (``/metrics`` on ``ec-frontend proxy``)."""

from __future__ import annotations

from ec_frontend.metrics import PREFIX, Counter, Histogram, exposition, refused_connections


class ProxyMetrics:
    """What the proxy routed, and how often it had to retry or fall back."""

    def __init__(self) -> None:
        self.requests = Counter(
            PREFIX + "proxy_requests_total",
            "Requests answered by the proxy, by endpoint and HTTP status.",
            ("endpoint", "status"),
        )
        self.encoder_requests = Counter(
            PREFIX + "proxy_encoder_requests_total",
            "Per-item encoder requests, by outcome"
            " (ok, failed, no_params, unverified, client_error).",
            ("outcome",),
        )
        self.encoder_retries = Counter(
            PREFIX + "proxy_encoder_retries_total",
            "Encoder requests retried on another encoder.",
        )
        self.encoder_fallbacks = Counter(
            PREFIX + "proxy_encoder_fallbacks_total",
            "Requests sent on without the params of an item no encoder could encode.",
        )
        self.reference_retries = Counter(
            PREFIX + "proxy_reference_retries_total",
            "Requests sent again with their images inline because the instance could not"
            " load an encoded item (the encoder's output was gone).",
        )
        self.prefills = Counter(
            PREFIX + "proxy_prefills_total",
            "Requests whose prompt a prefill instance computed for a decode instance.",
        )
        self.refused = refused_connections()

        self.encode_seconds = Histogram(
            PREFIX + "proxy_encode_seconds",
            "Time from a request's arrival until all its media items were encoded.",
        )
        self.prefill_seconds = Histogram(
            PREFIX + "proxy_prefill_seconds", "Time of the prefill stage of a request."
        )
        self.decode_first_byte_seconds = Histogram(
            PREFIX + "proxy_decode_first_byte_seconds",
            "Time from sending a request to decode until its response headers arrived.",
        )

    def render(self) -> bytes:
        metrics: tuple[Counter | Histogram, ...] = (
            self.requests,
            self.encoder_requests,
            self.encoder_retries,
            self.encoder_fallbacks,
            self.reference_retries,
            self.prefills,
            self.refused,
            self.encode_seconds,
            self.prefill_seconds,
            self.decode_first_byte_seconds,
        )
        return exposition(line for metric in metrics for line in metric.render()).encode()
