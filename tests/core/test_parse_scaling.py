"""Parsing is linear in the body: doubling any list or map field of a request at most
about doubles the time of ``parse_request`` plus reading the field's result.

Each case builds real JSON bodies whose one field has N, 2N and 4N entries and times
parse + read against a reference measured in the same rounds: CPython's
``json.loads`` of the same bodies, a linear parser that builds the same kind of
Python objects. On a shared machine, building a few hundred thousand objects costs
more per object as they stop fitting the caches (about 2.3-2.6x per doubling for a
plain dict comprehension here), so each doubling's ratio is scaled by the
reference's (``ratio * 2 / reference ratio``) and must stay under ``MAX_RATIO``. A
quadratic spot (a duplicate check by linear scan, a key lookup per member) costs
about 4x per doubling and fails.

Against noise: the time is the thread's CPU time (waiting for a core does not count),
each sample repeats the parse to last about ``SAMPLE_S``, the best of ``REPEATS``
interleaved rounds counts, and a case that fails is measured again (``ATTEMPTS`` in
all; a quadratic case fails every time).
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ec_frontend as ecf
import pytest

# About a minute on an idle machine (a few on a busy one): marked slow, still run in CI.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

MAX_RATIO = 2.5
REPEATS = 5
SAMPLE_S = 0.02
ATTEMPTS = 4
BUDGET_S = 10.0

USER = {"role": "user", "content": "hi"}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def _tool(i: int, flat: bool = False) -> dict[str, Any]:
    function = {
        "name": f"tool_{i}",
        "description": "d",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    }
    return {"type": "function", **function} if flat else {"type": "function", "function": function}


def _generate(n_ids: int = 4, **fields: Any) -> dict[str, Any]:
    return {"token_ids": list(range(n_ids)), **fields}


def _structural_tag(n: int) -> dict[str, Any]:
    # Every begin starts with the last trigger: a scan of the triggers per structure
    # walks all of them.
    return {
        "type": "structural_tag",
        "triggers": [f"<t{i}>" for i in range(n)],
        "structures": [
            {"begin": f"<t{n - 1}>{i}", "schema": {"type": "object"}, "end": "</t>"}
            for i in range(n)
        ],
    }


@dataclass(frozen=True)
class Case:
    """One field: its endpoint, a body with the field at length ``n``, the size of N."""

    endpoint: str
    body: Callable[[int], dict[str, Any]]
    base: int
    #: Reads the field's result; returns something to check against ``n``.
    read: Callable[[Any], Any] = lambda parsed: None
    #: The expected result of ``read`` at length ``n`` (``None``: not checked).
    expect: Callable[[int], Any] | None = None
    #: The ``param`` of the expected ``RequestError`` (a body the parser refuses
    #: after reading the whole field, e.g. more stop strings than allowed).
    error_param: str | None = None
    limits: dict[str, int] = field(default_factory=dict)


def _sampling(key: str) -> Callable[[Any], Any]:
    return lambda parsed: parsed.sampling[key]


def _len_sampling(key: str) -> Callable[[Any], Any]:
    return lambda parsed: len(parsed.sampling[key])


CASES: dict[str, Case] = {
    "bad_words": Case(
        "chat",
        lambda n: _chat(bad_words=[f"w{i}" for i in range(n)]),
        12_500,
        _len_sampling("bad_words"),
        lambda n: n,
    ),
    "bad_words_repeated": Case(
        "chat",
        lambda n: _chat(bad_words=[f"w{i % 100}" for i in range(n)]),
        50_000,
        _len_sampling("bad_words"),
        lambda n: 100,
    ),
    "tools": Case(
        "chat",
        lambda n: _chat(tools=[_tool(i) for i in range(n)]),
        10_000,
        lambda parsed: len(parsed.structured["tools"]),
        lambda n: n,
    ),
    "tools_responses": Case(
        "responses",
        lambda n: {"input": "hi", "tools": [_tool(i, flat=True) for i in range(n)]},
        10_000,
        lambda parsed: len(parsed.structured["tools"]),
        lambda n: n,
    ),
    "tool_choice_named_last": Case(
        "chat",
        lambda n: _chat(
            tools=[_tool(i) for i in range(n)],
            tool_choice={"type": "function", "function": {"name": f"tool_{n - 1}"}},
        ),
        10_000,
        lambda parsed: parsed.structured["tool_name"],
        lambda n: f"tool_{n - 1}",
    ),
    "messages": Case(
        "chat",
        lambda n: {"messages": [{"role": "user", "content": f"m{i}"} for i in range(n)]},
        40_000,
        lambda parsed: len(parsed.messages),
        lambda n: n,
        limits={"max_messages": 1 << 30},
    ),
    "messages_over_limit": Case(
        "chat",
        lambda n: {"messages": [{"role": "user", "content": f"m{i}"} for i in range(n)]},
        100_000,
        error_param="messages",
    ),
    "tool_calls": Case(
        "chat",
        lambda n: {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": f"c{i}",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                        for i in range(n)
                    ],
                },
            ]
        },
        10_000,
        lambda parsed: len(parsed.messages[1]["tool_calls"]),
        lambda n: n,
    ),
    "content_parts": Case(
        "chat",
        lambda n: {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": f"p{i}"} for i in range(n)]}
            ]
        },
        30_000,
        lambda parsed: len(parsed.messages[0]["content"]),
        lambda n: n,
    ),
    "content_parts_images": Case(
        "chat",
        lambda n: {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"https://x.test/{i}.png"}}
                        for i in range(n)
                    ],
                }
            ]
        },
        12_500,
        lambda parsed: len(parsed.media),
        lambda n: n,
        limits={"max_media_items": 1 << 30},
    ),
    "responses_input": Case(
        "responses",
        lambda n: {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": f"m{i}"}]}
                for i in range(n)
            ]
        },
        12_500,
        lambda parsed: len(parsed.messages),
        lambda n: n,
        limits={"max_messages": 1 << 30},
    ),
    "include": Case(
        "responses",
        lambda n: {"input": "hi", "include": ["message.output_text.logprobs"] * n},
        150_000,
    ),
    "stop": Case(
        "chat",
        lambda n: _chat(stop=[f"s{i}" for i in range(n)]),
        200_000,
        error_param="stop",
    ),
    "stop_token_ids": Case(
        "chat",
        lambda n: _chat(stop_token_ids=list(range(n))),
        150_000,
        _len_sampling("stop_token_ids"),
        lambda n: n,
    ),
    "allowed_token_ids": Case(
        "chat",
        lambda n: _chat(allowed_token_ids=list(range(n))),
        150_000,
        _len_sampling("allowed_token_ids"),
        lambda n: n,
    ),
    "logit_bias": Case(
        "chat",
        lambda n: _chat(logit_bias={str(i): 1.0 for i in range(n)}),
        50_000,
        _len_sampling("logit_bias"),
        lambda n: n,
    ),
    "choice": Case(
        "chat",
        lambda n: _chat(structured_outputs={"choice": [f"c{i}" for i in range(n)]}),
        100_000,
        lambda parsed: len(parsed.structured["constraint"]["spec"]),
        lambda n: n,
    ),
    "response_format_schema": Case(
        "chat",
        lambda n: _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "s",
                    "schema": {
                        "type": "object",
                        "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                    },
                },
            }
        ),
        20_000,
        lambda parsed: len(parsed.structured["constraint"]["spec"]["properties"]),
        lambda n: n,
    ),
    "structural_tag": Case(
        "chat",
        lambda n: _chat(response_format=_structural_tag(n)),
        10_000,
        lambda parsed: len(parsed.structured["constraint"]["spec"]["structures"]),
        lambda n: n,
    ),
    "structural_tag_text": Case(
        "chat",
        lambda n: _chat(structured_outputs={"structural_tag": json.dumps(_structural_tag(n))}),
        10_000,
        lambda parsed: len(parsed.structured["constraint"]["spec"]["triggers"]),
        lambda n: n,
    ),
    "vllm_xargs": Case(
        "chat",
        lambda n: _chat(
            vllm_xargs={f"k{i}": i for i in range(n)}, kv_transfer_params={"do_remote_decode": True}
        ),
        50_000,
        lambda parsed: len(parsed.sampling["extra_args"]),
        lambda n: n + 1,
    ),
    "kv_transfer_params": Case(
        "chat",
        lambda n: _chat(kv_transfer_params={f"k{i}": i for i in range(n)}),
        50_000,
        lambda parsed: len(parsed.kv_transfer_params),
        lambda n: n,
    ),
    "ec_transfer_params": Case(
        "chat",
        lambda n: _chat(ec_transfer_params={f"k{i}": i for i in range(n)}),
        50_000,
        lambda parsed: len(parsed.ec_transfer_params),
        lambda n: n,
    ),
    "mm_processor_kwargs": Case(
        "chat",
        lambda n: {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a"}}],
                }
            ],
            "mm_processor_kwargs": {f"k{i}": i for i in range(n)},
        },
        30_000,
        lambda parsed: len(parsed.mm_processor_kwargs),
        lambda n: n,
    ),
    "chat_template_kwargs": Case(
        "chat",
        lambda n: _chat(chat_template_kwargs={f"k{i}": i for i in range(n)}),
        50_000,
        lambda parsed: len(parsed.chat_template_kwargs),
        lambda n: n,
    ),
    "unknown_fields": Case(
        "chat",
        lambda n: {**_chat(), **{f"x{i}": i for i in range(n)}},
        125_000,
        lambda parsed: len(parsed.unknown_fields),
        lambda n: 64,
    ),
    "metadata": Case(
        "chat",
        lambda n: _chat(metadata={f"k{i}": "v" for i in range(n)}),
        200_000,
        lambda parsed: parsed.unknown_fields,
        lambda n: ["metadata"],
    ),
    "stream_options": Case(
        "chat",
        lambda n: _chat(stream=True, stream_options={f"k{i}": i for i in range(n)}),
        200_000,
    ),
    "prompt_strings": Case(
        "completions",
        lambda n: {"prompt": [f"p{i}" for i in range(n)]},
        100_000,
        lambda parsed: len(parsed.prompts),
        lambda n: n,
    ),
    "prompt_token_lists": Case(
        "completions",
        lambda n: {"prompt": [[1, 2, 3] for _ in range(n)]},
        40_000,
        lambda parsed: len(parsed.prompts),
        lambda n: n,
    ),
    "token_ids": Case(
        "generate",
        lambda n: _generate(n),
        125_000,
        lambda parsed: len(parsed.token_ids),
        lambda n: n,
    ),
    "generate_extra_args_and_xargs": Case(
        "generate",
        lambda n: _generate(
            sampling_params={"extra_args": {f"e{i}": i for i in range(n)}},
            vllm_xargs={f"x{i}": i for i in range(n)},
        ),
        20_000,
        lambda parsed: len(parsed.sampling["extra_args"]),
        lambda n: 2 * n,
    ),
    "features_flat": Case(
        "generate",
        lambda n: _generate(
            2 * n,
            features={
                "mm_hashes": ["ab"] * n,
                "mm_placeholders": [{"offset": 2 * i, "length": 1} for i in range(n)],
                "mm_grid_thw": [[1, 2, 2]] * n,
            },
        ),
        12_500,
        lambda parsed: len(parsed.features["mm_hashes"]),
        lambda n: n,
    ),
    "features_image": Case(
        "generate",
        lambda n: _generate(
            2 * n,
            features={
                "mm_hashes": {"image": ["ab"] * n},
                "mm_placeholders": {"image": [{"offset": 2 * i, "length": 1} for i in range(n)]},
                "mm_grid_thw": {"image": [[1, 2, 2]] * n},
            },
        ),
        12_500,
        lambda parsed: len(parsed.features["mm_hashes"]),
        lambda n: n,
    ),
    "features_modalities": Case(
        "generate",
        # As many modalities in each map, in opposite orders: a key-by-key scan of the
        # other map walks it whole. Refused (only images), after the maps are compared.
        lambda n: _generate(
            features={
                "mm_hashes": {f"m{i}": [] for i in range(n)},
                "mm_placeholders": {f"m{i}": [] for i in reversed(range(n))},
                "mm_metadata": {f"m{i}": [] for i in reversed(range(n))},
            },
        ),
        20_000,
        error_param="features.mm_hashes.m0",
    ),
}


def _runner(case: Case, n: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """Parses the body with the field at length ``n`` and checks the outcome; and the
    reference: ``json.loads`` of the same body."""
    body = json.dumps(case.body(n)).encode()
    limits = ecf.Limits(**case.limits) if case.limits else None

    def run() -> None:
        try:
            parsed = ecf.parse_request(case.endpoint, body, model_id="m", limits=limits)
        except ecf.RequestError as e:
            if case.error_param is None:
                raise
            assert e.param == case.error_param
            return
        assert case.error_param is None, f"{case.error_param} was not refused"
        got = case.read(parsed)
        if case.expect is not None:
            assert got == case.expect(n)

    return run, lambda: json.loads(body)


def _cpu_time(fn: Callable[[], None], times: int) -> float:
    start = time.thread_time()
    for _ in range(times):
        fn()
    return time.thread_time() - start


def _timings(case: Case, sizes: list[int]) -> tuple[list[float], list[float]]:
    """Best CPU time per size of ``REPEATS`` interleaved rounds, in seconds per parse,
    for the parser and for the reference. Once two sizes have a time, no run starts
    past ``BUDGET_S`` of wall time (a quadratic parser takes seconds per run): the
    sizes left are ``inf``."""
    runs = [_runner(case, n) for n in sizes]
    ours = [float("inf")] * len(sizes)
    ref = [float("inf")] * len(sizes)
    was_enabled = gc.isenabled()
    gc.disable()
    began = time.perf_counter()
    try:
        first = _cpu_time(runs[0][0], 1)
        times = max(1, math.ceil(SAMPLE_S / max(first, 1e-6)))
        for _ in range(REPEATS):
            for i, (run, reference) in enumerate(runs):
                if i >= 2 and time.perf_counter() - began > BUDGET_S:
                    return ours, ref
                ours[i] = min(ours[i], _cpu_time(run, times) / times)
                ref[i] = min(ref[i], _cpu_time(reference, times) / times)
            if time.perf_counter() - began > BUDGET_S:
                break
    finally:
        if was_enabled:
            gc.enable()
    return ours, ref


def _ms(sizes: list[int], times: list[float]) -> str:
    return ", ".join(f"{n}: {t * 1e3:.2f} ms" for n, t in zip(sizes, times, strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_doubling_a_field_at_most_doubles_the_time(name: str) -> None:
    case = CASES[name]
    sizes = [case.base, 2 * case.base, 4 * case.base]
    for attempt in range(1, ATTEMPTS + 1):
        ours, ref = _timings(case, sizes)
        ratios = [b / a for a, b in itertools.pairwise(ours)]
        ref_ratios = [b / a for a, b in itertools.pairwise(ref)]
        scaled = [r * 2 / rr for r, rr in zip(ratios, ref_ratios, strict=True)]
        shown = (
            f"{_ms(sizes, ours)}; ratios {[round(r, 2) for r in ratios]}, json.loads "
            f"{[round(r, 2) for r in ref_ratios]}, scaled {[round(r, 2) for r in scaled]}"
        )
        print(f"{name} (attempt {attempt}): {shown}")
        if max(scaled) <= MAX_RATIO:
            return
        if max(ours) == float("inf"):
            break
    pytest.fail(f"{name} grows faster than linearly ({attempt} attempts): {shown}")
