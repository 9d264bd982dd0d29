"""The scheduler's decision for one step, as the model runner reads it.

Plain data only: ids, counts, token ids, block ids, sampling params and media
features. The runner never sees a live :class:`~ec_frontend.engine.request.Request`;
it keeps its own per-request state, created from :class:`NewRequestData` when a
request (re)enters the batch and dropped when the request finishes or is
preempted (``finished_req_ids``, ``preempted_req_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ec_frontend.connectors.base import ECConnectorMetadata
    from ec_frontend.connectors.kv_base import KVConnectorMetadata
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.engine.structured_output import GrammarState
    from ec_frontend.model.processor import MultiModalFeature


@dataclass(slots=True)
class NewRequestData:
    """What the runner needs about a request it has no state for: sent the first
    step a request is scheduled, and again when it resumes after preemption.

    ``output_token_ids`` are the tokens generated before this admission (after a
    preemption, or the token a remote prefill sampled); later tokens are the
    ones the runner samples itself. The lists are the scheduler's snapshots: the
    runner copies what it keeps.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: int = 0
    grammar: GrammarState | None = None


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes tokens ``[num_computed_tokens, num_computed_tokens +
    num_scheduled_tokens)`` and, when ``sample`` is set (the step reaches the
    request's last token), samples one new token. ``new_block_ids`` are the KV
    blocks appended to the request's table since the runner last heard of it
    (the whole table when ``new_request`` is set). ``encoder_inputs`` are the
    feature indices scheduled for local encoding; ``ec_loads`` those to load
    through the EC connector.
    """

    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_block_ids: list[int]
    encoder_inputs: list[int] = field(default_factory=list)
    ec_loads: list[int] = field(default_factory=list)
    sample: bool = False
    #: Set when the runner holds no state for the request yet.
    new_request: NewRequestData | None = None

    @property
    def is_new(self) -> bool:
        return self.new_request is not None


@dataclass(slots=True)
class SchedulerOutput:
    """Everything scheduled for one step, in batch order."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    #: Items this step needs that an encoder found in the shared store: not encoded.
    stored_mm_hashes: set[str] = field(default_factory=set)
    ec_connector_metadata: ECConnectorMetadata | None = None
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_scheduled_tokens for s in self.scheduled}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
