"""Incremental detokenization against the built-in tokenizer's full decode; stop strings."""

from __future__ import annotations

from typing import Any

import pytest
from ec_frontend.engine.detokenizer import IncrementalDetokenizer
from ec_frontend.engine.sampling_params import SamplingParams

TEXT = "Hello world, the quick brown fox jumps over 12 lazy dogs. Ünïcödé ✓ 漢字!"


@pytest.fixture(scope="module")
def tok(processor: Any) -> Any:
    return processor.tokenizer


def stream(tok: Any, params: SamplingParams, text: str = TEXT) -> tuple[list[str], Any, str | None]:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, tok("prompt:", add_special_tokens=False)["input_ids"],
                                   params)  # fmt: skip
    pieces, stop = [], None
    for i, token in enumerate(ids):
        stop = detok.update([token])
        last = stop is not None or i == len(ids) - 1
        pieces.append(detok.take_delta(last))
        if stop is not None:
            break
    return pieces, detok, stop


def test_incremental_equals_full_decode(tok: Any) -> None:
    pieces, detok, stop = stream(tok, SamplingParams())
    full = tok.decode(tok(TEXT, add_special_tokens=False)["input_ids"])
    assert stop is None
    assert "".join(pieces) == detok.text == full
    assert "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize(
    ("stops", "include", "want_text", "want_stop"),
    [
        (["fox"], False, "Hello world, the quick brown ", "fox"),
        (["fox"], True, "Hello world, the quick brown fox", "fox"),
        (["lazy", "quick"], False, "Hello world, the ", "quick"),
        (["✓"], False, "Hello world, the quick brown fox jumps over 12 lazy dogs. Ünïcödé ", "✓"),
        (["absent"], False, TEXT, None),
    ],
)
def test_stop_strings(
    tok: Any, stops: list[str], include: bool, want_text: str, want_stop: str | None
) -> None:
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    pieces, detok, stop = stream(tok, params)
    assert stop == want_stop
    assert "".join(pieces) == detok.text == want_text


@pytest.mark.parametrize("stop", ["brown fox", "s over 12 lazy", "dogs. Ü"])
def test_stream_never_emits_text_it_must_retract(tok: Any, stop: str) -> None:
    pieces, detok, got = stream(tok, SamplingParams(stop=[stop]))
    assert got == stop
    final = TEXT[: TEXT.index(stop)]
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert final.startswith(emitted)
    assert emitted == detok.text == final
