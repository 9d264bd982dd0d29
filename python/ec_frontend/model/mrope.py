"""Qwen2-VL's multimodal rotary position index (M-RoPE).

Text tokens advance all three components (temporal, height, width) together.
An image of LLM grid ``(t, h, w)`` (patch grid divided by the spatial merge
size) placed when the running position is ``p`` gets positions
``(p + ti, p + hi, p + wi)`` over its grid in row-major order, and the text
after it resumes at ``p + max(h, w)``. Decoding continues at
``index + delta`` with ``delta = max(position) + 1 - len(prompt)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ec_frontend.model.registry import PositionSpec


def mrope_positions(
    num_tokens: int,
    placements: Sequence[tuple[int, int, tuple[int, int, int]]],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Positions ``[3, num_tokens]`` (int64) and the decode delta.

    ``placements`` lists ``(offset, length, (t, h, w))`` per image, with ``(t, h, w)``
    the patch grid; they must be sorted, disjoint, inside the prompt, and have
    ``length == t * h * w / merge**2`` (the processor guarantees this).
    """
    parts: list[torch.Tensor] = []
    cursor = 0
    pos = 0
    for offset, length, (t, h, w) in placements:
        if offset > cursor:
            n = offset - cursor
            parts.append(torch.arange(pos, pos + n, dtype=torch.int64).expand(3, n))
            pos += n
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = torch.meshgrid(
            torch.arange(t, dtype=torch.int64),
            torch.arange(gh, dtype=torch.int64),
            torch.arange(gw, dtype=torch.int64),
            indexing="ij",
        )
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(gh, gw)
        cursor = offset + length
    if num_tokens > cursor:
        n = num_tokens - cursor
        parts.append(torch.arange(pos, pos + n, dtype=torch.int64).expand(3, n))
    if not parts:
        return torch.zeros(3, 0, dtype=torch.int64), 0
    positions = torch.cat(parts, dim=1).contiguous()
    return positions, int(positions.max()) + 1 - num_tokens


def prompt_positions(
    spec: PositionSpec,
    num_tokens: int,
    placements: Sequence[tuple[int, int, tuple[int, int, int]]],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """The ``[3, num_tokens]`` positions and decode delta of a prompt under ``spec``:
    M-RoPE as :func:`mrope_positions`; 1-D RoPE as three equal rows ``0..n-1``
    with delta 0 (images take one position per placeholder token)."""
    if spec.uses_mrope_delta:
        return mrope_positions(num_tokens, placements, spatial_merge_size)
    return torch.arange(num_tokens, dtype=torch.int64).expand(3, num_tokens).contiguous(), 0
