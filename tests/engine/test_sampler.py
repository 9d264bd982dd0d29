"""Sampler: greedy, truncations, seeds, penalties, logit_bias, allowed_token_ids and
logprobs on hand-made logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ec_frontend.engine.sampler import Sampler, SamplingRow, make_generator
from ec_frontend.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]])


def row(
    generator: torch.Generator | None = None, out: tuple[int, ...] = (), **kw: Any
) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), generator, [0], list(out))


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"temperature": 0.0}, {1}),
        ({"temperature": 1.0, "top_k": 1}, {1}),
        ({"temperature": 1.0, "top_k": 2}, {1, 3}),
        ({"temperature": 1.0, "top_p": 0.01}, {1}),
        ({"temperature": 1.0, "top_p": 0.6}, {1, 3}),
        ({"temperature": 1.0, "min_p": 0.5}, {1, 3}),
        ({"temperature": 1.0, "min_p": 0.95}, {1}),
        ({"temperature": 0.0, "repetition_penalty": 2.0, "out": (1,)}, {3}),
        ({"temperature": 0.0, "frequency_penalty": 1.0, "out": (1,)}, {3}),
        (
            {"temperature": 0.0, "presence_penalty": 2.0, "frequency_penalty": 0.5, "out": (1, 3)},
            {2},
        ),
        ({"temperature": 0.0, "frequency_penalty": 0.1, "out": (1,)}, {1}),
        ({"temperature": 0.0, "logit_bias": {4: 10.0}}, {4}),
        ({"temperature": 0.0, "logit_bias": {1: -0.2}}, {3}),
        ({"temperature": 0.0, "logit_bias": {1: -100.0, 3: -100.0}}, {2}),
        ({"temperature": 0.0, "logit_bias": {}}, {1}),
        ({"temperature": 0.0, "allowed_token_ids": [0, 2]}, {2}),
        ({"temperature": 1.0, "allowed_token_ids": [0, 4]}, {0, 4}),
        ({"temperature": 1.0, "allowed_token_ids": [3, 1], "top_k": 1}, {1}),
        ({"temperature": 0.0, "allowed_token_ids": [0, 2], "logit_bias": {0: 5.0}}, {0}),
        ({"temperature": 0.0, "allowed_token_ids": [4, 99]}, {4}),
    ],
)
def test_truncations_and_penalties(params: dict[str, Any], allowed: set[int]) -> None:
    out = params.pop("out", ())
    sampler = Sampler()
    seen = set()
    for seed in range(40):
        tokens, _ = sampler(LOGITS, [row(make_generator(seed, torch.device("cpu")), out, **params)])
        seen.add(tokens[0])
    assert seen <= allowed
    if len(allowed) > 1:
        assert seen == allowed


def test_seeded_rows_do_not_depend_on_neighbours() -> None:
    sampler = Sampler()
    logits = torch.randn(1, 100)

    def draw(neighbours: int) -> list[int]:
        gen = make_generator(123, torch.device("cpu"))
        picked = []
        for _ in range(10):
            rows = [row(gen, temperature=1.0)] + [row(temperature=1.0)] * neighbours
            tokens, _ = sampler(logits.expand(1 + neighbours, -1), rows)
            picked.append(tokens[0])
        return picked

    assert draw(0) == draw(5)
    assert len(set(draw(0))) > 1


def test_logprobs_rank_and_top() -> None:
    tokens, lps = Sampler()(LOGITS, [row(temperature=0.0, logprobs=2), row(temperature=0.0)][:1])
    lp = lps[0]
    assert lp is not None and lp.token_id == tokens[0] == 1 and lp.rank == 1
    want = torch.log_softmax(LOGITS[0], -1)
    assert lp.logprob == pytest.approx(float(want[1]))
    assert [t for t, _ in lp.top] == [1, 3]
    _, none = Sampler()(LOGITS, [row(temperature=0.0)])
    assert none == [None]


def test_row_count_must_match() -> None:
    with pytest.raises(ValueError, match="sampling rows"):
        Sampler()(LOGITS, [])


def test_token_masks_apply_per_row_in_one_batch() -> None:
    logits = LOGITS.repeat(4, 1)
    rows = [
        row(temperature=0.0, logit_bias={0: 4.0}),
        row(temperature=0.0),
        row(temperature=0.0, allowed_token_ids=[2]),
        row(temperature=0.0, logit_bias={2: 1.5}, allowed_token_ids=[2, 3]),
    ]
    tokens, _ = Sampler()(logits, rows)
    assert tokens == [0, 1, 2, 3]
    assert torch.equal(logits, LOGITS.repeat(4, 1))


def test_logprobs_are_those_before_the_bias() -> None:
    tokens, logprobs = Sampler()(LOGITS, [row(temperature=0.0, logit_bias={4: 50.0}, logprobs=1)])
    raw = torch.log_softmax(LOGITS[0], dim=-1)
    assert tokens == [4]
    lp = logprobs[0]
    assert lp is not None
    assert lp.logprob == pytest.approx(float(raw[4]))
    assert lp.top[0][0] == 1


def test_min_tokens_holds_back_eos_and_stop_ids() -> None:
    def pick(out: tuple[int, ...], eos: tuple[int, ...] = (1,), **kw: Any) -> int:
        r = SamplingRow(SamplingParams(temperature=0.0, **kw), None, [0], list(out), eos)
        return Sampler()(LOGITS, [r])[0][0]

    assert pick((), min_tokens=0) == 1
    assert pick((), min_tokens=2) == 3
    assert pick((5,), min_tokens=2) == 3
    assert pick((5, 5), min_tokens=2) == 1
    assert pick((), min_tokens=2, stop_token_ids=[3]) == 2
    assert pick((), min_tokens=2, ignore_eos=True) == 1
    assert pick((), eos=(), min_tokens=2) == 1


@pytest.mark.parametrize(
    ("words", "out", "want"),
    [
        ([[1]], (), 3),  # a one-token word is banned everywhere
        ([[1], [3]], (), 2),
        ([[2, 1]], (), 1),  # its prefix has not been generated
        ([[2, 1]], (2,), 3),  # it has: the word's last token is banned
        ([[2, 1]], (2, 0), 1),  # the prefix must end the output
        ([[0, 2, 1]], (0, 2), 3),
        ([[0, 2, 1]], (4, 2), 1),
        ([[2, 1], [4, 3]], (4,), 1),
        ([[2, 1], [4, 3]], (2,), 3),
    ],
)
def test_bad_words_ban_the_last_token_after_their_prefix(
    words: list[list[int]], out: tuple[int, ...], want: int
) -> None:
    """vLLM's rule (``v1/sample/ops/bad_words.py``), batched with the other masks."""
    r = row(temperature=0.0, out=out)
    r.params.bad_words_token_ids = words
    other = row(temperature=0.0, out=out)
    tokens, _ = Sampler()(LOGITS.repeat(2, 1), [r, other])
    assert tokens == [want, 1]
