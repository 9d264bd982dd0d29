"""Prometheus text exposition written by ``ec_frontend.metrics``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from ec_frontend.metrics import Counter, Histogram, ServerMetrics, parse_text, render


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], {"0.1": 0, "1": 0, "+Inf": 0}),
        ([0.05], {"0.1": 1, "1": 1, "+Inf": 1}),
        ([0.1], {"0.1": 1, "1": 1, "+Inf": 1}),
        ([0.5, 2.0], {"0.1": 0, "1": 1, "+Inf": 2}),
        ([5.0, 0.01, 0.3], {"0.1": 1, "1": 2, "+Inf": 3}),
    ],
)
def test_histogram_buckets_are_cumulative(values: list[float], expected: dict[str, int]) -> None:
    h = Histogram("x_seconds", "help", buckets=(0.1, 1.0))
    for v in values:
        h.observe(v)
    parsed = parse_text("\n".join(h.render()))
    assert {le: parsed[f'x_seconds_bucket{{le="{le}"}}'] for le in expected} == expected
    assert parsed["x_seconds_count"] == len(values)
    assert parsed["x_seconds_sum"] == pytest.approx(sum(values))


@pytest.mark.parametrize(
    ("labels", "line"),
    [
        (("/v1/models", "200"), 'c_total{endpoint="/v1/models",status="200"} 2'),
        (('a"b', "4\\n"), 'c_total{endpoint="a\\"b",status="4\\\\n"} 2'),
    ],
)
def test_counter_labels_escaped(labels: tuple[str, str], line: str) -> None:
    c = Counter("c_total", "help", ("endpoint", "status"))
    c.inc(labels)
    c.inc(labels)
    assert line in list(c.render())


def test_unlabelled_counter_renders_zero() -> None:
    assert list(Counter("z_total", "help").render())[-1] == "z_total 0"


@dataclass(frozen=True)
class FakeStats:
    generation_tokens_total: int = 7
    kv_cache_usage: float = 0.25
    name: str = "ignored"


def test_render_engine_stats_types() -> None:
    text = render(ServerMetrics(), FakeStats())
    assert "# TYPE ec_frontend_generation_tokens_total counter" in text
    assert "# TYPE ec_frontend_kv_cache_usage gauge" in text
    parsed = parse_text(text)
    assert parsed["ec_frontend_generation_tokens_total"] == 7
    assert parsed["ec_frontend_kv_cache_usage"] == 0.25
    assert not any("name" in k for k in parsed)
    assert text.endswith("\n")
