"""Paged decode attention as a Triton kernel: each decode reads its K and V in place,
block by block through its block table, with an online softmax (no gather, no
workspace, no padding to the longest context).

One program per (decode, KV head) handles the query heads of that KV head's group
together, so grouped KV heads are read once. Accumulation is in float32 whatever
the cache's dtype. Triton ships with the CUDA torch wheel; on a CPU the kernel
runs only under Triton's interpreter (``TRITON_INTERPRET=1``), which the tests
use to check it against the gather path.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch


def triton_available() -> bool:
    """Whether Triton can be imported (it compiles for CUDA devices only)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel; built on first use because ``triton.jit`` reads
    ``TRITON_INTERPRET`` when it decorates (``interpret`` keys the cache)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        q_ptr,
        kv_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_kv_kv,
        stride_kv_block,
        stride_kv_pos,
        stride_kv_head,
        stride_table,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        GROUP_P2: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_P2: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        r = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(lens_ptr + r)
        g = tl.arange(0, GROUP_P2)
        d = tl.arange(0, HEAD_P2)
        p = tl.arange(0, BLOCK)
        gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + r * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=gd_mask,
            other=0.0,
        ).to(tl.float32)
        m = tl.full([GROUP_P2], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_P2], tl.float32)
        acc = tl.zeros([GROUP_P2, HEAD_P2], tl.float32)
        for j in range(0, (seq_len + BLOCK - 1) // BLOCK):
            block = tl.load(tables_ptr + r * stride_table + j).to(tl.int64)
            pos = j * BLOCK + p
            pd_mask = (pos < seq_len)[:, None] & (d < HEAD_DIM)[None, :]
            base = kv_ptr + block * stride_kv_block + kv_head * stride_kv_head
            offs = p[:, None] * stride_kv_pos + d[None, :]
            k = tl.load(base + offs, mask=pd_mask, other=0.0).to(tl.float32)
            v = tl.load(base + stride_kv_kv + offs, mask=pd_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            s = tl.where((pos < seq_len)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            prob = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(prob, axis=1)
            acc = acc * alpha[:, None] + tl.sum(prob[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(
            out_ptr + r * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=gd_mask,
        )

    return paged_decode


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[D, heads, head_dim]`` decode queries -> outputs of the same shape.

    ``kv_cache`` is one layer's ``[2, num_blocks, block_size, kv_heads, head_dim]``
    (contiguous in its last dimension), ``block_tables`` ``[D, >= blocks]`` and
    ``seq_lens`` ``[D]`` (each >= 1) give each decode's context.
    """
    num, heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    if heads % kv_heads or kv_cache.stride(-1) != 1:
        raise ValueError("query heads must be a multiple of KV heads, cache contiguous")
    query = query.contiguous()
    tables = block_tables.contiguous()
    out = torch.empty_like(query)
    group = heads // kv_heads
    _kernel(interpreting())[(num, kv_heads)](
        query,
        kv_cache,
        tables,
        seq_lens.contiguous(),
        out,
        scale,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_P2=_pow2(group),
        HEAD_DIM=head_dim,
        HEAD_P2=_pow2(head_dim),
        BLOCK=block_size,
    )
    return out
