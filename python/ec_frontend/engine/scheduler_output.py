"""The scheduler's decision for one step, as the model runner reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ec_frontend.connectors.base import ECConnectorMetadata
    from ec_frontend.connectors.kv_base import KVConnectorMetadata
    from ec_frontend.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes tokens ``[num_computed_tokens, num_computed_tokens +
    num_scheduled_tokens)`` and, when ``sample`` is set (the step reaches the
    request's last token), samples one new token. ``encoder_inputs`` are the
    feature indices scheduled for local encoding; ``ec_loads`` those to load
    through the EC connector. The runner treats ``request`` as read-only.
    """

    request: Request
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list[int]
    encoder_inputs: list[int] = field(default_factory=list)
    ec_loads: list[int] = field(default_factory=list)
    sample: bool = False
    is_new: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    """Everything scheduled for one step, in batch order."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    ec_connector_metadata: ECConnectorMetadata | None = None
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_scheduled_tokens for s in self.scheduled}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
