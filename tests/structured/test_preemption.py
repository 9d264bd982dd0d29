"""Constrained requests through preemption, on the engine with the built-in model.

A KV cache too small for the batch makes the scheduler preempt running requests
(their KV freed, prompt and output recomputed later). A constrained request keeps
its output tokens and its grammar state across that: it resumes where it was, so
its tokens equal those of a run with room for everyone, and its output is valid.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from ec_frontend.config import CacheConfig, EngineConfig, SchedulerConfig
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.structured_output import GrammarCompiler
from ec_frontend.model.loader import load_model, load_processor

from .schemas import random_schema

pytestmark = pytest.mark.slow

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def model(builtin_model_dir: Path) -> Any:
    return load_model(builtin_model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def processor(builtin_model_dir: Path) -> Any:
    return load_processor(builtin_model_dir)


def _engine(
    model: Any, processor: Any, num_kv_blocks: int, max_num_batched_tokens: int = 256
) -> EngineCore:
    config = EngineConfig(
        device="cpu",
        scheduler=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, max_model_len=112
        ),
        cache=CacheConfig(block_size=16, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False),
    )
    return EngineCore(
        config, model, tokenizer=processor.tokenizer, eos_token_id=processor.eos_token_id
    )


def _run(
    core: EngineCore, requests: list[tuple[str, Any, SamplingParams]]
) -> tuple[dict[str, list[int]], dict[str, str], dict[str, int]]:
    """Every request's token ids and finish reason, and how often each constrained
    request was preempted. Checks at every step that a request keeps one grammar
    state and that the state never runs ahead of the request's output."""
    for rid, inputs, params in requests:
        core.add_request(rid, inputs, params)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    finish: dict[str, str] = {}
    preempted: dict[str, int] = {}
    states: dict[str, Any] = {}
    for _ in range(5000):
        if not core.has_work():
            break
        for rid, request in core.scheduler.requests.items():
            if request.grammar is None:
                continue
            assert states.setdefault(rid, request.grammar) is request.grammar
            assert request.grammar.num_consumed <= len(request.output_token_ids)
            preempted[rid] = request.num_preemptions
        for out in core.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finish[out.request_id] = str(out.finish_reason)
    assert not core.has_work()
    return tokens, finish, preempted


def _requests(model: Any, processor: Any, temperature: float) -> tuple[list, list]:
    """Four constrained requests (random JSON schemas) and two free neighbours."""
    eos = processor.eos_token_id
    compiler = GrammarCompiler(
        processor.tokenizer, model.vocab_size, [eos] if isinstance(eos, int) else list(eos)
    )
    schemas = [random_schema(random.Random(500 + i)) for i in range(4)]
    requests = []
    for i in range(6):
        inputs = processor.process_chat(
            [{"role": "user", "content": [{"type": "text", "text": f"item {i} as JSON"}]}], []
        )
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=i)
        if i < len(schemas):
            params.structured_outputs = compiler.compile("json", schemas[i], "p")
        else:
            params.ignore_eos = True  # free neighbours that hold their blocks to the end
        requests.append((f"r{i}", inputs, params))
    return requests, schemas


def _check_valid(processor: Any, schemas: list, got: dict, got_finish: dict) -> None:
    for i, schema in enumerate(schemas):
        rid = f"r{i}"
        assert got_finish[rid] == "stop", (rid, got_finish[rid])
        jsonschema.validate(
            json.loads(processor.tokenizer.decode(got[rid], skip_special_tokens=True)), schema
        )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_requests_survive_preemption(
    model: Any, processor: Any, temperature: float
) -> None:
    requests, schemas = _requests(model, processor, temperature)
    roomy = _engine(model, processor, num_kv_blocks=256)
    want, want_finish, _ = _run(roomy, [(r, x, copy.copy(p)) for r, x, p in requests])
    assert roomy.stats().preemptions_total == 0

    # 6 requests of about 30 prompt tokens and up to 64 output tokens; 10 blocks of
    # 16 tokens (one never handed out) hold one of them at full length and part of another.
    tight = _engine(model, processor, num_kv_blocks=10)
    got, got_finish, preempted = _run(tight, [(r, x, copy.copy(p)) for r, x, p in requests])
    assert tight.stats().preemptions_total > 0
    assert any(preempted[f"r{i}"] > 0 for i in range(len(schemas))), preempted

    assert got == want
    assert got_finish == want_finish
    _check_valid(processor, schemas, got, got_finish)


def test_constrained_requests_with_chunked_prefill(model: Any, processor: Any) -> None:
    """A token budget of 8 splits every prompt into chunks that sample nothing; the
    grammar constrains the first token sampled after the last chunk, and the output
    equals that of whole-prompt prefills."""
    requests, schemas = _requests(model, processor, 1.0)
    whole = _engine(model, processor, num_kv_blocks=256)
    want, want_finish, _ = _run(whole, [(r, x, copy.copy(p)) for r, x, p in requests])

    chunked = _engine(model, processor, num_kv_blocks=256, max_num_batched_tokens=8)
    partial: set[str] = set()
    for rid, inputs, params in requests:
        chunked.add_request(rid, inputs, copy.copy(params))
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    got_finish: dict[str, str] = {}
    for _ in range(5000):
        if not chunked.has_work():
            break
        for out in chunked.step():
            got[out.request_id] += out.token_ids
            if out.finished:
                got_finish[out.request_id] = str(out.finish_reason)
        for rid, request in chunked.scheduler.requests.items():
            if 0 < request.num_computed_tokens < request.num_prompt_tokens:
                partial.add(rid)
                assert not request.output_token_ids
    assert not chunked.has_work()
    assert {f"r{i}" for i in range(len(schemas))} <= partial, partial
    assert got == want
    assert got_finish == want_finish
    _check_valid(processor, schemas, got, got_finish)
