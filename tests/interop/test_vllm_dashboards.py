"""vLLM's own Grafana dashboards, queried against a real server's ``/metrics``.

The dashboards are read at test time from vLLM 0.33's source distribution (unpacked
by ``scripts/setup_vllm.sh`` under the vLLM environment); none is copied into this
repository. Every PromQL expression of every panel names ``vllm:`` series; each of
those must be on the scrape of a mock-engine server (after a few requests) with the
dashboard's ``model_name`` label, histograms as histograms, and every label an
expression groups by present on its series.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..helpers.processes import Proc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SDIST = Path("sdist/vllm-0.33.0/examples/observability")
DASHBOARDS = (
    "prometheus_grafana/grafana.json",
    "dashboards/grafana/performance_statistics.json",
    "dashboards/grafana/query_statistics.json",
)
MODEL = "dash-model"
_SERIES = re.compile(r"vllm:[A-Za-z0-9_:]+")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def exprs(node: Any) -> Iterator[str]:
    """Every ``expr`` string anywhere in a dashboard (panels, rows, nested panels)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from exprs(item)


Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(text: str) -> tuple[Samples, dict[str, str]]:
    """Sample name -> its samples' labels and values; family name -> its TYPE."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        match = _SAMPLE.match(line)
        if match is not None:
            labels = dict(_LABEL.findall(match.group(2) or ""))
            samples.setdefault(match.group(1), []).append((labels, float(match.group(3))))
    return samples, types


@pytest.fixture(scope="module")
def dashboards(vllm_python: Path) -> dict[str, Any]:
    root = vllm_python.parents[1] / SDIST
    return {name: json.loads((root / name).read_text()) for name in DASHBOARDS}


@pytest.fixture(scope="module")
def scraped() -> Iterator[tuple[Samples, dict[str, str]]]:
    server = Proc("serve", ["--mock-engine", "--served-model-name", MODEL], "server")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for max_tokens in (3, 8):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "count the tokens"}],
                max_tokens=max_tokens,
            )
        stream = client.completions.create(
            model=MODEL, prompt="a streamed one", max_tokens=5, stream=True
        )
        assert sum(len(c.choices[0].text) for c in stream) > 0
        yield scrape(httpx.get(server.url + "/metrics", timeout=10.0).text)
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("name", DASHBOARDS)
def test_every_panel_series_exists(
    name: str,
    dashboards: dict[str, Any],
    scraped: tuple[Samples, dict[str, str]],
) -> None:
    samples, types = scraped
    queries = list(exprs(dashboards[name]))
    assert queries, f"{name} has no PromQL expressions"
    needed = {s for q in queries for s in _SERIES.findall(q)}
    assert needed, f"{name} names no vllm: series"
    missing = sorted(s for s in needed if not samples.get(s))
    assert not missing, f"{name}: not on /metrics: {missing}"
    for series in needed:
        assert any(labels.get("model_name") == MODEL for labels, _ in samples[series]), series
        base, _, suffix = series.rpartition("_")
        if suffix in ("bucket", "sum", "count") and base in types:
            assert types[base] == "histogram", series
        if suffix == "bucket":
            assert any(labels.get("le") == "+Inf" for labels, _ in samples[series]), series
    for query in queries:
        grouped = {g.strip() for m in _BY.findall(query) for g in m.split(",") if g.strip()}
        names = _SERIES.findall(query)
        for label in grouped:
            assert any(label in labels for n in names for labels, _ in samples[n]), (label, query)


def test_values_follow_the_requests(scraped: tuple[Samples, dict[str, str]]) -> None:
    """The vLLM-named series count what was sent: three requests, 16 tokens, all cut by
    max_tokens, with the dashboard's model_name."""
    samples, _ = scraped

    def value(name: str, **labels: str) -> float:
        want = {"model_name": MODEL, "engine": "0", **labels}
        found = [v for got, v in samples.get(name, []) if got == want]
        assert len(found) == 1, (name, want, samples.get(name))
        return found[0]

    assert value("vllm:e2e_request_latency_seconds_count") == 3
    assert value("vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 3
    assert value("vllm:time_to_first_token_seconds_count") == 3
    assert value("vllm:request_generation_tokens_sum") == 16
    assert value("vllm:request_params_max_tokens_sum") == 16
    assert value("vllm:request_prompt_tokens_count") == 3
    assert value("vllm:request_success_total", finished_reason="length") == 3
    assert value("vllm:request_success_total", finished_reason="stop") == 0
    assert value("vllm:generation_tokens_total") == 16
    assert value("vllm:prompt_tokens_total") > 0
    assert value("vllm:num_requests_running") == 0
