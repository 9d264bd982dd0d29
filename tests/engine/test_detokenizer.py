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


def _ids_cut_inside_last_char(tok: Any, text: str) -> list[int]:
    """Token ids of ``text`` without its last token, so the last character is incomplete."""
    ids = tok(text, add_special_tokens=False)["input_ids"][:-1]
    assert tok.decode(ids).endswith("\ufffd")
    return ids


@pytest.mark.parametrize("text", ["ab✓", "漢字"])
def test_incomplete_character_is_flushed_when_the_request_finishes(tok: Any, text: str) -> None:
    ids = _ids_cut_inside_last_char(tok, text)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    emitted = ""
    for token in ids[:-1]:
        assert detok.update([token]) is None
        emitted += detok.take_delta(False)
    assert "\ufffd" not in emitted
    assert detok.update([ids[-1]], finished=True) is None
    emitted += detok.take_delta(True)
    assert emitted == detok.text == tok.decode(ids)


def test_incomplete_character_is_held_while_the_request_runs(tok: Any) -> None:
    ids = _ids_cut_inside_last_char(tok, "ab✓")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    assert detok.update(ids) is None
    assert detok.take_delta(False) == "ab"
    assert detok.update([], finished=True) is None
    assert detok.take_delta(True) == tok.decode(ids)[2:]


def test_stop_string_in_flushed_text(tok: Any) -> None:
    ids = _ids_cut_inside_last_char(tok, "ab✓")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["\ufffd"]))
    assert detok.update(ids) is None
    assert detok.update([], finished=True) == "\ufffd"
    assert detok.text == "ab"
    assert detok.update([1], finished=True) is None
