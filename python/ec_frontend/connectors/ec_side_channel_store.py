"""The EC side channel's shared state: the producer's item store and the consumer's pulls.

Both halves of one engine (scheduler and worker) share these objects through
one :class:`SideChannelShared`, which the connector factory creates per engine
and passes to each half. The store serves its items over the side channel
(``get_ec`` sends an item once, then frees it; ``release`` frees it unsent);
an item also leaves when the store is over its bounds (oldest first) or when
it outlived ``ttl_s``.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ec_frontend._core import is_valid_mm_hash
from ec_frontend.connectors.side_channel_wire import SideChannelServer, tensor_payload
from ec_frontend.connectors.transfer_trust import TOKEN_KEY, new_token, valid_token
from ec_frontend.errors import ConfigError
from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    from ec_frontend.config import ECTransferConfig
    from ec_frontend.connectors.transfer_settings import Settings

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Item:
    tensor: torch.Tensor
    nbytes: int
    expires: float
    token: str


class ItemStore:
    """The producer's items and server, shared by the two halves of one engine."""

    def __init__(self, settings: Settings, secret: bytes | None = None) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self.items: OrderedDict[str, _Item] = OrderedDict()
        self.nbytes = 0
        self.pulled = 0
        self.encoder_cache: dict[str, torch.Tensor] | None = None
        self.waiting: dict[str, set[str]] = {}
        self.server = SideChannelServer(
            settings.host, settings.port, self._handle, timeout_s=settings.timeout_s, secret=secret
        )
        self.peer_host = settings.advertise_host or settings.host

    def put(self, mm_hash: str, tensor: torch.Tensor) -> None:
        cpu = tensor.detach().to("cpu").contiguous()
        nbytes = cpu.numel() * cpu.element_size()
        with self.lock:
            # A hash already offered keeps its token: params handed out stay valid.
            old = self.items.get(mm_hash)
            token = old.token if old is not None else new_token()
            self._drop(mm_hash)
            expires = time.monotonic() + self.settings.ttl_s
            self.items[mm_hash] = _Item(cpu, nbytes, expires, token)
            self.nbytes += nbytes
            while self.items and (
                len(self.items) > self.settings.max_items or self.nbytes > self.settings.max_bytes
            ):
                self._drop(next(iter(self.items)))

    def get(self, mm_hash: str) -> _Item | None:
        with self.lock:
            self._expire()
            return self.items.get(mm_hash)

    def _drop(self, mm_hash: str) -> None:
        item = self.items.pop(mm_hash, None)
        if item is not None:
            self.nbytes -= item.nbytes

    def _expire(self) -> None:
        now = time.monotonic()
        for mm_hash in [h for h, item in self.items.items() if item.expires <= now]:
            logger.info("EC item %s expired before it was pulled", mm_hash)
            self._drop(mm_hash)

    def wait_for(self, request_id: str, hashes: set[str]) -> None:
        with self.lock:
            self.waiting[request_id] = hashes

    def take_done(self) -> set[str]:
        """Requests none of whose items is still in the store; forgets them."""
        with self.lock:
            if not self.waiting:
                return set()
            self._expire()
            done = {r for r, hs in self.waiting.items() if not any(h in self.items for h in hs)}
            for rid in done:
                del self.waiting[rid]
        return done

    def __len__(self) -> int:
        with self.lock:
            self._expire()
            return len(self.items)

    def _handle(self, request: JSONObject) -> tuple[JSONObject, bytes | None, Any]:
        """``get_ec`` sends an item (then frees it); ``release`` frees it unsent. Both
        need the item's token: an unknown item and a wrong token look the same."""
        mm_hash, op, token = request.get("mm_hash"), request.get("op"), request.get(TOKEN_KEY)
        if op not in ("get_ec", "release") or not isinstance(mm_hash, str):
            raise ValueError("expected {'op': 'get_ec' | 'release', 'mm_hash': <hex>, 'token'}")
        if not is_valid_mm_hash(mm_hash) or not valid_token(token):
            raise ValueError("mm_hash must be lower-case hex, token 32 hex digits")
        item = self.get(mm_hash)
        if item is None or not hmac.compare_digest(item.token, token):
            raise KeyError("no such item here (never computed, pulled, expired, or wrong token)")
        if op == "release":
            with self.lock:
                present = self.items.get(mm_hash) is item
                if present:
                    self._drop(mm_hash)
            return {"ok": True, "released": present}, None, None
        header, payload = tensor_payload(item.tensor)

        def on_sent() -> None:
            with self.lock:
                if self.items.get(mm_hash) is item:
                    self._drop(mm_hash)
                    self.pulled += 1

        return {"ok": True, **header}, payload, on_sent


class PullStaging:
    """The consumer's background pulls, by ``mm_hash``, with the requests waiting on each.

    Shared by the two halves: the scheduler half starts pulls (``attach``), the
    worker half takes finished ones into the encoder cache (``take``).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fetches: dict[str, tuple[Future[torch.Tensor | None], set[str]]] = {}

    def attach(
        self, mm_hash: str, request_id: str, start: Callable[[], Future[torch.Tensor | None]]
    ) -> Future[torch.Tensor | None]:
        with self.lock:
            entry = self.fetches.get(mm_hash)
            if entry is None:
                entry = (start(), set())
                self.fetches[mm_hash] = entry
            entry[1].add(request_id)
            return entry[0]

    def take(self, mm_hash: str) -> Future[torch.Tensor | None] | None:
        with self.lock:
            entry = self.fetches.pop(mm_hash, None)
        return entry[0] if entry is not None else None

    def detach(self, request_id: str, hashes: set[str]) -> None:
        with self.lock:
            for mm_hash in hashes:
                entry = self.fetches.get(mm_hash)
                if entry is not None:
                    entry[1].discard(request_id)
                    if not entry[1]:
                        del self.fetches[mm_hash]


@dataclass(slots=True)
class SideChannelShared:
    """What both halves of one engine share: the producer's store, the consumer's pulls."""

    store: ItemStore | None
    staging: PullStaging | None

    @classmethod
    def create(cls, config: ECTransferConfig, settings: Settings) -> SideChannelShared:
        store = None
        if config.is_producer:
            try:
                store = ItemStore(settings, config.trust.secret)
            except OSError as exc:
                raise ConfigError(
                    f"EC side channel cannot listen on {settings.host}:{settings.port}: {exc}",
                    "ec_connector_extra_config.port",
                ) from None
        return cls(store, PullStaging() if config.is_consumer else None)

    def close(self) -> None:
        if self.store is not None:
            self.store.server.close()
