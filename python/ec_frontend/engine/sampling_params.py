"""Sampling parameters of one request.

Built from the native parser's normalized ``sampling`` dict (see
``ParsedRequest.sampling`` in ``_core.pyi``). ``extra_args`` carries the merged
``vllm_xargs``, including ``kv_transfer_params`` / ``ec_transfer_params``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ec_frontend.types import JSONDict

if TYPE_CHECKING:
    from ec_frontend.engine.structured_output import CompiledGrammar

#: Temperatures below this are treated as greedy.
GREEDY_EPSILON = 1e-5
#: A ``seed`` of -1 means "no seed" (vLLM's convention).
NO_SEED = -1


#: Fields for which ``None`` is a value (elsewhere ``None`` means "the default").
NULLABLE = frozenset(
    {"max_tokens", "seed", "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids"}
)


class SamplingParamsError(ValueError):
    """Invalid sampling parameters; ``param`` names the field (maps to HTTP 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``max_tokens=None`` generates up to the model length. ``top_k <= 0`` and
    ``top_p == 1`` disable those filters. ``logprobs`` is the number of top
    alternatives returned per sampled token (``None``: no logprobs).
    ``prompt_logprobs`` must be ``None``: the engine does not compute them.
    ``seed=-1`` (:data:`NO_SEED`) is taken as no seed, as vLLM does.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: Added to the logits of these token ids before sampling (vLLM clamps to +-100).
    logit_bias: dict[int, float] | None = None
    #: Sampling picks among these token ids only.
    allowed_token_ids: list[int] | None = None
    #: No end of sequence, stop token or stop string before this many tokens.
    min_tokens: int = 0
    #: vLLM's ``bad_words``; the server tokenizes them into ``bad_words_token_ids``.
    bad_words: list[str] = field(default_factory=list)
    #: Token sequences the sampler never completes: the last id of each is banned
    #: where the output ends with the ids before it.
    bad_words_token_ids: list[list[int]] | None = None
    extra_args: JSONDict | None = None
    #: A compiled constraint (:class:`~ec_frontend.engine.structured_output.CompiledGrammar`)
    #: that every sampled token must follow; set by the server after compiling.
    structured_outputs: CompiledGrammar | None = None

    def __post_init__(self) -> None:
        if type(self.seed) is int and self.seed == NO_SEED:
            self.seed = None
        self.validate()

    @classmethod
    def from_dict(cls, sampling: Mapping[str, Any]) -> SamplingParams:
        """Build from a normalized dict; ``None`` values take the defaults."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(sampling) - known)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter {unknown[0]!r}", unknown[0])
        kwargs: dict[str, Any] = {}
        for key, value in sampling.items():
            if value is None and key not in NULLABLE:
                continue
            if key in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words") and (
                value is not None
            ):
                value = list(value)
            if key == "logit_bias" and value is not None:
                if not isinstance(value, Mapping):
                    raise SamplingParamsError("logit_bias must be an object", "logit_bias")
                value = dict(value)
            if key == "extra_args" and value is not None:
                if not isinstance(value, Mapping):
                    raise SamplingParamsError("extra_args must be an object", "extra_args")
                value = dict(value)
            kwargs[key] = value
        return cls(**kwargs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise :class:`SamplingParamsError` for values no sampler can honour."""
        _check_int(self.max_tokens, "max_tokens", minimum=1, optional=True)
        _check_float(self.temperature, "temperature", 0.0, None)
        _check_float(self.top_p, "top_p", 0.0, 1.0)
        if self.top_p <= 0.0:
            raise SamplingParamsError("top_p must be in (0, 1]", "top_p")
        _check_int(self.top_k, "top_k", minimum=-1)
        _check_float(self.min_p, "min_p", 0.0, 1.0)
        _check_int(self.seed, "seed", minimum=None, optional=True)
        _check_int(self.n, "n", minimum=1)
        _check_float(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _check_float(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _check_float(self.repetition_penalty, "repetition_penalty", 0.0, None)
        if self.repetition_penalty <= 0.0:
            raise SamplingParamsError("repetition_penalty must be > 0", "repetition_penalty")
        _check_int(self.logprobs, "logprobs", minimum=0, optional=True)
        if self.prompt_logprobs is not None:
            raise SamplingParamsError("prompt_logprobs is not supported", "prompt_logprobs")
        if not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop must be a list of strings", "stop")
        if any(s == "" for s in self.stop):
            raise SamplingParamsError("stop strings must not be empty", "stop")
        for i, tok in enumerate(self.stop_token_ids):
            _check_int(tok, f"stop_token_ids[{i}]", minimum=0)
        _check_int(self.min_tokens, "min_tokens", minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be at most max_tokens ({self.max_tokens})", "min_tokens"
            )
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                _check_int(tok, "logit_bias", minimum=0)
                _check_float(bias, "logit_bias", -100.0, 100.0)
        if not all(isinstance(w, str) and w for w in self.bad_words):
            raise SamplingParamsError("bad_words must be non-empty strings", "bad_words")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise SamplingParamsError(
                    "allowed_token_ids must not be empty", "allowed_token_ids"
                )
            for i, tok in enumerate(self.allowed_token_ids):
                _check_int(tok, f"allowed_token_ids[{i}]", minimum=0)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise SamplingParamsError("extra_args must be an object", "extra_args")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise :class:`SamplingParamsError` for token ids outside ``[0, vocab_size)``.

        Called where the model's vocabulary is known (vLLM checks the same
        bound: the width of the logits).
        """
        for param, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("bad_words", [t for word in self.bad_words_token_ids or () for t in word]),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingParamsError(
                    f"token id(s) {bad} in {param} are outside the vocabulary "
                    f"(0 to {vocab_size - 1})",
                    param,
                )


def _check_int(value: object, param: str, *, minimum: int | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(f"{param} must be an integer", param)
    if minimum is not None and value < minimum:
        raise SamplingParamsError(f"{param} must be >= {minimum}", param)


def _check_float(value: object, param: str, low: float, high: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SamplingParamsError(f"{param} must be a finite number", param)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise SamplingParamsError(f"{param} must be in {bound}", param)
