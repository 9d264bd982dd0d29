"""What the engine hands back per step.

``EngineCoreOutput`` is one request's delta from one step. ``RequestOutput`` is
what the server sees: a delta that can be merged into an accumulated value with
:meth:`RequestOutput.add`. A transfer param, once set, is never erased by a
later delta that carries ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from ec_frontend.types import JSONObject


class TokenLogprob(msgspec.Struct, array_like=True):
    """The logprob of one sampled token and the top alternatives at its step.

    A msgspec struct: it crosses the engine process's boundary as it is
    (``[token_id, logprob, rank, top]`` on the wire) and is decoded straight into
    this type, with no per-token objects rebuilt on the server's side."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's new tokens from one step; ``finish_reason`` set when it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: JSONObject | None = None
    ec_transfer_params: JSONObject | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's output: a delta per step, or an accumulation of deltas.

    ``token_ids`` and ``text`` hold what this delta adds; after :meth:`add` they
    hold everything so far. ``finish_reason`` is ``stop``, ``length``, ``abort``
    or ``error`` once finished; ``error`` then explains a failure.
    """

    request_id: str
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: JSONObject | None = None
    ec_transfer_params: JSONObject | None = None
    error: str | None = None

    def add(self, delta: RequestOutput) -> None:
        """Merge a later delta of the same request into this output, in place.

        Lists and text are extended; scalar fields take the delta's value when
        it has one. ``kv_transfer_params``, ``ec_transfer_params``,
        ``finish_reason``, ``stop_reason`` and ``error`` keep an earlier non-``None``
        value when the delta carries ``None``.
        """
        if delta.request_id != self.request_id:
            raise ValueError(f"cannot add output of {delta.request_id!r} to {self.request_id!r}")
        if self.prompt_token_ids is None:
            self.prompt_token_ids = delta.prompt_token_ids
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.finished = self.finished or delta.finished
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        for name in (
            "finish_reason",
            "stop_reason",
            "error",
            "kv_transfer_params",
            "ec_transfer_params",
        ):
            value = getattr(delta, name)
            if value is not None:
                setattr(self, name, value)


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one runner step produced.

    ``sampled_token_ids`` has an entry for each request that sampled this step
    (a prefill chunk that does not reach the end of the prompt samples nothing).
    ``failed`` maps request ids to an error message: those requests fail alone.
    ``failed_mm_hashes`` are items the runner could neither load nor encode.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    failed_mm_hashes: set[str] = field(default_factory=set)
    ec_finished_sending: set[str] | None = None
    ec_finished_recving: set[str] | None = None
    kv_finished_sending: set[str] | None = None
    kv_finished_recving: set[str] | None = None
