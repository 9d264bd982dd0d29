"""Every attention backend equals the previous gather path, and a plain per-request
softmax attention, to 1e-5 in float32 over random mixes of decodes, fresh
prefills and continuation chunks (block sizes 16 and 32, GQA ratios 1, 2 and 7)."""

from __future__ import annotations

import random

import pytest
import torch
from ec_frontend.config import ConfigError, EngineConfig
from ec_frontend.model.interface import AttentionMetadata
from ec_frontend.model.paged_attention import (
    BACKENDS,
    build_layout,
    paged_attention,
    resolve_backend,
    write_kv,
)

HEAD_DIM = 16
#: ``triton`` runs on the CPU only under Triton's interpreter: its own test below.
CPU_BACKENDS = tuple(b for b in BACKENDS if b != "triton")
NUM_KV_HEADS = 2
NUM_BLOCKS = 160


def _step(
    rng: random.Random, block_size: int, ratio: int, *, decodes_only: bool = False
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random step: ``(meta, query, key, value, kv_cache)`` with the cache already
    holding every request's context (earlier tokens random, new ones written).
    ``decodes_only``: every request decodes (the layout of a CUDA-graphed step)."""
    heads = NUM_KV_HEADS * ratio
    cache = torch.randn(2, NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    choices = ["decode"] if decodes_only else ["decode", "decode", "fresh", "continue"]
    kinds = [rng.choice(choices) for _ in range(rng.randint(1, 7))]
    seq_lens, query_lens, tables, slots = [], [], [], []
    for kind in kinds:
        new = 1 if kind == "decode" else rng.randint(2, 70)
        cached = 0 if kind == "fresh" else rng.randint(1, 150)
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(blocks)
        slots += [
            blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)
        ]
        seq_lens.append(total)
        query_lens.append(new)
    width = max(len(t) for t in tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens),
        query_lens=torch.tensor(query_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        block_size=block_size,
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    tokens = starts[-1]
    query = torch.randn(tokens, heads, HEAD_DIM)
    key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM)
    write_kv(cache, key, value, meta.slot_mapping)
    return meta, query, key, value, cache


def _naive(
    meta: AttentionMetadata, query: torch.Tensor, cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per request: read the context token by token, softmax over allowed keys."""
    bs = meta.block_size
    ratio = query.shape[1] // NUM_KV_HEADS
    out = torch.empty_like(query)
    start = 0
    for i, (new, total) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        table = meta.block_tables[i].tolist()
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total)])
        k = cache[0].flatten(0, 1)[slots].repeat_interleave(ratio, dim=1)  # [total, heads, d]
        v = cache[1].flatten(0, 1)[slots].repeat_interleave(ratio, dim=1)
        q = query[start : start + new]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        allowed = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start : start + new] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += new
    return out


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("ratio", [1, 2, 7])
def test_backends_equal_the_gather_path(block_size: int, ratio: int) -> None:
    rng = random.Random(block_size * 10 + ratio)
    torch.manual_seed(block_size + ratio)
    scale = HEAD_DIM**-0.5
    kinds_seen: set[str] = set()
    for i in range(16):
        meta, query, key, value, cache = _step(rng, block_size, ratio, decodes_only=i % 4 == 3)
        kinds_seen.update(
            "decode" if q == 1 else "fresh" if q == s else "continue"
            for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        )
        ref = paged_attention(
            query, key, value, cache, build_layout(meta, query.device, "gather"), scale
        )
        torch.testing.assert_close(ref, _naive(meta, query, cache, scale), atol=1e-5, rtol=1e-5)
        # A second layer's cache: a layout (and its decode workspace) serves every layer.
        other = torch.randn_like(cache)
        write_kv(other, key, value, meta.slot_mapping)
        ref_other = paged_attention(
            query, key, value, other, build_layout(meta, query.device, "gather"), scale
        )
        for backend in CPU_BACKENDS:
            layout = build_layout(meta, query.device, backend)
            for layer_cache, want in ((cache, ref), (other, ref_other)):
                got = paged_attention(query, key, value, layer_cache, layout, scale)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=backend)
    assert kinds_seen == {"decode", "fresh", "continue"}


def test_unknown_backend_is_refused() -> None:
    meta, query, *_ = _step(random.Random(0), 16, 1)
    with pytest.raises(ValueError, match="unknown attention backend"):
        build_layout(meta, query.device, "nope")
    with pytest.raises(ConfigError, match="unknown attention backend") as info:
        resolve_backend("nope", torch.device("cpu"))
    assert info.value.param == "attention_backend"
    with pytest.raises(ConfigError, match="attention_backend must be auto or one of"):
        EngineConfig(attention_backend="flash")


def test_auto_backend_is_sdpa_on_the_cpu_and_triton_needs_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "sdpa"
    assert resolve_backend("gather", cpu) == "gather"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="--attention-backend triton needs Triton and a CUDA"):
        resolve_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", cpu) == "triton"


def check_triton_decode(block_size: int, ratio: int) -> None:
    """The Triton backend against the gather path on random mixed steps with decodes."""
    rng = random.Random(block_size * 100 + ratio)
    torch.manual_seed(block_size * 3 + ratio)
    scale = HEAD_DIM**-0.5
    decodes = 0
    steps = 0
    while decodes < 2 or steps < 4:
        meta, query, key, value, cache = _step(rng, block_size, ratio, decodes_only=steps % 2 == 1)
        if 1 not in meta.query_lens_cpu:
            continue
        steps += 1
        decodes += meta.query_lens_cpu.count(1)
        want = paged_attention(
            query, key, value, cache, build_layout(meta, query.device, "gather"), scale
        )
        got = paged_attention(
            query, key, value, cache, build_layout(meta, query.device, "triton"), scale
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_triton_decode_equals_the_gather_path() -> None:
    """The Triton kernel, reading each decode's blocks in place, run by Triton's
    interpreter (the kernel source CUDA compiles) in a process that sets
    ``TRITON_INTERPRET=1`` before Triton is imported: block sizes 16 and 32, GQA
    ratios 1, 2 and 7."""
    # Imported here: benches/gpu_check_tests.py loads this file alone, outside the package.
    from ..helpers.triton_interpreter import run_interpreted

    code = (
        "from tests.model.test_attention_paths import check_triton_decode\n"
        "for bs in (16, 32):\n"
        "    for ratio in (1, 2, 7):\n"
        "        check_triton_decode(bs, ratio)\n"
        "print('ok')\n"
    )
    assert run_interpreted(code).strip() == "ok"
