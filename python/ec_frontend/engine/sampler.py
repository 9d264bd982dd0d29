"""Token selection for a batch of rows, each with its own sampling params.

Order of operations per row: penalties (repetition, frequency, presence),
``logit_bias`` and ``allowed_token_ids``, the grammar bitmask of a constrained
row (structured outputs, see :mod:`~ec_frontend.engine.structured_output`), then
greedy argmax, or temperature,
top-k, top-p and min-p followed by a draw. A row with a ``seed`` draws from its
own ``torch.Generator``, so its output does not depend on its neighbours in the
batch. Logprobs are those of the model's raw
distribution (before penalties and temperature), as in vLLM.

Work is batched over the rows: penalties read each row's token counts
(:class:`PenaltyState`, kept by the runner and updated by one token per step,
never rebuilt from the row's history) stacked into ``[N, V]`` tensors, and the
logprobs of all rows that ask for them come from one gather, one comparison and
one ``topk``. Which rows are greedy, or use min-p, is decided from their params
on the host; the only device-to-host copy of a step without logprobs is the
sampled ids.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ec_frontend.engine.outputs import TokenLogprob
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.structured_output import GrammarState, apply_bitmask, fill_bitmask


class PenaltyState:
    """One request's token statistics for penalties, updated per sampled token.

    ``output_counts[t]``: how often ``t`` was generated (frequency and presence
    penalties); ``seen[t]``: ``t`` is in the prompt or the output (repetition
    penalty). Ids outside the vocabulary are ignored.
    """

    __slots__ = ("output_counts", "seen", "vocab_size")

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
    ) -> None:
        self.vocab_size = vocab_size
        output = torch.tensor(list(output_token_ids), dtype=torch.int64, device=device)
        output = output[output < vocab_size]
        self.output_counts = torch.bincount(output, minlength=vocab_size)[:vocab_size].float()
        prompt = torch.tensor(list(prompt_token_ids), dtype=torch.int64, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen[prompt[prompt < vocab_size]] = True
        self.seen[output] = True

    def add(self, token_id: int) -> None:
        if 0 <= token_id < self.vocab_size:
            self.output_counts[token_id] += 1
            self.seen[token_id] = True


@dataclass(slots=True)
class SamplingRow:
    """One row of the batch: its params, generator and token history.

    ``eos_token_ids`` are masked, with ``stop_token_ids``, until the row has
    ``min_tokens`` output tokens (unless ``ignore_eos``). ``grammar`` is the
    request's structured-output state, if it has one. ``penalties`` are the
    row's token counts when its owner keeps them; otherwise they are computed
    from the token history when the params ask for penalties.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Collection[int] = ()
    grammar: GrammarState | None = None
    penalties: PenaltyState | None = None

    @property
    def stop_ids_masked(self) -> list[int]:
        """Token ids this step must not produce: the stop tokens ``min_tokens`` holds
        back, and the last token of each bad word whose other tokens end the output
        (vLLM's rule: a one-token bad word is always banned)."""
        params = self.params
        held: list[int] = []
        if len(self.output_token_ids) < params.min_tokens:
            held += [] if params.ignore_eos else list(self.eos_token_ids)
            held += params.stop_token_ids
        out = self.output_token_ids
        for word in params.bad_words_token_ids or ():
            prefix = len(word) - 1
            if prefix <= len(out) and (prefix == 0 or list(out[-prefix:]) == word[:-1]):
                held.append(word[-1])
        return held


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Stateless; call it with ``[N, V]`` logits and ``N`` rows."""

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        grammar_bitmask: Future[torch.Tensor] | torch.Tensor | None = None,
        *,
        logits_writable: bool = False,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """``grammar_bitmask``: the constrained rows' bitmask, computed ahead (see
        :class:`~ec_frontend.engine.structured_output.BitmaskFiller`); computed here
        when a row has a grammar and none is given. ``logits_writable``: the caller
        does not read ``logits`` afterwards, so masks may be written into it."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        if not rows:
            return [], []
        owned = logits_writable or logits.dtype != torch.float32
        logits = logits.float()
        want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if penalized:
            logits = _apply_penalties(logits, rows, penalized)
            owned = True

        if any(
            r.params.logit_bias or r.params.allowed_token_ids is not None or r.stop_ids_masked
            for r in rows
        ):
            logits = _apply_token_masks(logits, rows)
            owned = True

        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            if isinstance(grammar_bitmask, Future):
                grammar_bitmask = grammar_bitmask.result()
            if grammar_bitmask is None:
                grammar_bitmask = fill_bitmask(
                    None,
                    [r.grammar for r in rows],
                    [r.output_token_ids for r in rows],
                    logits.shape[-1],
                )
            logits = apply_bitmask(logits, grammar_bitmask, constrained, inplace=owned)

        greedy = [r.params.is_greedy for r in rows]
        chosen = logits.argmax(dim=-1)
        if not all(greedy):
            sampled = self._sample(logits, rows)
            chosen = torch.where(torch.tensor(greedy, device=logits.device), chosen, sampled)
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is None:
            return chosen.tolist(), logprobs
        picked = _token_logprobs(raw_logprobs, chosen, rows, want_logprobs)
        token_ids = chosen.tolist()
        for i, lp in zip(want_logprobs, picked, strict=True):
            logprobs[i] = lp
        return token_ids, logprobs

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        temps = torch.tensor(
            [1.0 if r.params.is_greedy else r.params.temperature for r in rows], device=device
        )
        logits = logits / temps[:, None]

        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device)[None, :]
            drop = ranks >= torch.tensor(top_k, device=device)[:, None]
            probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            before = probs.cumsum(dim=-1) - probs
            p = torch.tensor(top_p, device=device)[:, None]
            drop |= (before > p) & (p < 1.0)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)

        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)

        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        return (probs / noise).argmax(dim=-1)


def _apply_token_masks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logit_bias`` added, then tokens outside ``allowed_token_ids`` and the stop
    tokens ``min_tokens`` holds back set to ``-inf``, for the whole batch in three
    indexed writes (a new tensor; ``logits`` is kept)."""
    vocab = logits.shape[-1]
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_values: list[float] = []
    restricted: list[int] = []
    allowed_rows: list[int] = []
    allowed_cols: list[int] = []
    held_rows: list[int] = []
    held_cols: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        for tok, value in (params.logit_bias or {}).items():
            if tok < vocab:
                bias_rows.append(i)
                bias_cols.append(tok)
                bias_values.append(value)
        if params.allowed_token_ids is not None:
            restricted.append(i)
            ids = [t for t in params.allowed_token_ids if t < vocab]
            allowed_rows.extend([i] * len(ids))
            allowed_cols.extend(ids)
        held = [t for t in row.stop_ids_masked if t < vocab]
        held_rows.extend([i] * len(held))
        held_cols.extend(held)
    device = logits.device
    out = logits.clone()
    if bias_rows:
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device))
        out.index_put_(
            index, torch.tensor(bias_values, dtype=out.dtype, device=device), accumulate=True
        )
    if restricted:
        blocked = torch.zeros(out.shape, dtype=torch.bool, device=device)
        blocked[torch.tensor(restricted, device=device)] = True
        blocked[
            torch.tensor(allowed_rows, dtype=torch.int64, device=device),
            torch.tensor(allowed_cols, dtype=torch.int64, device=device),
        ] = False
        out = out.masked_fill(blocked, float("-inf"))
    if held_rows:
        index = (torch.tensor(held_rows, device=device), torch.tensor(held_cols, device=device))
        out.index_put_(index, torch.tensor(float("-inf"), dtype=out.dtype, device=device))
    return out


def _apply_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], penalized: list[int]
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties on the ``penalized`` rows,
    batched over their stacked token statistics (a new tensor)."""
    vocab = logits.shape[-1]
    device = logits.device
    states = [
        rows[i].penalties
        or PenaltyState(vocab, device, rows[i].prompt_token_ids, rows[i].output_token_ids)
        for i in penalized
    ]
    index = torch.tensor(penalized, dtype=torch.int64, device=device)
    part = logits.index_select(0, index)
    counts = torch.stack([s.output_counts[:vocab] for s in states])
    seen = torch.stack([s.seen[:vocab] for s in states])
    params = [rows[i].params for i in penalized]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=part.dtype, device=device)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=part.dtype, device=device)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=part.dtype, device=device)
    rep = rep[:, None]
    scaled = torch.where(part > 0, part / rep, part * rep)
    part = torch.where(seen & (rep != 1.0), scaled, part)
    part -= freq[:, None] * counts
    part -= pres[:, None] * (counts > 0).to(part.dtype)
    return logits.index_copy(0, index, part)


def _token_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, rows: Sequence[SamplingRow], which: list[int]
) -> list[TokenLogprob]:
    """The sampled token's logprob and rank and the top alternatives of the rows
    ``which``, computed for all of them at once."""
    vocab = logprobs.shape[-1]
    index = torch.tensor(which, dtype=torch.int64, device=logprobs.device)
    part = logprobs.index_select(0, index)
    tokens = chosen.index_select(0, index)
    values = part.gather(1, tokens[:, None])
    ranks = (part > values).sum(dim=-1) + 1
    ks = [min(rows[i].params.logprobs or 0, vocab) for i in which]
    top_values: list[list[float]] = [[] for _ in which]
    top_ids: list[list[int]] = [[] for _ in which]
    if max(ks) > 0:
        tv, ti = part.topk(max(ks))
        top_values, top_ids = tv.tolist(), ti.tolist()
    return [
        TokenLogprob(
            token_id=token,
            logprob=value,
            rank=rank,
            top=list(zip(ids[:k], vals[:k], strict=True)),
        )
        for token, value, rank, ids, vals, k in zip(
            tokens.tolist(),
            values[:, 0].tolist(),
            ranks.tolist(),
            top_ids,
            top_values,
            ks,
            strict=True,
        )
    ]
