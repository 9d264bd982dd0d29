"""Attention over the paged KV cache, in plain torch ops (CPU and CUDA).

The cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V). A forward writes the step's new K and V at ``slot_mapping`` and
then lets each request's new tokens attend causally over that request's whole
context, gathered from its block table.

Requests are grouped so that no request is padded to another's prompt
length: all decodes (one new token each) share one ``scaled_dot_product_attention``
call padded only to the longest decode context; every prefill chunk gets its
own call (plain causal when it is the whole prompt, an offset causal mask when
earlier tokens are already cached). Grouped KV heads are expanded by SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ec_frontend.model.interface import AttentionMetadata


@dataclass(slots=True)
class DecodeGroup:
    """All requests of a step with exactly one new token."""

    rows: torch.Tensor  # [D] row of each request's token in the flattened batch
    block_tables: torch.Tensor  # [D, blocks]
    mask: torch.Tensor  # [D, 1, 1, context] bool, True = may attend
    context: int


@dataclass(slots=True)
class PrefillChunk:
    """One request with several new tokens, at rows ``start:end``."""

    start: int
    end: int
    blocks: torch.Tensor  # [blocks]
    seq_len: int
    mask: torch.Tensor | None  # [new, seq_len] bool; None = plain causal (nothing cached)


@dataclass(slots=True)
class PagedLayout:
    """Gather indices and masks of one step, built once and shared by every layer."""

    decodes: DecodeGroup | None
    prefills: list[PrefillChunk]


def build_layout(meta: AttentionMetadata, device: torch.device) -> PagedLayout:
    """Group the step's requests and build their masks from ``meta`` (host lists
    only, so no device synchronisation).

    New token ``j`` of a request with ``q`` new and ``s`` total tokens sits at
    position ``s - q + j`` and sees keys ``0..s - q + j``.
    """
    block_size = meta.block_size
    tables = meta.block_tables.to(device)
    decode_idx: list[int] = []
    decode_rows: list[int] = []
    prefills: list[PrefillChunk] = []
    start = 0
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        if q == 1:
            decode_idx.append(i)
            decode_rows.append(start)
        elif q > 1:
            mask = None
            if s != q:
                k_idx = torch.arange(s, device=device)
                q_pos = torch.arange(s - q, s, device=device)
                mask = k_idx[None, :] <= q_pos[:, None]
            blocks = tables[i, : -(-s // block_size)]
            prefills.append(PrefillChunk(start, start + q, blocks, s, mask))
        start += q
    decodes = None
    if decode_idx:
        lens = [meta.seq_lens_cpu[i] for i in decode_idx]
        context = max(lens)
        index = torch.tensor(decode_idx, device=device)
        seq = torch.tensor(lens, device=device)
        mask = torch.arange(context, device=device)[None, :] < seq[:, None]
        decodes = DecodeGroup(
            rows=torch.tensor(decode_rows, device=device),
            block_tables=tables[index, : -(-context // block_size)],
            mask=mask[:, None, None, :],
            context=context,
        )
    return PagedLayout(decodes, prefills)


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``[T, num_kv_heads, head_dim]`` K and V at the flat slots ``slot_mapping``."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _gather(
    kv_cache: torch.Tensor, blocks: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[..., heads, length, head_dim]`` of the context in ``blocks`` (``[..., n]``)."""
    k = kv_cache[0][blocks].flatten(-4, -3)[..., :length, :, :]
    v = kv_cache[1][blocks].flatten(-4, -3)[..., :length, :, :]
    return k.transpose(-3, -2).to(dtype), v.transpose(-3, -2).to(dtype)


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, layout: PagedLayout, scale: float
) -> torch.Tensor:
    """``[T, num_heads, head_dim]`` queries -> ``[T, num_heads, head_dim]`` outputs.

    ``kv_cache`` must already hold this step's K and V (see :func:`write_kv`).
    """
    out = torch.empty_like(query)
    group = layout.decodes
    if group is not None:
        k, v = _gather(kv_cache, group.block_tables, group.context, query.dtype)
        q = query[group.rows][:, :, None, :]  # [D, heads, 1, head_dim]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True
        )
        out[group.rows] = o[:, :, 0, :]
    for chunk in layout.prefills:
        k, v = _gather(kv_cache, chunk.blocks, chunk.seq_len, query.dtype)
        q = query[chunk.start : chunk.end].transpose(0, 1)  # [heads, new, head_dim]
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[chunk.start : chunk.end] = o.transpose(0, 1)
    return out
