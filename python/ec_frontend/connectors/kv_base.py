"""The KV connector interface: how KV moves between prefill and decode instances.

Mirrors vLLM's KVConnectorBase_V1. The scheduler half reports how many prompt
tokens can be loaded instead of computed and hands out ``kv_transfer_params``
when a request finishes; the worker half moves KV blocks around the forward.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ec_frontend.connectors.halves import ConnectorHalf
from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    import torch

    from ec_frontend.config import KVTransferConfig
    from ec_frontend.engine.request import Request
    from ec_frontend.engine.scheduler_output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(slots=True)
class KVConnectorMetadata:
    """What the worker half needs for one step; connectors subclass it."""


@dataclass(slots=True)
class KVLoadResult:
    """How an asynchronous load ended, for the scheduler (see ``get_load_result``).

    ``error`` set: the load failed and the request fails with that message.
    ``first_token_id`` set: the remote prefill also sampled the token after the
    prompt; the request continues from it without computing any prompt token.
    """

    error: str | None = None
    first_token_id: int | None = None


class KVConnectorBase(ConnectorHalf, ABC):
    """Base of all KV connectors.

    ``hands_over_sampled_token``: the connector's asynchronous loads cover the
    whole prompt and :meth:`get_load_result` gives the token sampled after it.
    """

    hands_over_sampled_token: bool = False

    def __init__(self, config: KVTransferConfig | None, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role
        self._metadata: KVConnectorMetadata | None = None

    # ---- scheduler side -------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """``(num_tokens, load_async)``: prompt tokens past ``num_computed_tokens``
        whose KV can be loaded. ``load_async`` True parks the request until
        :meth:`get_finished` reports it received. The scheduler loads at most
        all but the last prompt token (it must be computed to sample), or the
        whole prompt for an asynchronous load of a connector that
        ``hands_over_sampled_token``."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks for the request (including ``num_external_tokens`` to load) are allocated."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Metadata for the step being scheduled; resets per-step state."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, JSONObject | None]:
        """``(delay_free, kv_transfer_params)``. With ``delay_free`` the blocks stay
        allocated until :meth:`get_finished` reports the request as sent."""

    def get_load_result(self, request: Request) -> KVLoadResult | None:
        """Once :meth:`get_finished` reported ``request`` received: how its load ended.

        ``None`` (the default) means the load succeeded and carried no sampled
        token. Called once per received request.
        """
        return None

    # ---- worker side ----------------------------------------------------

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @abstractmethod
    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        """Begin loading the bound metadata's KV into ``kv_caches``."""

    @abstractmethod
    def wait_for_load(self) -> None:
        """Block until every load begun by :meth:`start_load_kv` has landed."""

    @abstractmethod
    def save_kv(self, kv_caches: list[torch.Tensor]) -> None:
        """Producer: after the forward, publish the step's KV."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(done_sending, done_receiving)`` request ids since the last call."""
        return None, None
