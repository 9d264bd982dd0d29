"""CUDA graphs of the decode step.

A step in which every request decodes (one new token each) launches the same
kernels whatever the requests' context lengths, as long as attention reads each
context through its block table up to a length held on the device (the
``triton`` backend; see :meth:`VisionLanguageModel.decode_graphs_supported`).
At startup :class:`DecodeGraphs` captures the language model's forward over such
a step once per batch size of :func:`capture_sizes`, each over slices of the same
static input tensors. A later decode step of ``n`` requests copies its inputs
into those tensors, pads to the smallest captured size ``>= n`` and replays the
graph: one launch instead of a few thousand kernel launches from Python. Steps
with a prefill chunk, or more requests than the largest size, run eagerly.

Padding rows decode one token with a context of one in a scratch block that the
runner allocates past the scheduler's blocks, so they write and read nothing a
request owns; their outputs are dropped.

The embedding lookup, the placement of encoder outputs, the logits and sampling
stay outside the graph.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ec_frontend.model.interface import AttentionMetadata, VisionLanguageModel

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

#: Records ``fn`` (which builds its output from the static inputs) and returns a
#: replay callable and the output tensor each replay refills.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, the multiples of 8 below ``max_num_seqs``, and
    ``max_num_seqs`` itself (so every decode step of the scheduler has a graph)."""
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class CudaGraphCapture:
    """:data:`Capture` with ``torch.cuda.CUDAGraph``; all graphs share one memory pool
    (captured largest first, so the smaller ones fit in the largest one's memory)."""

    def __init__(self) -> None:
        self._pool: _POOL_HANDLE | None = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        if self._pool is None:
            self._pool = graph.pool()
        return graph.replay, out


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """:data:`Capture` without CUDA: a replay runs ``fn`` again over the static inputs
    and copies its result into the first output. It exercises everything around
    the graph (static inputs, padding, the scratch block) where no GPU is; the
    CUDA capture itself is checked by ``benches/gpu_check_tests.py``."""
    out = fn()

    def replay() -> None:
        out.copy_(fn())

    return replay, out


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """What the runner needs to capture decode graphs."""

    max_num_seqs: int
    max_model_len: int
    #: ``None``: :class:`CudaGraphCapture`.
    capture: Capture | None = None


class DecodeGraphs:
    """Captured decode steps of one model over the runner's KV cache tensors.

    ``scratch_block`` is a block of every layer's cache that no request is given.
    """

    def __init__(
        self,
        model: VisionLanguageModel,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        plan: GraphPlan,
        scratch_block: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(plan.max_num_seqs)
        self._capture = plan.capture or CudaGraphCapture()
        self._scratch = scratch_block
        n, device = self.sizes[-1], model.device
        self.width = -(-plan.max_model_len // block_size)
        self.embeds = torch.zeros((n, model.encoder_output_size), dtype=model.dtype, device=device)
        self.positions = torch.zeros((3, n), dtype=torch.int64, device=device)
        self.slots = torch.full((n,), scratch_block * block_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.block_tables = torch.full(
            (n, self.width), scratch_block, dtype=torch.int64, device=device
        )
        self._query_start = torch.arange(n + 1, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.replays = 0

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self._query_start[: size + 1],
            seq_lens=self.seq_lens[:size],
            query_lens=self.seq_lens.new_ones(size),
            block_tables=self.block_tables[:size],
            slot_mapping=self.slots[:size],
            block_size=self.block_size,
            seq_lens_cpu=[1] * size,
            query_lens_cpu=[1] * size,
        )

    def capture(self) -> None:
        """Capture every size, largest first (each after one eager warm-up run, which
        compiles the kernels and settles lazily built state)."""
        started = time.perf_counter()
        for size in reversed(self.sizes):
            meta = self._meta(size)
            embeds, positions = self.embeds[:size], self.positions[:, :size]

            def forward(
                embeds: torch.Tensor = embeds,
                positions: torch.Tensor = positions,
                meta: AttentionMetadata = meta,
            ) -> torch.Tensor:
                return self.model.forward(embeds, positions, self.kv_caches, meta)

            forward()
            _synchronize(self.model.device)
            self._graphs[size] = self._capture(forward)
        _synchronize(self.model.device)
        logger.info(
            "captured decode graphs for %d batch sizes (1 to %d) in %.1f s",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - started,
        )

    def padded_size(self, meta: AttentionMetadata) -> int | None:
        """The captured size a step runs at, or ``None`` when it must run eagerly."""
        n = meta.num_requests
        if (
            not self._graphs
            or n > self.sizes[-1]
            or meta.block_tables.shape[1] > self.width
            or any(q != 1 for q in meta.query_lens_cpu)
        ):
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(
        self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int
    ) -> torch.Tensor:
        """The forward's ``[n, hidden_size]`` output for a step that
        :meth:`padded_size` gave ``size``; valid until the next replay."""
        n = meta.num_requests
        self.embeds[:n].copy_(embeds)
        self.positions[:, :n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size > n:
            # Rows an earlier, larger step used: back to the scratch block.
            self.slots[n:size].fill_(self._scratch * self.block_size)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(self._scratch)
        replay, out = self._graphs[size]
        replay()
        self.replays += 1
        return out[:n]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
