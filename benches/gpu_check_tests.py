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

import pytest
import torch
from ec_frontend.engine.config import CacheConfig, EngineConfig
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


def _greedy_tokens(device: str, backend: str = "sdpa") -> list[list[int]]:
    path = ensure_builtin_checkpoint()
    processor = load_processor(path)
    model = load_model(path, device=device, dtype="float32")
    model.language.attention_backend = backend
    config = EngineConfig(
        model=str(path), device=device, cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20)
    )
    core = EngineCore(config, model)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    texts = ["A story about a lighthouse.", "Count to twenty.", "Name three colours."]
    for i, text in enumerate(texts):
        core.add_request(f"r{i}", processor.process_prompt(text), params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(texts))}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    return [tokens[f"r{i}"] for i in range(len(texts))]


def test_engine_on_cuda_matches_the_cpu() -> None:
    assert _greedy_tokens("cuda") == _greedy_tokens("cpu")


def test_triton_decode_in_the_engine() -> None:
    assert _greedy_tokens("cuda", "triton") == _greedy_tokens("cuda", "sdpa")


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
