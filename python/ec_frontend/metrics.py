"""Prometheus text exposition (format 0.0.4), written without a client library.

The server owns a :class:`ServerMetrics` (request counters, latency
histograms) and renders it together with the engine's own counters and gauges
(``AsyncEngine.stats()``) on ``/metrics``. Every metric name starts with
``ec_frontend_``. Updates happen on the server's event loop, so no locking is
needed; rendering reads a consistent-enough snapshot.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

PREFIX = "ec_frontend_"

#: Seconds; tuned for token latencies from sub-millisecond (mock) to seconds (CPU).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + inner + "}"


class Counter:
    """A monotonically increasing counter, optionally labelled."""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, labels: tuple[str, ...] = ()) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        if not self.labelnames and not self.values:
            yield f"{self.name} 0"
        for labels, value in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, labels)} {_fmt(value)}"


class Histogram:
    """A histogram with fixed upper bounds (seconds), rendered cumulatively."""

    def __init__(
        self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> None:
        self.name = name
        self.help = help_text
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            yield f'{self.name}_bucket{{le="{_fmt(bound)}"}} {running}'
        yield f'{self.name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{self.name}_sum {_fmt(self.sum)}"
        yield f"{self.name}_count {self.count}"


def refused_connections() -> Counter:
    """``http_connections_refused_total{reason}``: connections the HTTP limits closed."""
    return Counter(
        PREFIX + "http_connections_refused_total",
        "Connections closed by the HTTP limits (head size or timeout, URL size, "
        "connection cap), by reason.",
        ("reason",),
    )


#: Images this process decoded and preprocessed into pixel values (native or
#: transformers path); counted by ``model.native_preprocess.count_preprocessed``.
IMAGES_PREPROCESSED = Counter(
    PREFIX + "images_preprocessed_total",
    "Images decoded and preprocessed into pixel values by this instance.",
)


class ServerMetrics:
    """What the HTTP layer measures itself."""

    def __init__(self) -> None:
        self.requests = Counter(
            PREFIX + "requests_total",
            "HTTP requests by endpoint and status code.",
            ("endpoint", "status"),
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last generated token.",
        )
        self.aborted = Counter(
            PREFIX + "requests_aborted_total",
            "Engine requests aborted because the client went away or the server drained.",
        )
        self.refused = refused_connections()
        self.in_flight = 0

    def render(self) -> Iterable[str]:
        yield from self.requests.render()
        yield from self.aborted.render()
        yield from self.refused.render()
        yield from IMAGES_PREPROCESSED.render()
        yield f"# HELP {PREFIX}http_requests_in_flight Generation requests being served."
        yield f"# TYPE {PREFIX}http_requests_in_flight gauge"
        yield f"{PREFIX}http_requests_in_flight {self.in_flight}"
        yield from self.ttft.render()
        yield from self.itl.render()
        yield from self.e2e.render()


def stats_items(stats: Any) -> list[tuple[str, float]]:
    """Flatten an engine stats object (a dataclass or a mapping) to numeric pairs.

    Non-numeric fields are skipped; booleans count as 0 / 1.
    """
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        raw: Mapping[str, Any] = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    elif isinstance(stats, Mapping):
        raw = stats
    else:
        raw = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    return [(k, float(v)) for k, v in raw.items() if isinstance(v, int | float)]


def render_engine_stats(stats: Any) -> Iterable[str]:
    """Engine counters (fields ending in ``_total``) and gauges (every other field)."""
    for key, value in stats_items(stats):
        name = PREFIX + key
        kind = "counter" if key.endswith("_total") else "gauge"
        yield f"# HELP {name} Engine statistic {key}."
        yield f"# TYPE {name} {kind}"
        yield f"{name} {_fmt(value)}"


def exposition(lines: Iterable[str]) -> str:
    """Exposition text from rendered lines: each ends with a newline, the last one too."""
    return "\n".join(lines) + "\n"


def render(server: ServerMetrics, engine_stats: Any | None) -> str:
    """The full exposition text for ``/metrics``."""
    lines = list(server.render())
    if engine_stats is not None:
        lines.extend(render_engine_stats(engine_stats))
    return exposition(lines)


def parse_text(text: str) -> dict[str, float]:
    """Parse exposition text into ``{"name{labels}": value}`` (for tests and benches)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out
