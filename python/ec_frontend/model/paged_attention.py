"""Attention over the paged KV cache, in plain torch ops (CPU and CUDA).

The cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V). A forward writes the step's new K and V at ``slot_mapping`` and
then lets each request's new tokens attend causally over that request's whole
context, gathered from its block table. All requests of the step go through
one padded ``scaled_dot_product_attention`` call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ec_frontend.model.interface import AttentionMetadata


@dataclass(slots=True)
class PagedLayout:
    """Index tensors of one step, computed once and shared by every layer."""

    token_request: torch.Tensor  # [T] request index of each token
    token_local: torch.Tensor  # [T] index of each token among its request's new tokens
    block_tables: torch.Tensor  # [B, blocks_needed]
    mask: torch.Tensor  # [B, 1, max_query, max_context] bool, True = may attend
    max_query: int
    max_context: int


def build_layout(meta: AttentionMetadata, device: torch.device) -> PagedLayout:
    """Derive the per-step gather/scatter indices and the causal mask from ``meta``.

    Query row ``j`` of request ``i`` sits at absolute position
    ``seq_lens[i] - query_lens[i] + j`` and sees keys ``0..that position``.
    Padding query rows see the request's whole context, so no row is fully
    masked (their outputs are discarded).
    """
    num_requests = meta.num_requests
    max_query = max(meta.query_lens_cpu)
    max_context = max(meta.seq_lens_cpu)
    blocks_needed = -(-max_context // meta.block_size)
    query_lens = meta.query_lens.to(device)
    seq_lens = meta.seq_lens.to(device)
    starts = meta.query_start_loc.to(device)
    token_request = torch.repeat_interleave(torch.arange(num_requests, device=device), query_lens)
    num_tokens = token_request.shape[0]
    token_local = torch.arange(num_tokens, device=device) - starts[token_request]
    q_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_query, device=device)[None, :]
    k_idx = torch.arange(max_context, device=device)
    mask = (k_idx[None, None, :] <= q_pos[:, :, None]) & (
        k_idx[None, None, :] < seq_lens[:, None, None]
    )
    return PagedLayout(
        token_request=token_request,
        token_local=token_local,
        block_tables=meta.block_tables[:, :blocks_needed].to(device),
        mask=mask.unsqueeze(1),
        max_query=max_query,
        max_context=max_context,
    )


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``[T, num_kv_heads, head_dim]`` K and V at the flat slots ``slot_mapping``."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, layout: PagedLayout, scale: float
) -> torch.Tensor:
    """``[T, num_heads, head_dim]`` queries -> ``[T, num_heads, head_dim]`` outputs.

    Reads K and V of every request's context from ``kv_cache`` (already holding
    this step's tokens) through its block table.
    """
    _, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_requests, blocks_needed = layout.block_tables.shape
    ctx = layout.max_context
    keys = kv_cache[0][layout.block_tables].reshape(
        num_requests, blocks_needed * block_size, num_kv_heads, head_dim
    )[:, :ctx]
    values = kv_cache[1][layout.block_tables].reshape(
        num_requests, blocks_needed * block_size, num_kv_heads, head_dim
    )[:, :ctx]
    group = num_heads // num_kv_heads
    if group > 1:
        keys = keys.repeat_interleave(group, dim=2)
        values = values.repeat_interleave(group, dim=2)
    padded = query.new_zeros(num_requests, layout.max_query, num_heads, head_dim)
    padded[layout.token_request, layout.token_local] = query
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys.to(query.dtype).transpose(1, 2),
        values.to(query.dtype).transpose(1, 2),
        attn_mask=layout.mask,
        scale=scale,
    )
    return out.transpose(1, 2)[layout.token_request, layout.token_local]
