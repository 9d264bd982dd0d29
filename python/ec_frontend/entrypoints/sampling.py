"""The parser's normalized sampling dict -> the engine's :class:`SamplingParams`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ec_frontend.engine.sampling_params import (
    NO_SEED,
    NULLABLE,
    SamplingParams,
    SamplingParamsError,
)
from ec_frontend.entrypoints.errors import APIError

_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_NULLABLE = NULLABLE | {"extra_args"}


def build_sampling_params(
    sampling: Mapping[str, Any], *, choice: int = 0, vocab_size: int | None = None
) -> SamplingParams:
    """Params for choice ``choice`` of a request; each choice is its own engine request.

    The engine request generates one sequence (``n = 1``). With a ``seed``, choice
    ``i`` uses ``seed + i``: reproducible, and the choices still differ (``-1`` is
    no seed). With ``vocab_size``, token ids must lie in the vocabulary.
    Invalid values raise a 400 :class:`APIError` naming the parameter.
    """
    values = dict(sampling)
    values["n"] = 1
    seed = values.get("seed")
    if choice and seed is not None and seed != NO_SEED:
        values["seed"] = seed + choice
    try:
        if _FIELDS.issuperset(values) and all(
            v is not None or k in _NULLABLE for k, v in values.items()
        ):
            params = SamplingParams(**values)
        else:
            params = SamplingParams.from_dict(values)
        if vocab_size is not None:
            params.check_vocab(vocab_size)
        return params
    except SamplingParamsError as exc:
        raise APIError(400, exc.message, param=exc.param, code="invalid_value") from exc
