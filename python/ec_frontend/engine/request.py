"""An engine request: prompt, media features, sampling state and lifecycle.

A ``Request`` is mutable engine state owned by the scheduler. Its transfer
params come from ``sampling_params.extra_args``, which may be ``None``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ec_frontend.connectors.ec_item_params import flatten_video_patches
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    import torch

    from ec_frontend.engine.structured_output import GrammarState
    from ec_frontend.model.processor import MultiModalFeature, ProcessedInputs


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after ``PREEMPTED`` is final."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    #: Its structured-output grammar is being built (vLLM's name).
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish reason: ``stop``, ``length``, ``abort``, ``error`` or ``None``."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def _extra_arg(params: SamplingParams, key: str) -> JSONObject | None:
    extra = params.extra_args
    if extra is None:
        return None
    value = extra.get(key)
    return value if isinstance(value, dict) else None


class Request:
    """One sequence being served.

    Invariants: ``0 <= num_computed_tokens <= num_tokens``; tokens
    ``[0, num_computed_tokens)`` have their KV in the cache (or were passed over,
    on an encoder-only instance). ``mm_features`` are sorted by ``offset`` and
    do not overlap.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        mm_features: Sequence[MultiModalFeature] = (),
        eos_token_id: int | Sequence[int] | None = None,
        mrope_positions: torch.Tensor | None = None,
        mrope_position_delta: int = 0,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.mm_features: list[MultiModalFeature] = sorted(mm_features, key=lambda f: f.offset)
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset((eos_token_id,))
        else:
            self.eos_token_ids = frozenset(eos_token_id)
        self.mrope_positions = mrope_positions
        self.mrope_position_delta = mrope_position_delta
        self.prompt = prompt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        #: Scopes prefix-cache keys to a tenant (vLLM's ``cache_salt``).
        self.cache_salt = cache_salt
        #: Prefix-cache keys of the full blocks computed so far (``block_hash``).
        self.block_hashes: list[bytes] = []

        grammar = sampling_params.structured_outputs
        #: Structured-output matcher state, advanced from ``output_token_ids``.
        self.grammar: GrammarState | None = grammar.new_state() if grammar is not None else None
        self.kv_transfer_params = _extra_arg(sampling_params, "kv_transfer_params")
        #: A whole video's entry brings its patch items' entries to the top level.
        self.ec_transfer_params = flatten_video_patches(
            _extra_arg(sampling_params, "ec_transfer_params")
        )

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None

    @classmethod
    def from_inputs(
        cls,
        request_id: str,
        inputs: ProcessedInputs,
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> Request:
        return cls(
            request_id,
            inputs.prompt_token_ids,
            sampling_params,
            mm_features=inputs.mm_features,
            eos_token_id=eos_token_id,
            mrope_positions=inputs.mrope_positions,
            mrope_position_delta=inputs.mrope_position_delta,
            prompt=inputs.prompt,
            cache_salt=getattr(inputs, "cache_salt", None),
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_id(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt followed by output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
