"""The flattened inputs of one language-model forward, built on the host in one pass.

Per scheduled request, tokens ``[num_computed_tokens, + num_scheduled_tokens)``
are laid out one after another. Prompt tokens take the processor's positions
(``[3, n]``: M-RoPE rows, or three equal rows for a 1-D RoPE family); later
tokens ``i`` take ``i + mrope_position_delta`` on all three components (the
delta is 0 for 1-D RoPE). Host lists are turned into tensors once, then moved to the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ec_frontend.model.interface import AttentionMetadata

if TYPE_CHECKING:
    from ec_frontend.engine.scheduler_output import ScheduledRequest


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [3, T]
    attn_metadata: AttentionMetadata
    query_start: list[int]  # [B + 1], host copy

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]


def build_model_inputs(
    batch: Sequence[ScheduledRequest], block_size: int, device: torch.device
) -> ModelInputs:
    """Inputs, positions and attention metadata for ``batch`` (non-empty)."""
    bs = block_size
    input_ids: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    prompt_parts: list[tuple[int, torch.Tensor]] = []
    gen_cols: list[int] = []
    gen_vals: list[int] = []
    for item in batch:
        request = item.request
        start = item.num_computed_tokens
        end = start + item.num_scheduled_tokens
        col = query_start[-1]
        input_ids.extend(request.token_ids_range(start, end))
        blocks = item.block_ids
        slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
        tables.append(blocks)
        table = request.mrope_positions
        split = start if table is None else min(max(start, request.num_prompt_tokens), end)
        if start < split:
            prompt_parts.append((col, table[:, start:split]))
        delta = request.mrope_position_delta
        gen_cols.extend(range(col + split - start, col + end - start))
        gen_vals.extend(range(split + delta, end + delta))
        query_start.append(col + end - start)
        seq_lens.append(end)

    num_tokens = query_start[-1]
    positions = torch.empty((3, num_tokens), dtype=torch.int64)
    for col, part in prompt_parts:
        positions[:, col : col + part.shape[1]] = part
    if gen_cols:
        positions[:, torch.tensor(gen_cols)] = torch.tensor(gen_vals, dtype=torch.int64)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    query_lens = [b - a for a, b in itertools.pairwise(query_start)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(query_start, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        query_lens=torch.tensor(query_lens, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=bs,
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=positions.to(device),
        attn_metadata=meta,
        query_start=query_start,
    )
