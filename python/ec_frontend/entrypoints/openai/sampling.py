"""The parser's normalized sampling dict -> the engine's :class:`SamplingParams`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from ec_frontend.engine.sampling_params import (
    NO_SEED,
    NULLABLE,
    SamplingParams,
    SamplingParamsError,
)
from ec_frontend.entrypoints.http.errors import APIError

_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_NULLABLE = NULLABLE | {"extra_args"}
#: The most ``logprobs`` / ``top_logprobs`` a request may ask for: the request parser's
#: bound (``MAX_LOGPROBS`` in ``rust/ec-core/src/sampling.rs``), vLLM's default
#: ``--max-logprobs``; ``--max-logprobs`` may lower it.
MAX_LOGPROBS = 20
#: vLLM's default ``VLLM_MAX_NUM_BAD_WORDS``: token sequences after tokenization.
MAX_BAD_WORD_SEQUENCES = 128


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """``text``'s token ids; safe from any thread."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer encodes without touching the Python wrapper's
        # state, so it needs no lock against the input-processing threads.
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(tokenizer.encode(text))


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as given (left-stripped)
    and, when that is a different token sequence of the same length, with a
    leading space (the word inside a text). 400 naming ``bad_words`` for a word of
    no tokens or too many sequences."""
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = encode_text(tokenizer, prefix + word.lstrip())
            if not ids:
                if prefix:
                    continue
                raise APIError(
                    400,
                    "bad_words entries must tokenize to at least one token",
                    param="bad_words",
                    code="invalid_value",
                )
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    if len(out) > MAX_BAD_WORD_SEQUENCES:
        raise APIError(
            400,
            f"too many bad words after tokenization: {len(out)}; the maximum is "
            f"{MAX_BAD_WORD_SEQUENCES}",
            param="bad_words",
            code="invalid_value",
        )
    return out


def build_sampling_params(
    sampling: Mapping[str, Any],
    *,
    choice: int = 0,
    vocab_size: int | None = None,
    bad_words: list[list[int]] | None = None,
    max_logprobs: int = MAX_LOGPROBS,
) -> SamplingParams:
    """Params for choice ``choice`` of a request; each choice is its own engine request.

    The engine request generates one sequence (``n = 1``). With a ``seed``, choice
    ``i`` uses ``seed + i``: reproducible, and the choices still differ (``-1`` is
    no seed). With ``vocab_size``, token ids must lie in the vocabulary.
    ``bad_words`` are the tokenized ``sampling["bad_words"]``.
    More than ``max_logprobs`` logprobs (``--max-logprobs``) is refused.
    Invalid values raise a 400 :class:`APIError` naming the parameter.
    """
    values = dict(sampling)
    wanted = values.get("logprobs")
    if isinstance(wanted, int) and wanted > max_logprobs:
        raise APIError(
            400,
            f"at most {max_logprobs} logprobs may be requested (--max-logprobs), got {wanted}",
            param="logprobs",
            code="invalid_value",
        )
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
        params.bad_words_token_ids = bad_words
        if vocab_size is not None:
            params.check_vocab(vocab_size)
        return params
    except SamplingParamsError as exc:
        raise APIError(400, exc.message, param=exc.param, code="invalid_value") from exc
