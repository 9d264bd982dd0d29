"""Token selection for a batch of rows, each with its own sampling params.

Order of operations per row: penalties (repetition, frequency, presence),
``logit_bias`` and ``allowed_token_ids``, the grammar bitmask of a constrained
row (structured outputs, see :mod:`~ec_frontend.engine.structured_output`), then
greedy argmax, or temperature,
top-k, top-p and min-p followed by a draw. A row with a ``seed`` draws from its
own ``torch.Generator``, so its output does not depend on its neighbours in the
batch. Logprobs are those of the model's raw
distribution (before penalties and temperature), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ec_frontend.engine.outputs import TokenLogprob
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.structured_output import GrammarState, apply_bitmask, fill_bitmask


@dataclass(slots=True)
class SamplingRow:
    """One row of the batch: its params, generator and token history.

    ``eos_token_ids`` are masked, with ``stop_token_ids``, until the row has
    ``min_tokens`` output tokens (unless ``ignore_eos``). ``grammar`` is the
    request's structured-output state, if it has one.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Collection[int] = ()
    grammar: GrammarState | None = None

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
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """``grammar_bitmask``: the constrained rows' bitmask, computed ahead (see
        :class:`~ec_frontend.engine.structured_output.BitmaskFiller`); computed here
        when a row has a grammar and none is given."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        if not rows:
            return [], []
        logits = logits.float()
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        if any(r.params.has_penalties for r in rows):
            logits = logits.clone()
            for i, row in enumerate(rows):
                if row.params.has_penalties:
                    _apply_penalties(logits[i], row)

        if any(
            r.params.logit_bias or r.params.allowed_token_ids is not None or r.stop_ids_masked
            for r in rows
        ):
            logits = _apply_token_masks(logits, rows)

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
            logits = apply_bitmask(logits, grammar_bitmask, constrained)

        greedy = torch.tensor([r.params.is_greedy for r in rows], device=logits.device)
        chosen = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, rows)
            chosen = torch.where(greedy, chosen, sampled)
        token_ids = chosen.tolist()

        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if want_logprobs[i]:
                    logprobs[i] = _token_logprob(raw_logprobs[i], token_ids[i], row.params)
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
        min_p = torch.tensor([r.params.min_p for r in rows], device=device)
        if bool((min_p > 0).any()):
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


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    params = row.params
    vocab = logits.shape[-1]
    device = logits.device
    output = torch.tensor(list(row.output_token_ids), dtype=torch.int64, device=device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
    if params.repetition_penalty != 1.0:
        seen_ids = torch.tensor(
            list(row.prompt_token_ids) + list(row.output_token_ids),
            dtype=torch.int64,
            device=device,
        )
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[seen_ids[seen_ids < vocab]] = True
        penalized = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= params.frequency_penalty * counts
    logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def _token_logprob(logprobs: torch.Tensor, token_id: int, params: SamplingParams) -> TokenLogprob:
    value = logprobs[token_id]
    rank = int((logprobs > value).sum()) + 1
    top: list[tuple[int, float]] = []
    k = min(params.logprobs or 0, logprobs.shape[-1])
    if k > 0:
        values, ids = logprobs.topk(k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=float(value), rank=rank, top=top)
