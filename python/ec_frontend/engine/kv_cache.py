"""Paged KV cache bookkeeping: a block pool and per-request block tables.

Only block ids live here; the runner owns the tensors. Block 0 is reserved as
the null block that pads block tables, so a padded entry never aliases a live
block.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ec_frontend.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError
from ec_frontend.model.interface import AttentionMetadata, KVCacheSpec

if TYPE_CHECKING:
    from ec_frontend.engine.config import EngineConfig
    from ec_frontend.model.interface import VisionLanguageModel

logger = logging.getLogger(__name__)

NULL_BLOCK = 0


def num_blocks_for_budget(spec: KVCacheSpec, block_size: int, memory_bytes: int) -> int:
    """How many blocks (including the null block) fit in ``memory_bytes``."""
    per_block = spec.bytes_per_block(block_size)
    return memory_bytes // per_block if per_block > 0 else 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """How many blocks the KV cache gets, and where that number came from."""

    num_blocks: int
    memory_bytes: int
    #: The flag that sets the budget (named in errors and logs).
    flag: str

    def tokens(self, block_size: int) -> int:
        """Tokens the usable blocks hold (block 0 is the null block)."""
        return (self.num_blocks - 1) * block_size


def on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


@torch.no_grad()
def profile_run(model: VisionLanguageModel, config: EngineConfig) -> None:
    """The largest step the scheduler can build: ``max_num_batched_tokens`` tokens of
    one fresh prompt through the language model (and logits for ``max_num_seqs``
    rows), then one image of ``encoder_budget`` output rows through the vision
    tower when the model has one. Its activations stay in torch's caching
    allocator, so the device memory measured afterwards accounts for them."""
    sched, block_size = config.scheduler, config.cache.block_size
    device = model.device
    if getattr(model, "has_language", True):
        spec = model.kv_cache_spec()
        tokens = sched.max_num_batched_tokens
        blocks = cdiv(tokens, block_size) + 1
        shape = (2, blocks, block_size, spec.num_kv_heads, spec.head_dim)
        kv = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        table = list(range(1, blocks))
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, tokens], device=device),
            seq_lens=torch.tensor([tokens], device=device),
            query_lens=torch.tensor([tokens], device=device),
            block_tables=torch.tensor([table], device=device),
            slot_mapping=torch.arange(block_size, block_size + tokens, device=device),
            block_size=block_size,
            seq_lens_cpu=[tokens],
            query_lens_cpu=[tokens],
        )
        ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        positions = torch.arange(tokens, device=device).expand(3, tokens)
        hidden = model.forward(model.embed_tokens(ids), positions, kv, meta)
        model.compute_logits(hidden[-min(tokens, sched.max_num_seqs) :])
        del kv, hidden
    vcfg = getattr(getattr(model, "vision", None), "config", None)
    if vcfg is not None:
        _profile_encoder(model, vcfg, sched.encoder_budget)


def _profile_encoder(model: VisionLanguageModel, vcfg: object, rows: int) -> None:
    merge = int(getattr(vcfg, "spatial_merge_size", 0) or 0)
    channels = getattr(vcfg, "in_channels", None) or getattr(vcfg, "in_chans", None)
    patch = getattr(vcfg, "patch_size", None)
    temporal = getattr(vcfg, "temporal_patch_size", None)
    if not (merge and channels and patch and temporal):
        return
    height = max(1, math.isqrt(rows))
    width = max(1, rows // height)
    grid = torch.tensor([[1, height * merge, width * merge]])
    dim = int(channels) * int(temporal) * int(patch) ** 2
    pixels = torch.zeros(int(grid.prod()), dim, device=model.device, dtype=model.dtype)
    model.encode_images(pixels, grid)


def device_memory(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of a CUDA device once queued work is done. Memory the
    caching allocator peaked at beyond what it still reserves counts as used."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    unreserved_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_reserved(device)
    return free - max(0, unreserved_peak), total


def plan_kv_cache(model: VisionLanguageModel, config: EngineConfig) -> KVCachePlan:
    """Size the KV cache of a loaded model (see :class:`~ec_frontend.engine.config.CacheConfig`).

    Raises :class:`ConfigError` naming the flag when it cannot hold one
    ``max_model_len`` sequence.
    """
    cache, max_len = config.cache, config.scheduler.max_model_len
    spec = model.kv_cache_spec()
    block_size = cache.block_size
    per_block = spec.bytes_per_block(block_size)
    needed = cdiv(max_len, block_size) + 1
    if cache.num_kv_blocks is not None:
        plan = KVCachePlan(cache.num_kv_blocks, cache.num_kv_blocks * per_block, "num_kv_blocks")
    elif cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
        plan = KVCachePlan(
            num_blocks_for_budget(spec, block_size, budget), budget, "--kv-cache-memory"
        )
    elif on_cuda(model.device):
        profile_run(model, config)
        free, total = device_memory(model.device)
        budget = max(0, int(cache.gpu_memory_utilization * total) - (total - free))
        plan = KVCachePlan(
            num_blocks_for_budget(spec, block_size, budget), budget, "--gpu-memory-utilization"
        )
        logger.info(
            "device memory: %.2f GiB total, %.2f GiB in use after the profile run; "
            "KV cache budget %.2f GiB (--gpu-memory-utilization %.2f)",
            total / 2**30,
            (total - free) / 2**30,
            budget / 2**30,
            cache.gpu_memory_utilization,
        )
    else:
        budget = max(DEFAULT_CPU_KV_CACHE_BYTES, needed * per_block)
        plan = KVCachePlan(
            num_blocks_for_budget(spec, block_size, budget), budget, "--kv-cache-memory"
        )
    if plan.num_blocks < needed:
        raise ConfigError(
            f"the KV cache ({plan.flag}: {plan.memory_bytes} bytes) holds {plan.num_blocks} "
            f"blocks of {block_size} tokens ({per_block} bytes each); --max-model-len "
            f"{max_len} needs at least {needed} ({needed * per_block} bytes): raise "
            f"{plan.flag} or lower --max-model-len",
            plan.flag.lstrip("-").replace("-", "_"),
        )
    logger.info(
        "KV cache: %d blocks of %d tokens, %d tokens; maximum concurrency for %d tokens "
        "per request: %.2fx",
        plan.num_blocks,
        block_size,
        plan.tokens(block_size),
        max_len,
        plan.tokens(block_size) / max_len,
    )
    return plan


class KVCacheManager:
    """Allocates fixed-size blocks to requests, all or nothing.

    Invariants: a block id is either free or in exactly one request's table;
    ``num_free_blocks + sum(len(table)) == num_blocks - 1``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("a KV cache needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request could hold if it had every usable block."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in ``[0, 1]``."""
        return self.num_used_blocks / (self.num_blocks - 1)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``num_tokens`` tokens in total."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` tokens.

        Returns the newly added block ids, or ``None`` (and changes nothing)
        when there are not enough free blocks.
        """
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(need)]
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (no-op if it has none)."""
        blocks = self._tables.pop(request_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables
