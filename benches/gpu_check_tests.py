"""Tests that need a CUDA device, run by ``gpu_check.sh`` (not collected by the CPU
suite, whose ``testpaths`` is ``tests/``): the attention backends on CUDA (the
Triton kernel compiled, not interpreted), the engine on CUDA against the engine on
the CPU, and the KV cache sized from the device's memory."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from ec_frontend.config import CacheConfig, EngineConfig, SchedulerConfig
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.model.builtin import ensure_builtin_checkpoint
from ec_frontend.model.loader import load_model, load_processor
from ec_frontend.model.paged_attention import BACKENDS, build_layout, paged_attention, write_kv

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.device("cuda")


def _attention_tests() -> ModuleType:
    """``tests/model/test_attention_paths.py``: its random step builder."""
    path = ROOT / "tests" / "model" / "test_attention_paths.py"
    spec = importlib.util.spec_from_file_location("attention_paths", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["attention_paths"] = module
    spec.loader.exec_module(module)
    return module


def test_cuda_is_there() -> None:
    assert torch.cuda.is_available(), "this check needs a CUDA device"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("ratio", [1, 2, 7])
def test_backends_on_cuda_equal_the_gather_path(block_size: int, ratio: int) -> None:
    paths = _attention_tests()
    rng = random.Random(block_size * 10 + ratio)
    torch.manual_seed(block_size + ratio)
    scale = paths.HEAD_DIM**-0.5
    for _ in range(8):
        meta, query, key, value, cache = paths._step(rng, block_size, ratio)
        meta.query_start_loc, meta.seq_lens, meta.query_lens = (
            meta.query_start_loc.to(CUDA),
            meta.seq_lens.to(CUDA),
            meta.query_lens.to(CUDA),
        )
        meta.block_tables, meta.slot_mapping = (
            meta.block_tables.to(CUDA),
            meta.slot_mapping.to(CUDA),
        )
        query, key, value, cache = (t.to(CUDA) for t in (query, key, value, cache))
        write_kv(cache, key, value, meta.slot_mapping)
        want = paged_attention(query, key, value, cache, build_layout(meta, CUDA, "gather"), scale)
        for backend in BACKENDS:
            got = paged_attention(
                query, key, value, cache, build_layout(meta, CUDA, backend), scale
            )
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=backend)


def _greedy_tokens(
    device: str, backend: str = "sdpa", *, eager: bool = True, stagger: bool = False
) -> tuple[list[list[int]], Any]:
    """Greedy tokens of a few prompts (float32) and the engine's stats. ``eager``
    False lets the engine capture decode graphs (with the triton backend);
    ``stagger`` adds one request per step, so decode batches of many sizes replay."""
    path = ensure_builtin_checkpoint()
    processor = load_processor(path)
    model = load_model(path, device=device, dtype="float32", attention_backend=backend)
    config = EngineConfig(
        model=str(path),
        device=device,
        scheduler=SchedulerConfig(max_num_seqs=12, max_model_len=512),
        cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20, enforce_eager=eager),
    )
    core = EngineCore(config, model)
    texts = ["A story about a lighthouse.", "Count to twenty.", "Name three colours."]
    if stagger:
        texts += [f"Item {i}: describe a {w}." for i, w in enumerate(("cat", "dog", "fox"))]
    pending = [
        (f"r{i}", processor.process_prompt(text),
         SamplingParams(max_tokens=24 + 4 * i, temperature=0.0, ignore_eos=True))
        for i, text in enumerate(texts)
    ]  # fmt: skip
    if not stagger:
        for request in pending:
            core.add_request(*request)
        pending = []
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(texts))}
    while pending or core.has_work():
        if pending:
            core.add_request(*pending.pop(0))
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    return [tokens[f"r{i}"] for i in range(len(texts))], core.stats()


def test_engine_on_cuda_matches_the_cpu() -> None:
    assert _greedy_tokens("cuda")[0] == _greedy_tokens("cpu")[0]


def test_triton_decode_in_the_engine() -> None:
    assert _greedy_tokens("cuda", "triton")[0] == _greedy_tokens("cuda", "sdpa")[0]


def test_cuda_graphs_of_decode_steps_give_the_eager_tokens() -> None:
    graphed, stats = _greedy_tokens("cuda", "triton", eager=False, stagger=True)
    eager, eager_stats = _greedy_tokens("cuda", "triton", stagger=True)
    assert graphed == eager
    assert eager_stats.lm_graph_replays_total == 0
    assert 0 < stats.lm_graph_replays_total < stats.lm_forward_calls_total


def test_auto_backend_on_cuda_captures_decode_graphs() -> None:
    path = ensure_builtin_checkpoint()
    model = load_model(path, device="cuda", dtype="bfloat16")
    assert model.language.attention_backend == "triton"
    core = EngineCore(
        EngineConfig(
            model=str(path),
            device="cuda",
            scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512),
            cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20),
        ),
        model,
    )
    graphs = core.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    assert core.runner.kv_caches[0].shape[1] == core.kv_cache.num_blocks + 1


def test_kv_cache_sized_from_device_memory() -> None:
    path = ensure_builtin_checkpoint()
    model = load_model(path, device="cuda", dtype="bfloat16")
    core = EngineCore(
        EngineConfig(model=str(path), device="cuda", cache=CacheConfig(gpu_memory_utilization=0.3)),
        model,
    )
    _, total = torch.cuda.mem_get_info()
    per_block = model.kv_cache_spec().bytes_per_block(core.config.cache.block_size)
    assert core.kv_cache is not None
    # The pool takes about 0.3 of the device, less what the weights and profile hold.
    assert 0.2 * total < core.kv_cache.num_blocks * per_block <= 0.3 * total
