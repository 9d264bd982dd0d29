"""Attention over the paged KV cache, in plain torch ops (CPU and CUDA).

The cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V). A forward writes the step's new K and V at ``slot_mapping`` and
then lets each request's new tokens attend causally over that request's whole
context.

Every call is a 4-D ``scaled_dot_product_attention`` (``[batch, heads, tokens,
head_dim]``), the layout torch's fused kernels take. A prefill chunk with
nothing cached attends over its own K and V (already at hand) with
``is_causal``; a continuation chunk reads its context from its block table and
uses a lower-right causal mask (``causal_lower_right``), so the new tokens line
up with the last rows of the context. All decodes (one new token each) share
one call padded only to the longest decode context; their blocks are copied
with one ``index_select`` per layer into a workspace that the step's layers
share. Grouped KV heads are expanded by SDPA (``enable_gqa``).

The ``gather`` backend is the previous path (3-D calls with an explicit
boolean mask for every prefill chunk); it stays as the portable reference.
The ``triton`` backend runs prefills as ``sdpa`` and decodes through a Triton
kernel that reads each decode's K and V in place through its block table
(:mod:`~ec_frontend.model.triton_decode`; CUDA, or Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ec_frontend.config import ATTENTION_BACKENDS, TRITON_BACKEND_NEEDS
from ec_frontend.errors import ConfigError
from ec_frontend.model.interface import AttentionMetadata

#: ``sdpa``: 4-D fused-kernel calls (the default on the CPU); ``gather``: the previous
#: path; ``triton``: ``sdpa`` prefills, decodes read in place by a Triton kernel (the
#: default on CUDA, see :func:`resolve_backend`).
BACKENDS = ATTENTION_BACKENDS


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend ``--attention-backend`` names; ``auto`` is ``triton`` on CUDA when
    Triton imports (decodes read the cache in place, and decode steps can be
    captured in CUDA graphs), else ``sdpa``. ``triton`` elsewhere than on CUDA needs
    Triton's interpreter (``TRITON_INTERPRET=1``)."""
    from ec_frontend.model.triton_decode import interpreting, triton_available

    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if name not in BACKENDS:
        raise ConfigError(
            f"unknown attention backend {name!r}; one of auto, {', '.join(BACKENDS)}",
            "attention_backend",
        )
    if name == "triton" and not (triton_available() and (device.type == "cuda" or interpreting())):
        raise ConfigError(TRITON_BACKEND_NEEDS, "attention_backend")
    return name


@dataclass(slots=True)
class DecodeGroup:
    """All requests of a step with exactly one new token."""

    #: ``[D]`` row of each request's token in the flattened batch; ``None`` when
    #: every request of the step decodes (row ``i`` is request ``i``).
    rows: torch.Tensor | None
    block_tables: torch.Tensor  # [D, blocks]
    #: ``[D, 1, 1, context]`` bool, True = may attend (``None`` for ``triton``).
    mask: torch.Tensor | None
    context: int
    seq_lens: torch.Tensor  # [D] int64
    #: ``[2, D * blocks, block elements]``: the decodes' K and V blocks, allocated by
    #: the first layer and refilled by every later one (see :func:`_decode_context`).
    workspace: torch.Tensor | None = None


@dataclass(slots=True)
class PrefillChunk:
    """One request with several new tokens, at rows ``start:end``."""

    start: int
    end: int
    blocks: torch.Tensor  # [blocks]
    seq_len: int
    #: ``[new, seq_len]`` bool for the ``gather`` backend when earlier tokens are cached.
    mask: torch.Tensor | None

    @property
    def fresh(self) -> bool:
        """Nothing was cached before this chunk: it is the whole context."""
        return self.end - self.start == self.seq_len


@dataclass(slots=True)
class PagedLayout:
    """Gather indices and masks of one step, built once and shared by every layer."""

    decodes: DecodeGroup | None
    prefills: list[PrefillChunk]
    backend: str = "sdpa"


def build_layout(
    meta: AttentionMetadata, device: torch.device, backend: str = "sdpa"
) -> PagedLayout:
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
            if s != q and backend == "gather":
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
        width = -(-context // block_size)
        rows: torch.Tensor | None = None
        if len(decode_idx) == len(meta.query_lens_cpu):
            # Every request decodes: the step's own device tensors, no copy (what a
            # CUDA graph of a decode step captures).
            seq = meta.seq_lens.to(device)
            decode_tables = tables if backend == "triton" else tables[:, :width]
        else:
            index = torch.tensor(decode_idx, device=device)
            seq = torch.tensor(lens, device=device)
            rows = torch.tensor(decode_rows, device=device)
            decode_tables = tables[index, :width]
        mask = None
        if backend != "triton":
            mask = (torch.arange(context, device=device)[None, :] < seq[:, None])[:, None, None, :]
        decodes = DecodeGroup(
            rows=rows, block_tables=decode_tables, mask=mask, context=context, seq_lens=seq
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(BACKENDS)}")
    return PagedLayout(decodes, prefills, backend)


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``[T, num_kv_heads, head_dim]`` K and V at the flat slots ``slot_mapping``.

    The cache is viewed as rows of ``num_kv_heads * head_dim`` elements: one
    ``index_copy_`` of whole rows per tensor (copying ``[heads, head_dim]`` items
    instead is many times slower on the CPU)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads * head_dim)
    n = slot_mapping.shape[0]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype).reshape(n, -1))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype).reshape(n, -1))


def _gather(
    kv_cache: torch.Tensor, blocks: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[..., heads, length, head_dim]`` of the context in ``blocks`` (``[..., n]``)."""
    k = kv_cache[0][blocks].flatten(-4, -3)[..., :length, :, :]
    v = kv_cache[1][blocks].flatten(-4, -3)[..., :length, :, :]
    return k.transpose(-3, -2).to(dtype), v.transpose(-3, -2).to(dtype)


def _decode_context(
    kv_cache: torch.Tensor, group: DecodeGroup, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[D, kv_heads, context, head_dim]`` of the decodes: their blocks
    copied, K and V in one ``index_select``, into the step's workspace. Reusing one
    buffer for every layer spares an allocation (on the CPU, fresh pages) per layer."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    tables = group.block_tables
    ws = group.workspace
    if ws is None or ws.dtype != kv_cache.dtype:
        ws = kv_cache.new_empty((2, tables.numel(), block_size * num_kv_heads * head_dim))
        group.workspace = ws
    torch.index_select(kv_cache.view(2, num_blocks, -1), 1, tables.flatten(), out=ws)
    kv = ws.view(2, tables.shape[0], -1, num_kv_heads, head_dim)[:, :, : group.context]
    kv = kv.transpose(-3, -2).to(dtype)
    return kv[0], kv[1]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: PagedLayout,
    scale: float,
) -> torch.Tensor:
    """``[T, num_heads, head_dim]`` queries -> ``[T, num_heads, head_dim]`` outputs.

    ``key`` and ``value`` (``[T, num_kv_heads, head_dim]``) are this step's, and
    ``kv_cache`` must already hold them (see :func:`write_kv`).
    """
    group = layout.decodes
    if group is not None and group.rows is None:
        return _decode(query, kv_cache, group, layout.backend, scale)
    out = torch.empty_like(query)
    if group is not None:
        out[group.rows] = _decode(query[group.rows], kv_cache, group, layout.backend, scale)
    if layout.backend == "gather":
        _gather_prefills(query, kv_cache, layout.prefills, scale, out)
        return out
    for chunk in layout.prefills:
        new = chunk.end - chunk.start
        q = query[chunk.start : chunk.end].transpose(0, 1)[None]  # [1, heads, new, head_dim]
        if chunk.fresh:
            k = key[chunk.start : chunk.end].transpose(0, 1)[None]
            v = value[chunk.start : chunk.end].transpose(0, 1)[None]
            mask = None
        else:
            k, v = _gather(kv_cache, chunk.blocks[None], chunk.seq_len, query.dtype)
            mask = _causal_lower_right(new, chunk.seq_len)
        o = F.scaled_dot_product_attention(
            q,
            k.to(query.dtype),
            v.to(query.dtype),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


def _decode(
    query: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, backend: str, scale: float
) -> torch.Tensor:
    """``[D, heads, head_dim]`` outputs of the decodes' queries."""
    if backend == "triton":
        from ec_frontend.model.triton_decode import paged_decode

        return paged_decode(query, kv_cache, group.block_tables, group.seq_lens, scale)
    if backend == "gather":
        k, v = _gather(kv_cache, group.block_tables, group.context, query.dtype)
    else:
        k, v = _decode_context(kv_cache, group, query.dtype)
    o = F.scaled_dot_product_attention(
        query[:, :, None, :], k, v, attn_mask=group.mask, scale=scale, enable_gqa=True
    )
    return o[:, :, 0, :]


def _gather_prefills(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    chunks: list[PrefillChunk],
    scale: float,
    out: torch.Tensor,
) -> None:
    """The previous prefill path: 3-D SDPA over gathered K and V, boolean masks."""
    for chunk in chunks:
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


def _causal_lower_right(new: int, seq_len: int) -> Any:
    """torch's lower-right causal mask of ``new`` queries over ``seq_len`` keys. Its
    module imports ``torch._dynamo`` (over a CPU-second): imported at first use, so
    that a process that only reads the model's settings (an API server) does not."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(new, seq_len)
