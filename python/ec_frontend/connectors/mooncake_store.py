"""``MooncakeStoreECConnector``: encoder outputs in Mooncake Store, under vLLM's keys.

The encoder (``ec_producer``) puts each encoder output it computes into Mooncake
Store; consumers (``ec_consumer``: PD or prefill instances, any number of them)
get it by key, as often as they need it: the store's master, not a producer,
decides how long an item lives (capacity, eviction, replication, leases).
``has_cache_item`` is a store lookup, so a consumer loads any item any encoder
has put, with or without ``ec_transfer_params``; an encoder that finds an item
already stored does not put it again.

Keys and values are those of vLLM 0.33's Mooncake Store embedding cache
(``vllm/distributed/ec_transfer/ec_connector/mooncake_store_embedding``)::

    [<embedding_cache_prefix>@]embedding@model:<model>@revision:<revision>
        @encoder:<encoder>@dtype:<torch dtype>@protocol:v3@id:<mm_hash>

    value = struct "<IIQQ" (magic 0x4D4F4F4E, dtype code, num_tokens, hidden)
            followed by the row-major [num_tokens, hidden] tensor bytes

(dtype codes: float32 0, float16 11, bfloat16 12). A value whose header is
not that, or whose row count differs from the item's placeholder count, or
that holds NaN/Inf, is a miss: the runner encodes the item locally when it
can (``ec_load_fallbacks_total``) and fails the request cleanly when it
cannot.

``ec_connector_extra_config`` (over the JSON file at ``$MOONCAKE_CONFIG_PATH``,
vLLM's Mooncake configuration file, when set), vLLM's names:
``master_server_address`` (required, ``host:port`` of ``mooncake_master``),
``metadata_server`` (default ``http://<master host>:8080/metadata``, the
master's ``--enable_http_metadata_server``), ``protocol`` (``tcp`` or
``rdma``, default ``tcp``), ``device_name`` (RDMA devices), ``global_segment_size``
(memory this instance lends the store, default 512 MB) and
``local_buffer_size`` (default 64 MB), ``embedding_cache_prefix``,
``embedding_model_identity`` (default ``default``), ``store_read_buffer_bytes``
(default 128 MB: memory registered once, on the first read, that reads land in; a
larger item is not read; see :class:`ReadArena`). ec-frontend's own:
``prefer_local_segment`` (default true: a put lands in the memory this
instance lends the store, a local copy instead of a network write; consumers
read it from there), ``embedding_revision`` (default ``default``), ``embedding_encoder_identity``
(default ``encoder:default``), ``embedding_dtype`` (default ``torch.float32``:
the model's dtype; the key of every instance must agree), ``local_hostname``
(the address other store clients reach this one at; default: this host's
address toward the master), ``timeout_s`` (default 10: the longest any store
call may take before it counts as failed; the setup call gets three times that).

Transfer params name the items (vLLM's EPD fields plus ``num_tokens`` and the
store ``key``) so a proxy chain is unchanged, but a consumer derives every key
from the item's own ``mm_hash``: there is nothing in them a client could point
elsewhere.
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import faulthandler
import logging
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ec_frontend._core import is_valid_mm_hash
from ec_frontend.connectors.base import (
    ECConnectorRole,
    ECQueuedLoadsConnector,
)
from ec_frontend.connectors.ec_item_params import item_fields
from ec_frontend.connectors.mooncake_common import (
    DTYPE_CODES,
    BoundedCalls,
    CallTimeout,
    host_toward,
    import_mooncake,
    leave_without_teardown,
    merged_extra,
    parse_size,
    positive_float,
    unreachable,
)
from ec_frontend.connectors.tensor_checks import tensor_problem
from ec_frontend.errors import ConfigError
from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    from ec_frontend.config import ECTransferConfig
    from ec_frontend.engine.request import Request

logger = logging.getLogger(__name__)

PREFIX = "ec_connector_extra_config"
KEY_VERSION = "v3"
MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IIQQ")
#: Items read in one batch (each needs a header slot in a registered buffer).
_HEADERS = 256
_DTYPE_NAMES = {str(d): d for d in DTYPE_CODES}
#: How long :meth:`EmbeddingStore.close` waits for the master to answer a probe.
CLOSE_PROBE_S = 2.0


def embedding_namespace(
    *,
    model: str,
    revision: str = "default",
    encoder: str = "encoder:default",
    dtype: str = "torch.float32",
    prefix: str = "",
) -> str:
    """vLLM's namespace of the Mooncake Store embedding cache for one model."""
    head = f"{prefix}@" if prefix else ""
    return (
        f"{head}embedding@model:{model}@revision:{revision}@encoder:{encoder}"
        f"@dtype:{dtype}@protocol:{KEY_VERSION}"
    )


def embedding_key(namespace: str, mm_hash: str) -> str:
    return f"{namespace}@id:{mm_hash}"


def encode_header(tensor: torch.Tensor) -> bytes:
    """The 24-byte header vLLM's codec writes before a 2-D encoder output."""
    code = DTYPE_CODES.get(tensor.dtype)
    if code is None or tensor.dim() != 2:
        raise ValueError(
            f"an encoder output must be a 2-D float32/float16/bfloat16 tensor, "
            f"not {tensor.dtype} of shape {list(tensor.shape)}"
        )
    return HEADER.pack(MAGIC, code, *tensor.shape)


@dataclass(frozen=True)
class StoreSettings:
    master_server_address: str
    metadata_server: str
    protocol: str
    device_name: str
    global_segment_size: int
    local_buffer_size: int
    local_hostname: str
    read_buffer_bytes: int
    timeout_s: float
    namespace: str
    dtype: torch.dtype
    prefer_local_segment: bool = True

    @classmethod
    def from_extra(cls, extra_config: Any) -> StoreSettings:
        extra = merged_extra(extra_config)
        master = extra.get("master_server_address")
        if not isinstance(master, str) or ":" not in master:
            raise ConfigError(
                f"{PREFIX}.master_server_address must be the mooncake_master's host:port",
                f"{PREFIX}.master_server_address",
            )
        host = master.rsplit(":", 1)[0]
        strings = {}
        defaults = {
            "metadata_server": f"http://{host}:8080/metadata",
            "protocol": "tcp",
            "device_name": "",
            "local_hostname": host_toward(master),
            "embedding_cache_prefix": "",
            "embedding_model_identity": "default",
            "embedding_revision": "default",
            "embedding_encoder_identity": "encoder:default",
            "embedding_dtype": "torch.float32",
        }
        for key, default in defaults.items():
            value = extra.get(key, default)
            if not isinstance(value, str):
                raise ConfigError(f"{PREFIX}.{key} must be a string", f"{PREFIX}.{key}")
            strings[key] = value
        if strings["protocol"] not in ("tcp", "rdma"):
            raise ConfigError(f"{PREFIX}.protocol must be tcp or rdma", f"{PREFIX}.protocol")
        if strings["embedding_dtype"] not in _DTYPE_NAMES:
            raise ConfigError(
                f"{PREFIX}.embedding_dtype must be one of {', '.join(sorted(_DTYPE_NAMES))}",
                f"{PREFIX}.embedding_dtype",
            )
        sizes = {
            key: parse_size(extra.get(key, default), f"{PREFIX}.{key}")
            for key, default in (
                ("global_segment_size", 512 << 20),
                ("local_buffer_size", 64 << 20),
                ("store_read_buffer_bytes", 128 << 20),
            )
        }
        local = extra.get("prefer_local_segment", True)
        if not isinstance(local, bool):
            raise ConfigError(
                f"{PREFIX}.prefer_local_segment must be a boolean", f"{PREFIX}.prefer_local_segment"
            )
        return cls(
            prefer_local_segment=local,
            master_server_address=master,
            metadata_server=strings["metadata_server"],
            protocol=strings["protocol"],
            device_name=strings["device_name"],
            global_segment_size=sizes["global_segment_size"],
            local_buffer_size=sizes["local_buffer_size"],
            local_hostname=strings["local_hostname"],
            read_buffer_bytes=sizes["store_read_buffer_bytes"],
            timeout_s=positive_float(extra, "timeout_s", 10.0, PREFIX),
            namespace=embedding_namespace(
                model=strings["embedding_model_identity"],
                revision=strings["embedding_revision"],
                encoder=strings["embedding_encoder_identity"],
                dtype=strings["embedding_dtype"],
                prefix=strings["embedding_cache_prefix"],
            ),
            dtype=_DTYPE_NAMES[strings["embedding_dtype"]],
        )


class ReadArena:
    """Registered, pre-touched memory that Store reads land in (vLLM's read buffer,
    ``store_read_buffer_bytes``), handed out in place: each value read is a tensor over
    its own span of the arena, and the span is free again once the last tensor on it
    is gone. A read lands in a fresh tensor, registered for that read, only when the
    free spans cannot hold it.

    Registering memory with the Transfer Engine and first touching its pages cost more
    than the TCP read of a 1280x720 image's encoder output itself; the arena pays both
    once. Pinned when CUDA is there (the runner copies values to the GPU).
    """

    #: Span alignment (a cache line).
    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self.memory = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=_pinned())
        self.base = self.memory.data_ptr()
        self.nbytes = nbytes
        self._lock = threading.Lock()
        #: Free spans ``(offset, length)``, by offset, none adjacent.
        self._free: list[tuple[int, int]] = [(0, nbytes)]

    def holds(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.nbytes

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of ``shape`` over a free span (first fit), or ``None``."""
        count = 1
        for dim in shape:
            count *= dim
        size = count * (torch.finfo(dtype).bits // 8)
        length = -(-max(size, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            for i, (offset, free) in enumerate(self._free):
                if free >= length:
                    if free == length:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + length, free - length)
                    break
            else:
                return None
        span = (ctypes.c_char * length).from_address(self.base + offset)
        # The span keeps the arena's memory alive; torch keeps the span alive for as
        # long as any tensor or view uses its storage, then the span goes back.
        span.arena = self  # type: ignore[attr-defined]
        weakref.finalize(span, self._give_back, offset, length)
        return torch.frombuffer(span, dtype=dtype, count=count).view(shape)

    def _give_back(self, offset: int, length: int) -> None:
        with self._lock:
            free = self._free
            i = bisect.bisect(free, (offset, 0))
            if i < len(free) and offset + length == free[i][0]:
                length += free.pop(i)[1]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:
                offset, length = free[i - 1][0], free[i - 1][1] + length
                i -= 1
                free.pop(i)
            free.insert(i, (offset, length))


def _pinned() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # a CUDA build without a usable driver
        return False


class EmbeddingStore:
    """One Mooncake Store client per engine (both connector halves share it).

    Every call is bounded (:class:`BoundedCalls`); a failed or overrun call is a
    miss, never an exception out of the connector.
    """

    def __init__(self, settings: StoreSettings) -> None:
        store_module = import_mooncake("store")
        self.settings = settings
        self.calls = BoundedCalls("mooncake-store", settings.timeout_s)
        self.store = store_module.MooncakeDistributedStore()
        self._header = ctypes.create_string_buffer(HEADER.size)
        self._headers = ctypes.create_string_buffer(HEADER.size * _HEADERS)
        s = settings

        def setup() -> int:
            return int(
                self.store.setup(
                    s.local_hostname,
                    s.metadata_server,
                    s.global_segment_size,
                    s.local_buffer_size,
                    s.protocol,
                    s.device_name,
                    s.master_server_address,
                )
            )

        why = unreachable(s.master_server_address, s.metadata_server, s.timeout_s)
        if why is None:
            try:
                code = self.calls.call(setup, timeout_s=3 * s.timeout_s)
            except CallTimeout:
                code = None
            if code != 0:
                why = "no answer" if code is None else f"the client was refused (code {code})"
        if why is not None:
            raise ConfigError(
                f"Mooncake Store at {s.master_server_address} cannot be used: {why}; is "
                "mooncake_master running there with --enable_http_metadata_server?",
                f"{PREFIX}.master_server_address",
            )
        ret = self.calls.call(
            lambda: (
                self.store.register_buffer(ctypes.addressof(self._header), HEADER.size)
                or self.store.register_buffer(ctypes.addressof(self._headers), len(self._headers))
            )
        )
        if ret != 0:
            raise ConfigError(f"Mooncake Store refused a buffer (code {ret})", "mooncake")
        self._replicate = store_module.ReplicateConfig()
        if s.prefer_local_segment:
            self._replicate.preferred_segment = self.store.get_hostname()
        #: Row width of the values read so far: later reads skip the size lookup.
        self._width: int | None = None
        #: Where reads land; made (and registered) by the first read.
        self.arena: ReadArena | None = None
        self._arena_failed = False
        self._arena_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        _OPEN.add(self)

    def close(self) -> None:
        """Unmount from the master and stop the client, in bounded time.

        The native close waits on the master (holding the GIL), so it runs only when
        the master answers a probe (at most ``CLOSE_PROBE_S``) and no earlier call is
        stuck. Otherwise the client is left as it is and the process will leave
        without Mooncake's native teardown (:func:`leave_without_teardown`).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _OPEN.discard(self)
        s = self.settings
        why = (
            "an earlier call has not returned"
            if self.calls.stuck
            else unreachable(
                s.master_server_address, s.metadata_server, min(s.timeout_s, CLOSE_PROBE_S)
            )
        )
        if why is None:
            try:
                self.calls.call(self.store.close)
            except CallTimeout as exc:
                why = str(exc)
        if why is not None:
            logger.warning(
                "Mooncake Store at %s: %s; this client leaves without unmounting "
                "(the master drops it when its heartbeats stop)",
                s.master_server_address,
                why,
            )
            leave_without_teardown(self.store)

    def key(self, mm_hash: str) -> str:
        return embedding_key(self.settings.namespace, mm_hash)

    def exists(self, keys: list[str]) -> list[bool]:
        """Which ``keys`` are stored; an unreachable store holds nothing."""
        try:
            states = self.calls.call(lambda: list(self.store.batch_is_exist(keys)))
        except CallTimeout as exc:
            logger.warning("Mooncake Store lookup failed: %s", exc)
            return [False] * len(keys)
        if any(s < 0 for s in states):
            logger.warning("Mooncake Store lookup failed (codes %s)", sorted(set(states)))
        return [s == 1 for s in states]

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Store ``tensor`` (contiguous, on the CPU) under ``key``; whether it is stored."""
        header = encode_header(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        store, head = self.store, ctypes.addressof(self._header)

        def put() -> int:
            ctypes.memmove(head, header, HEADER.size)
            ret = store.register_buffer(tensor.data_ptr(), nbytes)
            if ret != 0:
                return int(ret)
            try:
                [result] = store.batch_put_from_multi_buffers(
                    [key], [[head, tensor.data_ptr()]], [[HEADER.size, nbytes]], self._replicate
                )
            finally:
                store.unregister_buffer(tensor.data_ptr())
            return int(result)

        try:
            result = self.calls.call(put)
        except CallTimeout as exc:
            logger.warning("Mooncake Store put of %s failed: %s", key, exc)
            return False
        if result < 0:
            logger.warning("Mooncake Store put of %s failed (code %d)", key, result)
        return result >= 0

    def get(self, rows: dict[str, int]) -> dict[str, torch.Tensor]:
        """The encoder outputs stored under the keys of ``rows`` (key -> expected row
        count); missing or invalid ones are left out.

        Each value lands straight in a fresh tensor of the right shape (its header in
        a small registered buffer beside it): the read is the only copy.
        """
        if not rows:
            return {}
        width = self._width
        if width is not None:
            # The width every value so far had: read at once, and look up the sizes
            # only of those that turn out to have another.
            guess = [(k, self._target(n, width)) for k, n in rows.items()]
            found = self._read_all(guess, quiet=True)
            rest = {k: n for k, n in rows.items() if k not in found}
            return found | (self._get_sized(rest) if rest else {})
        return self._get_sized(rows)

    def _get_sized(self, rows: dict[str, int]) -> dict[str, torch.Tensor]:
        keys = list(rows)
        try:
            sizes = self.calls.call(lambda: [int(self.store.get_size(k)) for k in keys])
        except CallTimeout as exc:
            logger.warning("Mooncake Store get failed: %s", exc)
            return {}
        dtype = self.settings.dtype
        itemsize = torch.finfo(dtype).bits // 8
        targets: dict[str, torch.Tensor] = {}
        for key, size in zip(keys, sizes, strict=True):
            body, per_row = size - HEADER.size, rows[key] * itemsize
            if size <= HEADER.size or size > self.settings.read_buffer_bytes or per_row <= 0:
                logger.warning("Mooncake Store item %s not read (size %d)", key, size)
            elif body % per_row:
                logger.warning("Mooncake Store item %s: %d bytes for %d rows", key, body, rows[key])
            else:
                targets[key] = self._target(rows[key], body // per_row)
        found = self._read_all(list(targets.items()))
        if found:
            self._width = next(iter(found.values())).shape[1]
        return found

    def _target(self, rows: int, width: int) -> torch.Tensor:
        """Where a value of ``rows`` x ``width`` is read to: a span of the arena, else a
        tensor of its own."""
        arena = self._arena()
        shape, dtype = (rows, width), self.settings.dtype
        got = arena.tensor(shape, dtype) if arena is not None else None
        return got if got is not None else torch.empty(shape, dtype=dtype)

    def _arena(self) -> ReadArena | None:
        with self._arena_lock:
            if self.arena is not None or self._arena_failed:
                return self.arena
            self._arena_failed = True
            try:
                arena = ReadArena(self.settings.read_buffer_bytes)
            except RuntimeError as exc:  # out of (pinnable) memory
                logger.warning("Mooncake Store read arena not made: %s", exc)
                return None
            try:
                ret = self.calls.call(lambda: self.store.register_buffer(arena.base, arena.nbytes))
            except CallTimeout as exc:
                ret = str(exc)
            if ret != 0:
                logger.warning("Mooncake Store refused the read arena (%s)", ret)
                return None
            self.arena, self._arena_failed = arena, False
            return arena

    def _read_all(
        self, batch: list[tuple[str, torch.Tensor]], *, quiet: bool = False
    ) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for i in range(0, len(batch), _HEADERS):
            found.update(self._read(batch[i : i + _HEADERS], quiet=quiet))
        return found

    def _read(
        self, batch: list[tuple[str, torch.Tensor]], *, quiet: bool = False
    ) -> dict[str, torch.Tensor]:
        headers = ctypes.addressof(self._headers)
        keys = [k for k, _ in batch]
        ptrs = [[headers + i * HEADER.size, t.data_ptr()] for i, (_, t) in enumerate(batch)]
        lengths = [[HEADER.size, t.numel() * t.element_size()] for _, t in batch]
        store = self.store

        arena = self.arena

        def read() -> list[int]:
            registered = []
            try:
                for _, t in batch:
                    if arena is not None and arena.holds(t.data_ptr()):
                        continue
                    if store.register_buffer(t.data_ptr(), t.numel() * t.element_size()) != 0:
                        return [-1] * len(batch)
                    registered.append(t.data_ptr())
                return list(store.batch_get_into_multi_buffers(keys, ptrs, lengths))
            finally:
                for ptr in registered:
                    store.unregister_buffer(ptr)

        try:
            results = self.calls.call(read)
        except CallTimeout as exc:
            logger.warning("Mooncake Store get failed: %s", exc)
            return {}
        found: dict[str, torch.Tensor] = {}
        code = DTYPE_CODES[self.settings.dtype]
        for i, ((key, tensor), result) in enumerate(zip(batch, results, strict=True)):
            expected = HEADER.size + tensor.numel() * tensor.element_size()
            header = HEADER.unpack_from(self._headers, i * HEADER.size)
            if quiet and (result != expected or header != (MAGIC, code, *tensor.shape)):
                continue
            if result != expected:
                logger.warning("Mooncake Store get of %s failed (code %s)", key, result)
            elif header != (MAGIC, code, *tensor.shape):
                logger.warning(
                    "Mooncake Store item %s: not a %s embedding value", key, tensor.shape
                )
            else:
                found[key] = tensor
        return found


_OPEN: weakref.WeakSet[EmbeddingStore] = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    """At exit, every Store client still open closes before the native teardown.

    A close runs Mooncake's native close only after the master answered a probe, but
    a master that stops answering just after it leaves that close waiting, and it
    holds the GIL, so no Python-level timeout can end it. A watchdog that needs no
    GIL (``faulthandler``) bounds the whole step: past :func:`_exit_close_bound_s`,
    it prints every thread's traceback and ends the process with status 1.
    """
    stores = list(_OPEN)
    if not stores:
        return
    faulthandler.dump_traceback_later(_exit_close_bound_s(stores), exit=True)
    try:
        for store in stores:
            store.close()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _exit_close_bound_s(stores: list[EmbeddingStore]) -> float:
    """Per client: its probe, then three times its call timeout for the native close
    (about 2 s against a live master)."""
    return sum(CLOSE_PROBE_S + 3 * store.settings.timeout_s for store in stores)


class MooncakeStoreECConnector(ECQueuedLoadsConnector):
    """Encoder outputs in Mooncake Store under vLLM's key namespace."""

    def __init__(
        self,
        config: ECTransferConfig,
        role: ECConnectorRole,
        shared: EmbeddingStore | None = None,
    ) -> None:
        super().__init__(config, role)
        self.store = shared if shared is not None else self.create_shared(config)

    shares_outputs = True

    @classmethod
    def create_shared(cls, config: ECTransferConfig) -> EmbeddingStore:
        """One Store client per engine: both halves use it."""
        return EmbeddingStore(StoreSettings.from_extra(config.ec_connector_extra_config))

    # ---- scheduler side -------------------------------------------------

    def has_cache_item(self, mm_hash: str, request: Request | None = None) -> bool:
        if not is_valid_mm_hash(mm_hash):
            return False
        return self.store.exists([self.store.key(mm_hash)])[0]

    def request_finished(self, request: Request) -> tuple[bool, JSONObject | None]:
        if not self.is_producer or not request.mm_features:
            return False, None
        fields = item_fields(request.mm_features)
        lengths = {f.mm_hash: f.length for f in request.mm_features}
        hashes = list(lengths)
        keys = [self.store.key(h) for h in hashes]
        params = {
            h: {**fields[h], "num_tokens": lengths[h], "key": key}
            for h, key, stored in zip(hashes, keys, self.store.exists(keys), strict=True)
            if stored
        }
        return False, (params or None)

    # ---- worker side ----------------------------------------------------

    def close(self) -> None:
        self.store.close()

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        specs = {s.mm_hash: s for s in self.metadata.loads if s.mm_hash not in encoder_cache}
        if not specs:
            return
        keys = {self.store.key(h): s for h, s in specs.items()}
        found = self.store.get({k: s.num_tokens for k, s in keys.items()})
        for key, spec in keys.items():
            tensor = found.get(key)
            problem = (
                "missing or unreadable"
                if tensor is None
                else tensor_problem(tensor, shape=[spec.num_tokens, tensor.shape[1]])
            )
            if tensor is None or problem is not None:
                logger.warning("EC load of %s from Mooncake Store: %s", spec.mm_hash, problem)
                self.stats.load_failures += 1
                continue
            encoder_cache[spec.mm_hash] = tensor
            self.stats.items_loaded += 1

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if not is_valid_mm_hash(mm_hash):
            raise ValueError(f"invalid mm_hash {mm_hash!r}: expected lower-case hex")
        key = self.store.key(mm_hash)
        if self.store.exists([key])[0]:
            return
        tensor = encoder_cache[mm_hash].detach().to("cpu").contiguous()
        if tensor.dtype != self.store.settings.dtype:
            logger.warning(
                "encoder output of %s is %s but the store keys say %s (embedding_dtype): not put",
                mm_hash,
                tensor.dtype,
                self.store.settings.dtype,
            )
            return
        if self.store.put(key, tensor):
            self.stats.items_saved += 1
