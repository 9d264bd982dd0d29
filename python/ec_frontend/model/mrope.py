"""Qwen2-VL's multimodal rotary position index (M-RoPE).

Text tokens advance all three components (temporal, height, width) together.
An image or a video of LLM grid ``(t, h, w)`` (patch grid divided by the spatial
merge size; a video's ``t`` counts its temporal patches) placed when the running
position is ``p`` gets positions ``(p + ti, p + hi, p + wi)`` over its grid in
row-major order, and the text after it resumes at ``p + max(h, w)``, as
transformers' ``get_rope_index`` has it (vLLM 0.33 resumes after a video at
``p + max(t, h, w)``: ``docs/compatibility.md``). Decoding continues at
``index + delta`` with ``delta = max(position) + 1 - len(prompt)``.

Qwen2.5-VL scales a video's temporal index by absolute time: with interval
``s`` (``tokens_per_second * second_per_grid_t``) temporal patch ``ti`` takes
``p + trunc(ti * s)``, computed in float32 as transformers' ``get_rope_index``
computes it from the processor's float32 ``second_per_grid_ts``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ec_frontend.model.registry import PositionSpec


def mrope_positions(
    num_tokens: int,
    placements: Sequence[tuple[int, int, tuple[int, int, int]]],
    spatial_merge_size: int,
    time_intervals: Sequence[float] | None = None,
) -> tuple[torch.Tensor, int]:
    """Positions ``[3, num_tokens]`` (int64) and the decode delta.

    ``placements`` lists ``(offset, length, (t, h, w))`` per image, with ``(t, h, w)``
    the patch grid; they must be sorted, disjoint, inside the prompt, and have
    ``length == t * h * w / merge**2`` (the processor guarantees this).
    ``time_intervals`` (one per placement, default 1) scale the temporal index
    (module docstring). Filled in place with NumPy: a third of the time of the
    equivalent torch ops, per request.
    """
    if num_tokens == 0:
        return torch.zeros(3, 0, dtype=torch.int64), 0
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor = pos = 0
    top = -1  # the largest position so far
    intervals = [1.0] * len(placements) if time_intervals is None else time_intervals
    for (offset, length, (t, h, w)), interval in zip(placements, intervals, strict=True):
        if offset > cursor:
            out[:, cursor:offset] = np.arange(pos, pos + offset - cursor)
            pos += offset - cursor
            top = max(top, pos - 1)
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        grid = out[:, offset : offset + length].reshape(3, t, gh, gw)
        steps = np.arange(t)
        if interval != 1.0:
            steps = (steps.astype(np.float32) * np.float32(interval)).astype(np.int64)
        grid[0] = (pos + steps)[:, None, None]
        grid[1] = (pos + np.arange(gh))[None, :, None]
        grid[2] = (pos + np.arange(gw))[None, None, :]
        top = max(top, pos + max(int(steps[-1]) + 1, gh, gw) - 1)
        pos += max(gh, gw)
        cursor = offset + length
    if num_tokens > cursor:
        out[:, cursor:] = np.arange(pos, pos + num_tokens - cursor)
        top = max(top, pos + num_tokens - cursor - 1)
    return torch.from_numpy(out), top + 1 - num_tokens


def prompt_positions(
    spec: PositionSpec,
    num_tokens: int,
    placements: Sequence[tuple[int, int, tuple[int, int, int]]],
    spatial_merge_size: int,
    time_intervals: Sequence[float] | None = None,
) -> tuple[torch.Tensor, int]:
    """The ``[3, num_tokens]`` positions and decode delta of a prompt under ``spec``:
    M-RoPE as :func:`mrope_positions`; 1-D RoPE as three equal rows ``0..n-1``
    with delta 0 (images take one position per placeholder token)."""
    if spec.uses_mrope_delta:
        return mrope_positions(num_tokens, placements, spatial_merge_size, time_intervals)
    return torch.arange(num_tokens, dtype=torch.int64).expand(3, num_tokens).contiguous(), 0
