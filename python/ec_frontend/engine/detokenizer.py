"""Incremental detokenization and stop strings.

:func:`make_detokenizer` picks one of three ways to turn tokens into text: the
tokenizers library's ``DecodeStream`` for a fast Hugging Face tokenizer (one
native call per token), a token -> text function for a tokenizer whose tokens
need no context (the mock's characters), else the tokenizer's ``decode`` over a
short window (prefix/read offsets), so that each token costs a constant amount
of work. Multi-byte characters split across tokens are only emitted once
complete. A
stop string ends the request; the text is cut before it (or after it with
``include_stop_str_in_output``). While a request runs, the last
``len(longest stop) - 1`` characters are held back, so a stream never emits
the start of a stop string that later completes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

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


class _PieceText(IncrementalDetokenizer):
    """A detokenizer that gets each token's text as a piece to append (no window)."""

    def _append(self, piece: str) -> str | None:
        checked = len(self.text)
        self.text += piece
        stop = self._find_stop(checked)
        if stop is not None:
            self._stopped = True
        return stop


class StreamDetokenizer(_PieceText):
    """Incremental text with ``tokenizers.decoders.DecodeStream``: one native call per
    token. Stop strings and the hold-back of a possible stop prefix are the base
    class's. Tokens that end inside a multi-byte character wait for the next one;
    when the request ends with them, they are decoded as they are."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__(tokenizer, prompt_token_ids, params)
        self._backend = tokenizer.backend_tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        self._pending: list[int] = []

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str | None:
        step = self._stream.step
        backend = self._backend
        for token in new_token_ids:
            if self._stopped:
                return None
            self._num_output += 1
            piece = step(backend, token)
            if piece is None:
                self._pending.append(token)
                continue
            self._pending.clear()
            if piece:
                stop = self._append(piece)
                if stop is not None:
                    return stop
        if finished and not self._stopped and self._pending:
            rest = self._decode(self._pending)
            self._pending.clear()
            return self._append(rest)
        return None


class PieceDetokenizer(_PieceText):
    """For a tokenizer whose tokens each decode to their own text, whatever comes
    before (``tokenizer.piece_decoder(skip_special_tokens)`` gives the token -> text
    function): one call per token, no decode window."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        super().__init__(tokenizer, prompt_token_ids, params)
        self._piece: Callable[[int], str] = tokenizer.piece_decoder(params.skip_special_tokens)

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str | None:
        piece = self._piece
        for token in new_token_ids:
            if self._stopped:
                return None
            self._num_output += 1
            text = piece(token)
            if text:
                stop = self._append(text)
                if stop is not None:
                    return stop
        return None


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
) -> IncrementalDetokenizer:
    """The streaming detokenizer for a fast Hugging Face tokenizer, the per-token one
    for a tokenizer with a ``piece_decoder``, else the decode-window one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend).__module__.startswith("tokenizers"):
        return StreamDetokenizer(tokenizer, prompt_token_ids, params)
    if hasattr(tokenizer, "piece_decoder"):
        return PieceDetokenizer(tokenizer, prompt_token_ids, params)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
