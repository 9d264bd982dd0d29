"""Incremental detokenization and stop strings.

Text is produced with the Hugging Face tokenizer's ``decode`` over a short
window (prefix/read offsets), so each token costs a constant amount of work and
multi-byte characters split across tokens are only emitted once complete. A
stop string ends the request; the text is cut before it (or after it with
``include_stop_str_in_output``). While a request runs, the last
``len(longest stop) - 1`` characters are held back, so a stream never emits
the start of a stop string that later completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ec_frontend.engine.sampling_params import SamplingParams

#: Prompt tokens decoded as left context for the first output tokens.
_PROMPT_CONTEXT = 5


def text_token_ids(
    token_ids: Sequence[int], finish_reason: str | None, stop_reason: int | str | None
) -> Sequence[int]:
    """The new tokens whose text is emitted: a stop token that ended the request
    (one of ``stop_token_ids``) contributes no text, as in vLLM."""
    if finish_reason == "stop" and type(stop_reason) is int and token_ids[-1:] == [stop_reason]:
        return token_ids[:-1]
    return token_ids


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer: Hugging Face's ``decode``."""

    def decode(self, token_ids: list[int], /, *, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Per-request text state. ``tokenizer`` is any object with HF-style ``decode``."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._emitted = 0
        self._stopped = False
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._num_output = 0

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str | None:
        """Append tokens; returns the stop string that matched, if any.

        Text whose decoding ends in U+FFFD (an incomplete multi-byte character)
        waits for the next token; with ``finished`` (the request ends with these
        tokens) it is taken as it is, replacement character included, so no
        generated text is lost. After a match, later calls add nothing.
        """
        for token in new_token_ids:
            if self._stopped:
                return None
            self._ids.append(token)
            self._num_output += 1
            stop = self._advance(final=False)
            if stop is not None:
                return stop
        if finished and not self._stopped and self._read_offset < len(self._ids):
            return self._advance(final=True)
        return None

    def _advance(self, final: bool) -> str | None:
        """Move decoded text of the pending tokens into :attr:`text` when complete
        (or ``final``); returns a stop string found in it."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return None
        checked = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        stop = self._find_stop(checked)
        if stop is not None:
            self._stopped = True
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; holds back a possible stop-string prefix unless finished."""
        end = len(self.text)
        if not finished and not self._stopped and self._holdback:
            end = max(self._emitted, end - self._holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _find_stop(self, checked: int) -> str | None:
        # As vLLM: stop strings count only once more than min_tokens tokens are out.
        if not self.params.stop or self._num_output <= self.params.min_tokens:
            return None
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self.text.find(stop, max(0, checked - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        cut = index + len(stop) if self.params.include_stop_str_in_output else index
        self.text = self.text[:cut]
        self._emitted = min(self._emitted, cut)
        return stop

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.params.skip_special_tokens)
