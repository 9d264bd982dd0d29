"""EC connector over TCP: the encoder serves its outputs, the consumer pulls them.

Producer (``ec_producer`` / ``ec_both``): every encoder output it computes goes
into a bounded in-memory store keyed by ``mm_hash``, served at
``host:port``. ``request_finished`` names this server in the request's
``ec_transfer_params`` (DESIGN 4.3)::

    {"<mm_hash>": {"peer_host": ..., "peer_port": ..., "num_tokens": ...,
                   "dtype": "float32", "shape": [num_tokens, hidden],
                   "token": <32 hex>, "signature": ...}}

and delays freeing the request until each of its items has been pulled once
or has outlived ``ttl_s``; a pulled item leaves the store. The request's encoder
cache entries are freed when it finishes all the same (``pins_encoder_outputs``
is False): the store keeps its own reference, bounded as above, so outputs that
a consumer never pulls (one that does not trust the params, or is gone) cost
store memory until the TTL, never the encoder cache that its other requests need.
The store serves or releases an item only to a request that carries its ``token``; with a transfer
secret the entry is signed and each connection authenticated
(``transfer_trust.py``, ``side_channel_wire.py``).

Consumer (``ec_consumer`` / ``ec_both``): an item is loadable when the
request's ``ec_transfer_params`` name a peer for it that passes
:func:`~ec_frontend.connectors.transfer_trust.check_entry` (a peer named by
``--transfer-peers``; with a secret, a valid unused signature; with neither,
no peer passes). Entries that do not are refused once per
request, logged with the reason and counted (``params_rejected``); the item is
then a miss and is encoded locally. When the scheduler first
considers the request, :meth:`ECSideChannelConnector.is_request_ready` starts
pulling its items in the background and the request waits aside (the batch
runs on) until every pull has ended; the worker then takes the pulled tensors
into the encoder cache. Pulls run in parallel, each bounded by ``timeout_s``
(the whole pull), by the size the params announced (at most
``max_item_bytes``), at most ``PULLS_PER_PEER`` at once from one peer
(:mod:`~ec_frontend.connectors.peer_pool`), and checked for the announced
shape and dtype and for finite values. An item that cannot be pulled is a load
failure: the runner encodes it locally, or fails the request when it has no
pixel values. Items offered but found in the
consumer's cache are released at the producer.

Settings (``ec_connector_extra_config`` wins over the environment):

=================  ===============================================  ============
key                environment                                      default
=================  ===============================================  ============
``host``           ``EC_SIDE_CHANNEL_HOST``, ``VLLM_EC_SIDE_...``   ``127.0.0.1``
``port``           ``EC_SIDE_CHANNEL_PORT``, ``VLLM_EC_SIDE_...``   ``5501`` (0: any)
``advertise_host``                                                  ``host``
``max_items``                                                       ``1024``
``max_bytes``                                                       ``1 GiB``
``ttl_s``                                                           ``60``
``timeout_s``                                                       ``10``
``max_item_bytes``                                                  ``256 MiB``
=================  ===============================================  ============

Both halves of one engine share one store, one server and the pulls in flight
(one :class:`~ec_frontend.connectors.ec_side_channel_store.SideChannelShared`,
passed to each by the connector factory). Hashes that are not lower-case hex
are refused at both ends.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ec_frontend._core import is_valid_mm_hash
from ec_frontend.connectors.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECLoadSpec,
)
from ec_frontend.connectors.ec_item_params import item_fields
from ec_frontend.connectors.ec_side_channel_store import SideChannelShared
from ec_frontend.connectors.peer_pool import PeerPool
from ec_frontend.connectors.side_channel_wire import (
    WireError,
    env_setting,
    request_header,
    request_tensor,
    tensor_layout,
)
from ec_frontend.connectors.transfer_settings import Settings
from ec_frontend.connectors.transfer_trust import (
    TOKEN_KEY,
    UNTRUSTED,
    check_entry,
    loggable,
    signed,
    valid_token,
)
from ec_frontend.types import JSONDict, JSONObject

if TYPE_CHECKING:
    from ec_frontend.config import ECTransferConfig
    from ec_frontend.engine.request import Request
    from ec_frontend.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

#: Pull threads of one consumer, and how many of them one peer may hold: a slow or
#: dripping peer keeps at most half, so pulls from other peers never wait behind it.
PULL_WORKERS = 16
PULLS_PER_PEER = 8


@dataclass(frozen=True, slots=True)
class Peer:
    """Where one item can be pulled from, as the request's params announced it."""

    host: str
    port: int
    num_tokens: int
    nbytes: int
    dtype: str
    shape: list[int]
    token: str

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


@dataclass(slots=True)
class ECSideChannelMetadata(ECConnectorMetadata):
    """The step's loads, each with its peer."""

    peers: dict[str, Peer] = field(default_factory=dict)


def _settings(config: ECTransferConfig) -> Settings:
    extra = config.ec_connector_extra_config
    return Settings.from_extra(
        extra,
        host=env_setting(("EC_SIDE_CHANNEL_HOST", "VLLM_EC_SIDE_CHANNEL_HOST"), "127.0.0.1"),
        port=env_setting(("EC_SIDE_CHANNEL_PORT", "VLLM_EC_SIDE_CHANNEL_PORT"), "5501"),
        defaults={
            "max_items": 1024,
            "max_bytes": 1 << 30,
            "ttl_s": 60.0,
            "timeout_s": 10.0,
            "max_item_bytes": 256 << 20,
        },
        prefix="ec_connector_extra_config",
    )


def parse_peer(entry: object, settings: Settings) -> Peer | None:
    """The peer named by one ``ec_transfer_params`` entry, or ``None`` when it names none
    usable (missing or mistyped keys, a size over ``max_item_bytes``). Whether the
    entry may be trusted is :func:`check_entry`'s question."""
    if not isinstance(entry, dict):
        return None
    host, port, num_tokens = entry.get("peer_host"), entry.get("peer_port"), entry.get("num_tokens")
    if not isinstance(host, str) or not host or len(host) > 255:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        return None
    try:
        dtype, shape, nbytes = tensor_layout(entry.get("dtype"), entry.get("shape"))
    except WireError:
        return None
    if shape[0] != num_tokens or len(shape) != 2 or nbytes > settings.max_item_bytes:
        return None
    token = entry.get(TOKEN_KEY)
    if not valid_token(token):
        return None
    return Peer(host, port, num_tokens, nbytes, dtype, list(shape), token)


class ECSideChannelConnector(ECConnectorBase):
    """Encoder outputs served over TCP by the producer and pulled by the consumer."""

    #: The store holds its own reference to each item (a host copy on a GPU).
    pins_encoder_outputs = False

    def __init__(
        self,
        config: ECTransferConfig,
        role: ECConnectorRole,
        shared: SideChannelShared | None = None,
    ) -> None:
        super().__init__(config, role)
        self.settings = _settings(config)
        self.trust = config.trust
        if shared is None:
            shared = SideChannelShared.create(config, self.settings)
        self.shared = shared
        self.store = self.shared.store
        self._pending: list[ECLoadSpec] = []
        self._trusted: dict[str, dict[str, Peer]] = {}
        self.params_rejected = 0
        self._peers: dict[str, Peer] = {}
        self._loading: dict[str, set[str]] = {}
        self._prefetched: dict[str, set[str]] = {}
        self.staging = self.shared.staging
        self._pool: PeerPool | None = None

    @classmethod
    def create_shared(cls, config: ECTransferConfig) -> SideChannelShared:
        return SideChannelShared.create(config, _settings(config))

    # ---- scheduler side -------------------------------------------------

    def _peer(self, mm_hash: str, request: Request | None) -> Peer | None:
        if request is None or not request.ec_transfer_params:
            return None
        peers = self._trusted.get(request.request_id)
        if peers is None:
            peers = self._trusted[request.request_id] = self._verify(request)
        return peers.get(mm_hash)

    def _verify(self, request: Request) -> dict[str, Peer]:
        """The peers of the request's own items that its params name and that pass the
        trust checks; each entry is checked (and its nonce claimed) once per request."""
        params = request.ec_transfer_params
        if not params:
            return {}
        hashes = {f.mm_hash for f in request.mm_features if is_valid_mm_hash(f.mm_hash)}
        limit = self.trust.max_entries
        if len(params) > limit:
            self._reject(request, "*", f"{len(params)} entries, over the limit of {limit}")
            return {}
        peers: dict[str, Peer] = {}
        for mm_hash in sorted(hashes & params.keys()):
            entry = params[mm_hash]
            peer = parse_peer(entry, self.settings)
            if peer is None or not isinstance(entry, dict):
                self._reject(request, mm_hash, "malformed entry")
                continue
            reason = check_entry(self.trust, "ec", mm_hash, entry, peer.host, peer.port)
            if reason is not None:
                self._reject(request, mm_hash, f"{reason} ({loggable(peer.host)}:{peer.port})")
                continue
            peers[mm_hash] = peer
        return peers

    def _reject(self, request: Request, mm_hash: str, reason: str) -> None:
        self.params_rejected += 1
        # Untrusted by configuration: said once at start, not once per request.
        level = logging.DEBUG if reason.startswith(UNTRUSTED) else logging.WARNING
        logger.log(
            level,
            "request %s: ec_transfer_params for %s refused: %s; the item is a miss",
            loggable(request.request_id),
            mm_hash,
            reason,
        )

    def has_cache_item(self, mm_hash: str, request: Request | None = None) -> bool:
        return self._peer(mm_hash, request) is not None

    def is_request_ready(self, request: Request) -> bool:
        """Starts pulling every item the request's params name (in the background) and
        says whether all of those pulls have ended; the batch runs meanwhile."""
        staging = self.staging
        if staging is None or not request.ec_transfer_params:
            return True
        rid = request.request_id
        fetched = self._prefetched.setdefault(rid, set())
        ready = True
        for feature in request.mm_features:
            peer = self._peer(feature.mm_hash, request)
            if peer is None:
                continue
            spec = ECLoadSpec(feature.mm_hash, feature.length, rid)
            future = staging.attach(
                spec.mm_hash, rid, functools.partial(self._start_pull, spec, peer)
            )
            fetched.add(spec.mm_hash)
            ready = ready and future.done()
        return ready

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        peer = self._peer(feature.mm_hash, request)
        if peer is None:
            raise RuntimeError(f"item {feature.mm_hash} has no peer to load from")
        self._pending.append(ECLoadSpec(feature.mm_hash, feature.length, request.request_id))
        self._peers[feature.mm_hash] = peer
        self._loading.setdefault(request.request_id, set()).add(feature.mm_hash)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = ECSideChannelMetadata(loads=self._pending, peers=self._peers)
        self._pending, self._peers = [], {}
        return meta

    def request_finished(self, request: Request) -> tuple[bool, JSONObject | None]:
        if self.is_consumer:
            self._release_unused(request)
        self._trusted.pop(request.request_id, None)
        store = self.store
        if store is None or request.status.finish_reason in ("error", "abort"):
            return False, None
        params: JSONDict = {}
        fields = item_fields(request.mm_features)
        for feature in request.mm_features:
            mm_hash = feature.mm_hash
            if mm_hash in params or not is_valid_mm_hash(mm_hash):
                continue
            item = store.get(mm_hash)
            if item is None and store.encoder_cache is not None:
                cached = store.encoder_cache.get(mm_hash)
                if cached is not None:
                    store.put(mm_hash, cached)
                    item = store.get(mm_hash)
            if item is None or item.tensor.shape[0] != feature.length:
                continue
            entry = {
                **fields[mm_hash],
                "peer_host": store.peer_host,
                "peer_port": store.server.port,
                "num_tokens": feature.length,
                "dtype": str(item.tensor.dtype).removeprefix("torch."),
                "shape": list(item.tensor.shape),
                TOKEN_KEY: item.token,
            }
            params[mm_hash] = signed(self.trust.secret, "ec", mm_hash, entry, self.settings.ttl_s)
        if not params:
            return False, None
        store.wait_for(request.request_id, set(params))
        return True, params

    def _release_unused(self, request: Request) -> None:
        """Tell producers to free the items this request was offered but did not pull
        (it found them cached here), instead of letting them wait for their TTL."""
        loaded = self._loading.pop(request.request_id, set())
        fetched = self._prefetched.pop(request.request_id, set())
        if self.staging is not None and fetched:
            self.staging.detach(request.request_id, fetched)
        for mm_hash, peer in self._trusted.get(request.request_id, {}).items():
            if mm_hash not in loaded and mm_hash not in fetched:
                self._executor().submit(peer.address, self._release, mm_hash, peer)

    def _release(self, mm_hash: str, peer: Peer) -> None:
        try:
            request_header(
                peer.host,
                peer.port,
                {"op": "release", "mm_hash": mm_hash, TOKEN_KEY: peer.token},
                timeout_s=self.settings.timeout_s,
                secret=self.trust.secret,
            )
        except WireError as exc:
            logger.info("EC release of %s at %s:%d failed: %s", mm_hash, peer.host, peer.port, exc)

    def _start_pull(self, spec: ECLoadSpec, peer: Peer) -> Future[torch.Tensor | None]:
        return self._executor().submit(peer.address, self._pull, spec, peer)

    def _executor(self) -> PeerPool:
        if self._pool is None:
            self._pool = PeerPool(PULL_WORKERS, PULLS_PER_PEER, "ec-side-channel")
        return self._pool

    # ---- worker side ----------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        meta = self.metadata
        specs = [s for s in meta.loads if s.mm_hash not in encoder_cache]
        peers = getattr(meta, "peers", {})
        if not specs:
            return
        pool = self._executor()
        unique = {s.mm_hash: s for s in specs}
        futures: dict[str, Future[torch.Tensor | None]] = {}
        for mm_hash, spec in unique.items():
            staged = self.staging.take(mm_hash) if self.staging is not None else None
            peer = peers.get(mm_hash)
            address = peer.address if peer is not None else None
            futures[mm_hash] = staged or pool.submit(address, self._pull, spec, peer)
        for mm_hash, future in futures.items():
            tensor = future.result()
            if tensor is None:
                self.stats.load_failures += 1
            else:
                encoder_cache[mm_hash] = tensor
                self.stats.items_loaded += 1

    def _pull(self, spec: ECLoadSpec, peer: Peer | None) -> torch.Tensor | None:
        if peer is None:
            logger.warning("EC load of %s: no peer in the request's params", spec.mm_hash)
            return None
        started = time.monotonic()
        try:
            _, tensor = request_tensor(
                peer.host,
                peer.port,
                {"op": "get_ec", "mm_hash": spec.mm_hash, TOKEN_KEY: peer.token},
                timeout_s=self.settings.timeout_s,
                max_bytes=peer.nbytes,
                secret=self.trust.secret,
                shape=peer.shape,
                dtype=peer.dtype,
            )
        except WireError as exc:
            logger.warning(
                "EC pull of %s from %s:%d failed after %.2fs: %s",
                spec.mm_hash,
                peer.host,
                peer.port,
                time.monotonic() - started,
                exc,
            )
            return None
        if tensor.shape[0] != spec.num_tokens:
            logger.warning(
                "EC pull of %s: %d rows where the request's item has %d",
                spec.mm_hash,
                tensor.shape[0],
                spec.num_tokens,
            )
            return None
        return tensor

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if self.store is None:
            return
        if not is_valid_mm_hash(mm_hash):
            raise ValueError(f"invalid mm_hash {mm_hash!r}: expected lower-case hex")
        self.store.encoder_cache = encoder_cache
        self.store.put(mm_hash, encoder_cache[mm_hash])
        self.stats.items_saved += 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose items all left the store (pulled or expired) are done sending."""
        store = self.store
        if store is None:
            return None, None
        done = store.take_done()
        return (done or None), None

    def num_items_held(self) -> int:
        """Items in the producer's store (0 on a consumer)."""
        return len(self.store) if self.store is not None else 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self.shared.close()
