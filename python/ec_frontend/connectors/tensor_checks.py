"""Checks on a tensor that arrived from another instance, before it enters a cache.

A pulled or read tensor is data from outside the process: its shape, dtype
and size must be what the transfer announced, and its values finite (a NaN in
an encoder output or a KV block would reach every request that shares it).
"""

from __future__ import annotations

import torch


def tensor_problem(
    tensor: torch.Tensor,
    *,
    shape: list[int] | tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> str | None:
    """What is wrong with ``tensor`` (``None``: nothing), naming the real mismatch."""
    if shape is not None and list(tensor.shape) != list(shape):
        return f"tensor of shape {list(tensor.shape)} where {list(shape)} was expected"
    if dtype is not None and tensor.dtype != dtype:
        return f"tensor of dtype {tensor.dtype} where {dtype} was expected"
    if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
        return "tensor holds non-finite values (NaN or Inf)"
    return None
