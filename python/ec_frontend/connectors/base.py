"""The EC connector interface: how encoder outputs move between instances.

A connector has two halves, selected by :class:`ECConnectorRole`. The
scheduler half decides which media items can be loaded instead of encoded and
describes a step's loads in metadata; the worker half moves tensors. The
runner wraps each step in :meth:`ECConnectorBase.bound`, so the metadata is
bound for exactly one step and cleared even when the step fails.

Encoder caches are ``dict[mm_hash, Tensor]`` of shape ``[num_tokens, hidden]``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ec_frontend.connectors.halves import ConnectorHalf
from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    import torch

    from ec_frontend.config import ECTransferConfig
    from ec_frontend.engine.request import Request
    from ec_frontend.engine.scheduler_output import SchedulerOutput


class ECConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(slots=True)
class ECLoadSpec:
    """One item to load: its hash and expected number of rows."""

    mm_hash: str
    num_tokens: int
    request_id: str


@dataclass(slots=True)
class ECConnectorMetadata:
    """What the worker half needs for one step: the items to load."""

    loads: list[ECLoadSpec] = field(default_factory=list)


@dataclass(slots=True)
class ECConnectorStats:
    items_loaded: int = 0
    items_saved: int = 0
    load_failures: int = 0


class ECConnectorBase(ConnectorHalf, ABC):
    """Base of all EC connectors.

    Producers save the encoder outputs they compute; consumers load encoder
    outputs computed elsewhere. ``ec_both`` does both.

    The two halves of one engine share state only through the object that
    :meth:`create_shared` returns: the factory
    (:func:`~ec_frontend.connectors.factory.create_ec_connectors`) creates it
    once and passes it to both; a half created alone gets its own.
    """

    #: What a producer saves, every instance of the deployment can read while the
    #: store keeps it (a shared store, not a point-to-point hand-over): an encoder then
    #: looks there before computing an item (vLLM's ``cross_encoder_cache``).
    shares_outputs: bool = False
    #: Whether a request whose freeing :meth:`request_finished` delays keeps its
    #: encoder outputs in the encoder cache until the connector reports it sent. A
    #: connector that holds its own reference to what it sends sets this to False:
    #: the cache entries are then freed when the request finishes, so outputs a
    #: consumer is slow to take (or never takes) do not fill the encoder cache.
    pins_encoder_outputs: bool = True

    def __init__(self, config: ECTransferConfig | None, role: ECConnectorRole) -> None:
        self.config = config
        self.role = role
        self.stats = ECConnectorStats()
        self._metadata: ECConnectorMetadata | None = None

    # ---- scheduler side -------------------------------------------------

    @abstractmethod
    def has_cache_item(self, mm_hash: str, request: Request | None = None) -> bool:
        """Whether ``mm_hash`` can be loaded now. Must have no side effects.

        ``request`` (optional) lets a connector look where the request's
        ``ec_transfer_params`` point. An invalid hash is simply absent.
        """

    def is_request_ready(self, request: Request) -> bool:
        """Whether the scheduler may plan ``request`` now (default: always).

        A connector that fetches items in the background starts the request's
        fetches here and returns False until each has completed or failed; the
        scheduler keeps the request aside and schedules others meanwhile. Once
        True for a request, it stays True.
        """
        return True

    @abstractmethod
    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """The scheduler reserved cache space for item ``index``: load it this step."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """Metadata for the step being scheduled; resets the pending loads."""

    @abstractmethod
    def request_finished(self, request: Request) -> tuple[bool, JSONObject | None]:
        """``(delay_free, ec_transfer_params)`` for a finished request.

        ``delay_free`` True keeps the request's encoder outputs referenced until
        :meth:`get_finished` reports it as sent. Params are keyed by ``mm_hash``.
        """

    # ---- worker side ----------------------------------------------------

    def bind_connector_metadata(self, metadata: ECConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def metadata(self) -> ECConnectorMetadata:
        if self._metadata is None:
            raise RuntimeError("EC connector metadata is not bound")
        return self._metadata

    @contextmanager
    def bound(self, metadata: ECConnectorMetadata) -> Iterator[ECConnectorBase]:
        """Bind ``metadata`` for one step; it is cleared on exit, error or not."""
        self.bind_connector_metadata(metadata)
        try:
            yield self
        finally:
            self.clear_connector_metadata()

    @abstractmethod
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Load the bound metadata's items into ``encoder_cache``.

        Returns only when every load has completed or failed: the runner gathers
        embeddings right after. An item that cannot be loaded (missing, corrupt,
        wrong shape) is left out of ``encoder_cache`` and counted in
        ``stats.load_failures``; the runner then encodes it locally. Raises only
        when the connector itself is unusable.
        """

    @abstractmethod
    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        """Producer: publish ``encoder_cache[mm_hash]`` for consumers."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(done_sending, done_receiving)`` request ids since the last call."""
        return None, None


class ECQueuedLoadsConnector(ECConnectorBase):
    """An EC connector whose loads need nothing but the item: each allocated item
    is queued and handed to the next step's metadata (a shared directory, a store).
    Subclasses implement the rest of the interface."""

    def __init__(self, config: ECTransferConfig | None, role: ECConnectorRole) -> None:
        super().__init__(config, role)
        self._pending: list[ECLoadSpec] = []

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        self._pending.append(ECLoadSpec(feature.mm_hash, feature.length, request.request_id))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = ECConnectorMetadata(loads=self._pending)
        self._pending = []
        return meta
