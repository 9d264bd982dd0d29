"""The parser's normalized sampling dict -> the engine's :class:`SamplingParams`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ec_frontend.engine.sampling_params import SamplingParams, SamplingParamsError
from ec_frontend.entrypoints.errors import APIError

_FIELDS = frozenset(f.name for f in fields(SamplingParams))
#: Fields for which ``None`` is a value (elsewhere ``None`` means "the default").
_NULLABLE = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs", "extra_args"})


def build_sampling_params(sampling: Mapping[str, Any], *, choice: int = 0) -> SamplingParams:
    """Params for choice ``choice`` of a request; each choice is its own engine request.

    The engine request generates one sequence (``n = 1``). With a ``seed``, choice
    ``i`` uses ``seed + i``: reproducible, and the choices still differ.
    Invalid values raise a 400 :class:`APIError` naming the parameter.
    """
    values = dict(sampling)
    values["n"] = 1
    seed = values.get("seed")
    if choice and seed is not None:
        values["seed"] = seed + choice
    try:
        if _FIELDS.issuperset(values) and all(
            v is not None or k in _NULLABLE for k, v in values.items()
        ):
            return SamplingParams(**values)
        return SamplingParams.from_dict(values)
    except SamplingParamsError as exc:
        raise APIError(400, exc.message, param=exc.param, code="invalid_value") from exc
