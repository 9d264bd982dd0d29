"""The proxy's Prometheus counters (``/metrics`` on ``ec-frontend proxy``)."""

from __future__ import annotations

from collections.abc import Iterable

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
        self.routed = Counter(
            PREFIX + "proxy_routed_total",
            "Requests the routing policy sent to an instance (fallbacks included),"
            " by role, instance and policy.",
            ("role", "instance", "policy"),
        )
        self.affinity_hits = Counter(
            PREFIX + "proxy_affinity_hits_total",
            "Routed requests that went to their key's own instance (the first in its"
            " rendezvous order among the live ones), by role, instance and policy.",
            ("role", "instance", "policy"),
        )
        self.reroutes = Counter(
            PREFIX + "proxy_reroutes_total",
            "Requests sent on to the next instance of a role because one failed.",
            ("role",),
        )
        self.ejections = Counter(
            PREFIX + "proxy_ejections_total",
            "Instances taken out of rotation after failing --fail-threshold times in a row.",
            ("role", "instance"),
        )
        #: Requests in flight from this proxy per ``(role, instance)``: the routing load.
        self.in_flight: dict[tuple[str, str], int] = {}
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

    def render_in_flight(self) -> Iterable[str]:
        name = PREFIX + "proxy_in_flight"
        yield f"# HELP {name} Requests in flight from this proxy, by role and instance."
        yield f"# TYPE {name} gauge"
        for (role, instance), value in sorted(self.in_flight.items()):
            yield f'{name}{{role="{role}",instance="{instance}"}} {value}'

    def render(self) -> bytes:
        metrics: tuple[Counter | Histogram, ...] = (
            self.requests,
            self.encoder_requests,
            self.encoder_retries,
            self.encoder_fallbacks,
            self.reference_retries,
            self.prefills,
            self.routed,
            self.affinity_hits,
            self.reroutes,
            self.ejections,
            self.refused,
            self.encode_seconds,
            self.prefill_seconds,
            self.decode_first_byte_seconds,
        )
        lines = [line for metric in metrics for line in metric.render()]
        return exposition([*lines, *self.render_in_flight()]).encode()
