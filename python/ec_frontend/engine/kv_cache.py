"""Paged KV cache bookkeeping: a block pool and per-request block tables.

Only block ids live here; the runner owns the tensors. Block 0 is reserved as
the null block that pads block tables, so a padded entry never aliases a live
block.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ec_frontend.config import DEFAULT_CPU_KV_CACHE_BYTES
from ec_frontend.engine.block_hash import extend_block_hashes
from ec_frontend.errors import ConfigError
from ec_frontend.model.interface import AttentionMetadata, KVCacheSpec

if TYPE_CHECKING:
    import torch

    from ec_frontend.config import EngineConfig
    from ec_frontend.engine.request import Request
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


def profile_run(model: VisionLanguageModel, config: EngineConfig) -> None:
    """The largest step the scheduler can build: ``max_num_batched_tokens`` tokens of
    one fresh prompt through the language model (and logits for ``max_num_seqs``
    rows), then one image of ``encoder_budget`` output rows through the vision
    tower when the model has one. Its activations stay in torch's caching
    allocator, so the device memory measured afterwards accounts for them."""
    import torch

    with torch.no_grad():
        _profile_language(model, config)
        vcfg = getattr(getattr(model, "vision", None), "config", None)
        if vcfg is not None:
            _profile_encoder(model, vcfg, config.scheduler.encoder_budget)


def _profile_language(model: VisionLanguageModel, config: EngineConfig) -> None:
    import torch

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


def _profile_encoder(model: VisionLanguageModel, vcfg: object, rows: int) -> None:
    import torch

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
    import torch

    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    unreserved_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_reserved(device)
    return free - max(0, unreserved_peak), total


def plan_kv_cache(model: VisionLanguageModel, config: EngineConfig) -> KVCachePlan:
    """Size the KV cache of a loaded model (see :class:`~ec_frontend.config.CacheConfig`).

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
    """Allocates fixed-size blocks to requests, all or nothing, and with
    ``enable_prefix_caching`` shares full blocks between requests by content.

    A block is free (never keyed, or keyed and unreferenced: kept for later hits
    in least-recently-freed order) or referenced by the tables of ``ref`` live
    requests. A keyed block holds the KV of the tokens its key names
    (:mod:`~ec_frontend.engine.block_hash`); a request hitting it takes a
    reference instead of computing those tokens. New blocks come from never-keyed
    free blocks first, then from the least recently freed keyed ones, whose keys
    are dropped (reclaimed under pressure).

    Invariants: ``num_free_blocks + num_used_blocks == num_blocks - 1``; a block's
    ``ref`` is the number of tables holding it; a key maps to one block and back.
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks < 2:
            raise ValueError("a KV cache needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(1, num_blocks))
        self._free_keyed: OrderedDict[int, None] = OrderedDict()
        self._ref = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_keyed: dict[str, int] = {}

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request could hold if it had every usable block."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._free_keyed)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a key (referenced or not)."""
        return len(self._by_key)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in ``[0, 1]``."""
        return self.num_used_blocks / (self.num_blocks - 1)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``num_tokens`` tokens in total."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks holding the longest prefix of ``request``'s tokens, never
        its last token (which must be computed to sample). No side effects."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for key in extend_block_hashes(request, self.block_size, max_blocks)[:max_blocks]:
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(
        self, request_id: str, num_tokens: int, cached: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` tokens.

        ``cached`` (from :meth:`find_cached_prefix`, for a request with no table
        yet) starts the table with shared blocks. Returns the newly added block
        ids, or ``None`` (and changes nothing) when there are not enough free
        blocks.
        """
        if not cached:
            table = self._tables.get(request_id)
            if table is not None and len(table) * self.block_size >= num_tokens:
                return []
        elif request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has blocks")
        need = self.blocks_needed(request_id, num_tokens) - len(cached)
        reclaimed = sum(1 for b in cached if self._ref[b] == 0)
        if need > self.num_free_blocks - reclaimed:
            return None
        for block in cached:
            if self._ref[block] == 0:
                del self._free_keyed[block]
            self._ref[block] += 1
        new = [self._take_free_block() for _ in range(max(0, need))]
        table = self._tables.setdefault(request_id, [])
        table.extend(cached)
        table.extend(new)
        if cached:
            self._num_keyed[request_id] = len(cached)
        return new

    def _take_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._free_keyed.popitem(last=False)
            key = self._key[block]
            if key is not None:  # always: only keyed blocks are in _free_keyed
                del self._by_key[key]
            self._key[block] = None
        self._ref[block] = 1
        return block

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> list[int]:
        """Key the request's full blocks within its first ``num_computed_tokens``
        tokens (their KV is, or is being, written this step). A block whose key
        another block already holds stays unkeyed. Returns the blocks keyed now."""
        if not self.enable_prefix_caching:
            return []
        rid = request.request_id
        table = self._tables.get(rid, [])
        full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_keyed.get(rid, 0)
        if full <= start:
            return []
        keys = extend_block_hashes(request, self.block_size, full)
        keyed = []
        for i in range(start, full):
            block, key = table[i], keys[i]
            if self._key[block] is None and key not in self._by_key:
                self._key[block] = key
                self._by_key[key] = block
                keyed.append(block)
        self._num_keyed[rid] = full
        return keyed

    def uncache(self, blocks: Iterable[int]) -> None:
        """Drop the keys of ``blocks`` (their KV was never written)."""
        for block in blocks:
            key = self._key[block]
            if key is None:
                continue
            self._key[block] = None
            del self._by_key[key]
            if block in self._free_keyed:
                del self._free_keyed[block]
                self._free.append(block)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Drop the request's references (no-op if it has none). Blocks no table
        holds any more become free; keyed ones stay cached, the request's last
        block first in line for reclaiming."""
        blocks = self._tables.pop(request_id, None)
        self._num_keyed.pop(request_id, None)
        for block in reversed(blocks or ()):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._key[block] is None:
                    self._free.append(block)
                else:
                    self._free_keyed[block] = None

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables
