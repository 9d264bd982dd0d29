"""Checks on a tensor that arrived from another instance, before it enters a cache.

A pulled or read tensor is data from outside the process: its shape, dtype
and size must be what the transfer announced, and its values finite (a NaN in
an encoder output or a KV block would reach every request that shares it).
"""

from __future__ import annotations

import numpy as np
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
    if tensor.is_floating_point() and tensor.numel() and not all_finite(tensor):
        return "tensor holds non-finite values (NaN or Inf)"
    return None


#: Half-width floats numpy cannot test directly: the integer view and the exponent
#: mask; a value is NaN or infinite exactly when its exponent bits are all ones.
_EXPONENT_MASKS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
}


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite.

    Tested with numpy on one thread: a torch reduction would wake torch's
    worker threads for every pulled tensor, which on a busy host costs more
    than the test itself.
    """
    cpu = tensor.detach().to("cpu").contiguous()
    if cpu.dtype in (torch.float32, torch.float64):
        return bool(np.isfinite(cpu.numpy()).all())
    masked = _EXPONENT_MASKS.get(cpu.dtype)
    if masked is None:
        return bool(torch.isfinite(cpu).all())
    int_dtype, mask = masked
    bits = cpu.view(int_dtype).numpy()
    exponent = np.int16(mask)
    return not bool(np.any((bits & exponent) == exponent))
