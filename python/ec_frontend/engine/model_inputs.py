"""The runner's persistent batch: per-request token ids and block tables kept
across steps, and the flattened inputs of one language-model forward built from
them with a few vectorized host ops.

Each request the runner knows holds a row of two host tables: its token ids
(prompt, then every output token once known) and its KV block table. A row is
written when the request enters and then only appended to (a sampled token, the
blocks the scheduler added), never rebuilt from Python lists. A step's
``input_ids``, ``slot_mapping`` and block tables are gathered from the rows by
index; positions are ``i + mrope_position_delta`` except over a prompt with
M-RoPE positions from the processor (``[3, n]``: M-RoPE rows, or three equal rows
for a 1-D RoPE family).

On CUDA the step's vectors go through pinned host staging buffers into
persistent device buffers with non-blocking copies; the only host sync of a
step is reading the sampled ids. On the CPU the host tensors are used as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ec_frontend.model.interface import AttentionMetadata


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [3, T]
    attn_metadata: AttentionMetadata
    query_start: list[int]  # [B + 1], host copy

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]


@dataclass(slots=True)
class StepRequest:
    """One request of a step, as :meth:`InputBatch.build` reads it."""

    row: int
    start: int  # num_computed_tokens
    num_new: int
    prompt_len: int
    mrope_positions: torch.Tensor | None
    mrope_position_delta: int


def _grow(table: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``table`` enlarged (doubling) to at least ``[rows, cols]``, contents kept."""
    old_rows, old_cols = table.shape
    if rows <= old_rows and cols <= old_cols:
        return table
    new = table.new_zeros((max(rows, 2 * old_rows), max(cols, 2 * old_cols)))
    new[:old_rows, :old_cols] = table
    return new


class _Staging:
    """Persistent device buffers fed from pinned host buffers (CUDA); identity on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._dev: dict[str, torch.Tensor] = {}

    def put(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return tensor
        n = tensor.numel()
        host = self._host.get(name)
        if host is None or host.numel() < n:
            size = max(n, 2 * (host.numel() if host is not None else 0), 64)
            host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._host[name] = host
            self._dev[name] = torch.empty(size, dtype=torch.int64, device=self.device)
        dev = self._dev[name]
        host[:n].copy_(tensor.reshape(-1))
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n].view(tensor.shape)


class InputBatch:
    """Rows of token ids and block tables for the requests the runner knows."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.token_ids = torch.zeros((8, 256), dtype=torch.int64)
        self.block_table = torch.zeros((8, 16), dtype=torch.int64)
        self.num_tokens: list[int] = [0] * 8
        self.num_blocks: list[int] = [0] * 8
        self._free_rows: list[int] = list(range(7, -1, -1))
        self._staging = _Staging(device)

    # ---- rows ---------------------------------------------------------------

    def add_row(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> int:
        """A row for a request entering the batch with these tokens and blocks."""
        if not self._free_rows:
            rows = len(self.num_tokens)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
            self.num_tokens += [0] * rows
            self.num_blocks += [0] * rows
        row = self._free_rows.pop()
        self.num_tokens[row] = 0
        self.num_blocks[row] = 0
        self.append_tokens(row, token_ids)
        self.append_blocks(row, block_ids)
        return row

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def append_tokens(self, row: int, token_ids: Sequence[int]) -> None:
        if not token_ids:
            return
        n = self.num_tokens[row]
        end = n + len(token_ids)
        self.token_ids = _grow(self.token_ids, len(self.num_tokens), end)
        if len(token_ids) == 1:
            self.token_ids[row, n] = token_ids[0]
        else:
            self.token_ids[row, n:end] = torch.tensor(token_ids, dtype=torch.int64)
        self.num_tokens[row] = end

    def append_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        n = self.num_blocks[row]
        end = n + len(block_ids)
        self.block_table = _grow(self.block_table, len(self.num_blocks), end)
        self.block_table[row, n:end] = torch.tensor(block_ids, dtype=torch.int64)
        self.num_blocks[row] = end

    # ---- one step -----------------------------------------------------------

    def build(self, batch: Sequence[StepRequest]) -> ModelInputs:
        """Inputs, positions and attention metadata for ``batch`` (non-empty); every
        row must already hold the tokens and blocks the step reads."""
        bs = self.block_size
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        deltas: list[int] = []
        for item in batch:
            end = item.start + item.num_new
            if end > self.num_tokens[item.row] or -(-end // bs) > self.num_blocks[item.row]:
                raise ValueError(
                    f"the step reads tokens [{item.start}, {end}) of a request whose row holds "
                    f"{self.num_tokens[item.row]} tokens and {self.num_blocks[item.row]} blocks"
                )
            query_start.append(query_start[-1] + item.num_new)
            seq_lens.append(end)
            query_lens.append(item.num_new)
            rows.append(item.row)
            starts.append(item.start)
            deltas.append(item.mrope_position_delta)
        num_tokens = query_start[-1]
        if len(batch) == 1:
            pos = torch.arange(starts[0], seq_lens[0], dtype=torch.int64)
            token_rows = torch.full((num_tokens,), rows[0], dtype=torch.int64)
            offset = torch.full((num_tokens,), deltas[0], dtype=torch.int64)
        else:
            qlens = torch.tensor(query_lens, dtype=torch.int64)
            req = torch.repeat_interleave(torch.arange(len(batch)), qlens)
            first = torch.tensor(query_start[:-1], dtype=torch.int64)
            pos = torch.arange(num_tokens) - first[req] + torch.tensor(starts)[req]
            token_rows = torch.tensor(rows, dtype=torch.int64)[req]
            offset = torch.tensor(deltas, dtype=torch.int64)[req]
        input_ids = self.token_ids[token_rows, pos]
        slots = self.block_table[token_rows, torch.div(pos, bs, rounding_mode="floor")] * bs
        slots += pos % bs
        positions = (pos + offset).expand(3, -1).clone()
        for i, item in enumerate(batch):
            table = item.mrope_positions
            split = min(item.prompt_len, seq_lens[i])
            if table is not None and item.start < split:
                col = query_start[i]
                positions[:, col : col + split - item.start] = table[:, item.start : split]
        width = max(-(-s // bs) for s in seq_lens)
        tables = self.block_table[torch.tensor(rows, dtype=torch.int64), :width]
        put = self._staging.put
        meta = AttentionMetadata(
            query_start_loc=put("query_start", torch.tensor(query_start, dtype=torch.int64)),
            seq_lens=put("seq_lens", torch.tensor(seq_lens, dtype=torch.int64)),
            query_lens=put("query_lens", torch.tensor(query_lens, dtype=torch.int64)),
            block_tables=put("block_tables", tables),
            slot_mapping=put("slots", slots),
            block_size=bs,
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
        )
        return ModelInputs(
            input_ids=put("input_ids", input_ids),
            positions=put("positions", positions),
            attn_metadata=meta,
            query_start=query_start,
        )
