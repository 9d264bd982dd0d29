"""``MooncakeConnector``: P/D KV transfer through Mooncake's Transfer Engine.

Prefill (``kv_producer`` / ``kv_both``) registers its KV cache (every layer's
``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor) and a small table of
completion slots with its Transfer Engine. For a request whose params say
``{"do_remote_decode": true}`` it holds the request's blocks when it finishes and
hands out NIXL's keys plus what decode needs to read them one-sided::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id", "remote_request_id", "remote_block_ids",
     "remote_host", "remote_port",            # the Transfer Engine's handshake address
     "remote_num_tokens", "first_token_id", "mrope_position_delta", "prompt_hash",
     "token", "remote_kv_addrs", "remote_num_blocks", "remote_block_bytes",
     "remote_done_addr", "signature"}

Decode (``kv_consumer`` / ``kv_both``) validates them exactly as for the side
channel (the same prompt, positions and trust checks: signed params with a
secret, ``--transfer-peers`` peers; with neither, none), allocates blocks for
the whole prompt, and a worker thread reads prefill's blocks straight into its own
registered blocks: one batched Transfer Engine read per request (K and V of
every layer, runs of adjacent blocks merged), no Python bytes and no host copy
in between. It then writes the first 8 bytes of the hold's ``token`` into
prefill's completion slot (``remote_done_addr``); prefill frees the blocks when
it sees that value there, or after ``ttl_s``. The request continues with the
token prefill sampled, computing no prompt token.

A read that fails (prefill gone, a refused address) or does not finish in
``timeout_s`` fails the request with a clear error; its blocks are freed as for
any failed request. Params with another cache layout (block bytes, layer count)
are refused before any read.

The params carry memory addresses that decode reads from and writes 8 bytes to
(the Transfer Engine refuses anything outside prefill's registered memory, but
inside it a forged address could read another request's blocks or touch its
KV). Decode therefore acts only on signed params (a transfer secret), unless
``allow_unsigned_params`` is set for a host whose clients are all trusted.

``kv_connector_extra_config``: ``protocol`` (``tcp`` or ``rdma``, default ``tcp``),
``device_name`` (RDMA devices), ``host`` (the address this engine advertises and
binds, default ``127.0.0.1``), ``ttl_s`` (default 30), ``timeout_s`` (default 10),
``allow_unsigned_params`` (default false).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ec_frontend.connectors.kv_pull import Hold, KVPullConnector, PullLoad, PullState
from ec_frontend.connectors.kv_transfer_params import RemotePrefill
from ec_frontend.connectors.mooncake_common import import_mooncake, positive_float
from ec_frontend.errors import ConfigError
from ec_frontend.types import JSONDict, JSONObject

if TYPE_CHECKING:
    from ec_frontend.config import KVTransferConfig
    from ec_frontend.engine.request import Request

logger = logging.getLogger(__name__)

PREFIX = "kv_connector_extra_config"
NUM_DONE_SLOTS = 4096


def done_value(token: str) -> int:
    """The completion value of a hold: its token's first 8 bytes, as a positive int64."""
    return int(token[:16], 16) & ((1 << 63) - 1) or 1


@dataclass(frozen=True, slots=True)
class RemoteLayout:
    """Where prefill's KV lies: per-layer base addresses and the block geometry."""

    kv_addrs: tuple[int, ...]
    num_blocks: int
    block_bytes: int
    done_addr: int
    block_ids: tuple[int, ...]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_layout(params: JSONObject) -> RemoteLayout | str:
    addrs = params.get("remote_kv_addrs")
    num_blocks = _int(params.get("remote_num_blocks"))
    block_bytes = _int(params.get("remote_block_bytes"))
    done = _int(params.get("remote_done_addr"))
    blocks = params.get("remote_block_ids")
    if not isinstance(addrs, list) or not addrs or any((_int(a) or 0) <= 0 for a in addrs):
        return "remote_kv_addrs missing or invalid"
    if num_blocks is None or block_bytes is None or num_blocks <= 0 or block_bytes <= 0:
        return "remote_num_blocks / remote_block_bytes missing or invalid"
    if done is None or done <= 0:
        return "remote_done_addr missing or invalid"
    if not isinstance(blocks, list) or any(not 0 <= (_int(b) or -1) < num_blocks for b in blocks):
        return "remote_block_ids outside the remote cache"
    return RemoteLayout(tuple(addrs), num_blocks, block_bytes, done, tuple(blocks))


@dataclass(slots=True)
class _Load(PullLoad):
    layout: RemoteLayout | None = None

    def __init__(
        self, request_id: str, block_ids: list[int], remote: RemotePrefill, layout: RemoteLayout
    ) -> None:
        PullLoad.__init__(self, request_id, block_ids, remote)
        self.layout = layout


@dataclass(slots=True)
class _Hold(Hold):
    slot: int = 0
    value: int = 0


def read_plan(
    local: list[int], remote: RemoteLayout, kv_caches: list[torch.Tensor]
) -> tuple[list[int], list[int], list[int]]:
    """``(local_addrs, remote_addrs, lengths)`` reading ``remote``'s first blocks into
    ``local`` for K and V of every layer; adjacent blocks on both sides become one run."""
    block_bytes = remote.block_bytes
    local_blocks = kv_caches[0].shape[1]
    dst: list[int] = []
    src: list[int] = []
    lengths: list[int] = []
    pairs = list(zip(local, remote.block_ids, strict=False))
    for kv, base in zip(kv_caches, remote.kv_addrs, strict=True):
        local_base = kv.data_ptr()
        for half in (0, 1):
            for lb, rb in pairs:
                d = local_base + (half * local_blocks + lb) * block_bytes
                s = base + (half * remote.num_blocks + rb) * block_bytes
                if dst and dst[-1] + lengths[-1] == d and src[-1] + lengths[-1] == s:
                    lengths[-1] += block_bytes
                else:
                    dst.append(d)
                    src.append(s)
                    lengths.append(block_bytes)
    return dst, src, lengths


class _State(PullState[_Hold]):
    """One Transfer Engine per engine, shared by both connector halves."""

    def __init__(self, config: KVTransferConfig) -> None:
        extra = config.kv_connector_extra_config
        engine_module = import_mooncake("engine")
        protocol = extra.get("protocol", "tcp")
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"{PREFIX}.protocol must be tcp or rdma", f"{PREFIX}.protocol")
        host = extra.get("host", "127.0.0.1")
        device = extra.get("device_name", "")
        if not isinstance(host, str) or not host or not isinstance(device, str):
            raise ConfigError(f"{PREFIX}.host must be a host name or address", f"{PREFIX}.host")
        super().__init__(
            config,
            ttl_s=positive_float(extra, "ttl_s", 30.0, PREFIX),
            timeout_s=positive_float(extra, "timeout_s", 10.0, PREFIX),
        )
        self.protocol, self.host = protocol, host
        self.unsigned = extra.get("allow_unsigned_params", False)
        if not isinstance(self.unsigned, bool):
            raise ConfigError(
                f"{PREFIX}.allow_unsigned_params must be a boolean",
                f"{PREFIX}.allow_unsigned_params",
            )
        self.engine = engine_module.TransferEngine()
        ret = self.engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, device)
        if ret != 0:
            raise ConfigError(
                f"Mooncake Transfer Engine did not start on {self.host} ({self.protocol}): {ret}",
                PREFIX,
            )
        self.port = int(self.engine.get_rpc_port())
        #: Completion slots decode writes into (prefill); the value decode writes (decode).
        self.done = torch.zeros(NUM_DONE_SLOTS, dtype=torch.int64)
        self.free_slots = list(range(NUM_DONE_SLOTS - 1, -1, -1))
        self._register(self.done)

    def _register(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        ret = self.engine.register_memory(tensor.data_ptr(), nbytes)
        if ret != 0:
            raise RuntimeError(f"Mooncake Transfer Engine refused to register memory ({ret})")

    def bind_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Register the KV cache with the engine (once; the runner's tensors never move)."""
        with self.lock:
            if self.kv_caches is kv_caches or not kv_caches:
                return
            if self.kv_caches is not None:
                raise RuntimeError("the KV cache tensors changed after registration")
            for kv in kv_caches:
                self._register(kv)
            self.kv_caches = kv_caches

    def block_bytes(self) -> int:
        kv = self.kv_caches[0] if self.kv_caches else None
        if kv is None:
            return 0
        return int(kv[0, 0].numel() * kv.element_size())

    def release(self) -> None:
        """Free holds whose decode reported completion, and those past their TTL."""
        now = time.monotonic()
        with self.lock:
            for rid, hold in list(self.holds.items()):
                read = int(self.done[hold.slot]) == hold.value
                if not read and hold.expires > now:
                    continue
                if not read:
                    logger.warning("KV of %s not read in %.1fs: freed", rid, self.ttl_s)
                self.free_hold(rid, sent=read)
                self.done[hold.slot] = 0
                self.free_slots.append(hold.slot)

    #: The name the benchmark uses for :meth:`release`.
    release_done = release


class MooncakeConnector(KVPullConnector):
    """Decode reads prefill's held KV blocks one-sided through the Transfer Engine."""

    state: _State
    thread_name = "kv-read"

    @classmethod
    def create_shared(cls, config: KVTransferConfig) -> _State:
        return _State(config)

    # ---- the transport ----------------------------------------------------

    def check_params(self, params: JSONObject, remote: RemotePrefill) -> RemoteLayout | str:
        layout = parse_layout(params)
        refuse_unsigned = self.config.trust.secret is None and not self.state.unsigned
        if not isinstance(layout, str) and refuse_unsigned:
            return "unsigned (set a transfer secret, or allow_unsigned_params on a trusted host)"
        return layout

    def make_load(
        self, rid: str, block_ids: list[int], remote: RemotePrefill, extra: RemoteLayout
    ) -> _Load:
        return _Load(rid, block_ids, remote, extra)

    def hold_params(self, request: Request, block_ids: list[int], token: str) -> JSONDict | None:
        state, rid = self.state, request.request_id
        with state.lock:
            caches = state.kv_caches
            if caches is None:
                return None
            if not state.free_slots:
                logger.warning("request %s: every KV completion slot is in use", rid)
                return None
            slot = state.free_slots.pop()
            state.done[slot] = 0
            expires = time.monotonic() + state.ttl_s
            state.holds[rid] = _Hold(
                block_ids, request.num_prompt_tokens, expires, token, slot, done_value(token)
            )
        return {
            "remote_host": state.host,
            "remote_port": state.port,
            "remote_kv_addrs": [kv.data_ptr() for kv in caches],
            "remote_num_blocks": int(caches[0].shape[1]),
            "remote_block_bytes": state.block_bytes(),
            "remote_done_addr": state.done.data_ptr() + slot * state.done.element_size(),
        }

    def overran(self, load: _Load, now: float) -> bool:
        return now - load.started > self.state.timeout_s

    def transfer(self, load: _Load, kv_caches: list[torch.Tensor]) -> None:
        state, layout = self.state, load.layout
        if layout is None:  # never: make_load gives every load its layout
            raise RuntimeError(f"request {load.request_id}: no remote KV layout")
        if layout.block_bytes != state.block_bytes() or len(layout.kv_addrs) != len(kv_caches):
            raise RuntimeError(
                f"the prefill instance's KV layout ({len(layout.kv_addrs)} layers, "
                f"{layout.block_bytes} bytes a block) differs from this one's "
                f"({len(kv_caches)} layers, {state.block_bytes()} bytes)"
            )
        if len(layout.block_ids) < len(load.block_ids):
            raise RuntimeError(
                f"the prefill instance holds {len(layout.block_ids)} blocks; "
                f"{len(load.block_ids)} are needed"
            )
        target = f"{load.remote.host}:{load.remote.port}"
        dst, src, lengths = read_plan(load.block_ids, layout, kv_caches)
        ret = state.engine.batch_transfer_sync_read(target, dst, src, lengths)
        if ret != 0:
            raise RuntimeError(f"Transfer Engine read from {target} failed ({ret})")
        value = done_value(load.remote.token)
        with state.lock:
            slot = state.free_slots.pop() if state.free_slots else None
        if slot is None:
            return  # prefill frees the blocks at its TTL
        try:
            state.done[slot] = value
            addr = state.done.data_ptr() + slot * state.done.element_size()
            if state.engine.transfer_sync_write(target, addr, layout.done_addr, 8) != 0:
                logger.warning(
                    "request %s: could not report the read to %s", load.request_id, target
                )
        finally:
            with state.lock:
                state.done[slot] = 0
                state.free_slots.append(slot)

    #: The name tests and the benchmark use for :meth:`transfer`.
    _read = transfer
