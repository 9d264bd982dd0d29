"""``vllm bench serve`` (vLLM 0.33.0's own benchmark client) against ``ec-frontend serve``.

The client marks a request failed when its stream never yields a chunk it can
time as the first token, when a Responses stream has no terminal event, or on
any HTTP or stream error. Against the built-in model, whose random weights
often sample special or padding tokens with no text, every streamed API must
still give 0 failed requests: one chunk per engine step that generated tokens,
as vLLM shapes them. The client also aligns its prompts through ``/tokenize``
and ``/detokenize`` (it names the model by the ``root`` of ``/v1/models``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ..helpers.processes import Proc
from .conftest import run_vllm

#: The first test also runs the driver (vLLM's import alone takes 15-30 s on a cold disk).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_PROMPTS = 40
CONCURRENCY = 8
DRIVER = Path(__file__).with_name("bench_driver.py")
#: One small image per request (the built-in model's vision tower runs on the CPU).
MM_ARGS = [
    "--dataset-name", "random-mm",
    "--random-mm-base-items-per-request", "1",
    "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
    "--random-mm-bucket-config", "{(64, 64, 1): 1.0}",
]  # fmt: skip
RUNS: dict[str, list[str]] = {
    "chat-random": ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                    "--dataset-name", "random"],
    "completions-random": ["--backend", "openai", "--endpoint", "/v1/completions",
                           "--dataset-name", "random"],
    "responses-random": ["--backend", "openai-responses", "--endpoint", "/v1/responses",
                         "--dataset-name", "random"],
    "chat-random-mm": ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                       *MM_ARGS],
}  # fmt: skip


@pytest.fixture(scope="module")
def bench(
    vllm_python: Path, model_server: Proc, builtin_model_dir: Path, tmp_path_factory: Any
) -> tuple[dict[str, dict[str, Any]], str]:
    """Every run of :data:`RUNS` in one driver process: vLLM's result JSON per run, and
    the driver's output."""
    out = tmp_path_factory.mktemp("vllm-bench")
    common = [
        "--base-url", model_server.url,
        "--tokenizer", str(builtin_model_dir),
        "--num-prompts", str(NUM_PROMPTS),
        "--max-concurrency", str(CONCURRENCY),
        "--random-input-len", "64",
        "--random-output-len", "128",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir", str(out),
    ]  # fmt: skip
    runs = [
        {"name": name, "argv": [*args, *common, "--result-filename", f"{name}.json"]}
        for name, args in RUNS.items()
    ]
    spec = out / "runs.json"
    spec.write_text(json.dumps(runs))
    proc = run_vllm(vllm_python, [str(DRIVER), str(spec)], timeout=600, cwd=out)
    output = proc.stdout + proc.stderr
    results = {}
    for name in RUNS:
        path = out / f"{name}.json"
        if path.is_file():
            results[name] = json.loads(path.read_text())
    return results, output


@pytest.mark.parametrize("name", list(RUNS))
def test_bench_serve_has_no_failed_requests(
    bench: tuple[dict[str, dict[str, Any]], str], name: str
) -> None:
    results, output = bench
    result = results.get(name)
    assert result is not None, f"vllm bench serve wrote no result for {name}:\n{output[-6000:]}"
    errors = sorted({e for e in result["errors"] if e})
    assert result["failed"] == 0, f"{result['failed']} failed requests: {errors[:3]}"
    assert result["completed"] == NUM_PROMPTS
    assert result["total_output_tokens"] > 0
    assert all(t > 0 for t in result["ttfts"])


def test_bench_serve_aligns_prompts_through_tokenize(
    bench: tuple[dict[str, dict[str, Any]], str],
) -> None:
    _, output = bench
    assert "=== chat-random" in output
    assert "/tokenize unavailable" not in output
    assert "/tokenize probe failed" not in output
