"""Grammar compilation, per-request matcher state and the sampler's batched bitmask,
with the built-in model's real tokenizer and random logits (no server)."""

from __future__ import annotations

import json
import random
from concurrent.futures import Future

import jsonschema
import pytest
import torch
from ec_frontend.engine.sampler import Sampler, SamplingRow
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.structured_output import (
    BitmaskFiller,
    GrammarCompiler,
    StructuredOutputError,
    apply_bitmask,
    fill_bitmask,
    unpack_bitmask,
)

from .schemas import random_schema

VOCAB = 576  # the built-in model's logits (its tokenizer has fewer tokens)


@pytest.mark.parametrize(
    ("kind", "spec", "param", "needle"),
    [
        ("json", {"type": "strin"}, "response_format.json_schema.schema", "strin"),
        ("json", {"not": {"type": "string"}}, "text.format.schema", "not"),
        ("json", {"type": "string", "pattern": "(("}, "structured_outputs.json", "unclosed group"),
        ("json", "{not json", "structured_outputs.json", "JSON schema"),
        ("json", "[1, 2]", "structured_outputs.json", "object or a boolean"),
        ("regex", "a(b", "structured_outputs.regex", "regex"),
        ("grammar", "start: undefined_rule", "structured_outputs.grammar", "undefined_rule"),
        ("grammar", "root ::= (", "structured_outputs.grammar", "grammar"),
    ],
)
def test_invalid_specs_name_the_parameter(
    compiler: GrammarCompiler, kind: str, spec: object, param: str, needle: str
) -> None:
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(kind, spec, param)
    assert info.value.param == param
    assert needle in info.value.message


def test_compilation_is_cached_by_spec(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "null"}}}
    first = compiler.compile("json", schema, "p")
    hits = compiler.hits
    reordered = {"properties": {"a": {"type": "null"}, "b": {"type": "integer"}}, "type": "object"}
    assert compiler.compile("json", reordered, "other.param") is first
    assert compiler.hits == hits + 1
    assert compiler.compile("json_object", None, "p") is not first


def _walk(compiler: GrammarCompiler, kind: str, spec: object, seed: int, limit: int = 400):
    """Constrained random walk: sample among the allowed tokens until EOS."""
    grammar = compiler.compile(kind, spec, "p")
    state = grammar.new_state()
    rng = random.Random(seed)
    out: list[int] = []
    eos = set(grammar.tokenizer.eos_tokens)
    for _ in range(limit):
        mask = fill_bitmask(None, [state], [out], VOCAB)
        allowed = unpack_bitmask(mask, VOCAB)[0].nonzero().flatten().tolist()
        token = rng.choice(allowed)
        if token in eos:
            return out, True
        out.append(token)
    return out, False


@pytest.mark.parametrize("seed", range(20))
def test_random_walk_is_always_valid(tokenizer, compiler: GrammarCompiler, seed: int) -> None:
    schema = random_schema(random.Random(seed))
    tokens, finished = _walk(compiler, "json", schema, seed)
    assert finished
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)


def test_regex_and_choice(tokenizer, compiler: GrammarCompiler) -> None:
    import re

    for seed in range(10):
        tokens, _ = _walk(compiler, "regex", r"[a-z]{2,4}-[0-9]{1,3}", seed)
        assert re.fullmatch(r"[a-z]{2,4}-[0-9]{1,3}", tokenizer.decode(tokens))
        tokens, _ = _walk(compiler, "choice", ["red", "green", "blue sky"], seed)
        assert tokenizer.decode(tokens) in ("red", "green", "blue sky")


def test_state_catches_up_over_tokens_it_did_not_sample(compiler: GrammarCompiler) -> None:
    """A decode instance (or a preempted request) syncs over output it already has:
    its masks then equal those of the state that sampled them."""
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}}}
    tokens, _ = _walk(compiler, "json", schema, seed=3)
    grammar = compiler.compile("json", schema, "p")
    for cut in (1, len(tokens) // 2, len(tokens)):
        walked = grammar.new_state()
        for i in range(cut + 1):
            expected = fill_bitmask(None, [walked], [tokens[:i]], VOCAB)
        late = grammar.new_state()
        assert torch.equal(fill_bitmask(None, [late], [tokens[:cut]], VOCAB), expected)


def test_a_state_forced_off_its_grammar_allows_only_eos(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile("regex", "[0-9]+", "p")
    state = grammar.new_state()
    letter = compiler.tokenizer.tokenize_str("x")[0]
    mask = fill_bitmask(None, [state], [[letter]], VOCAB)
    assert state.failed
    assert unpack_bitmask(mask, VOCAB)[0].nonzero().flatten().tolist() == sorted(
        compiler.tokenizer.eos_tokens
    )


def test_unpack_matches_bit_by_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 18), dtype=torch.int32, generator=gen)
    allowed = unpack_bitmask(mask, VOCAB)
    for row in range(3):
        for t in range(0, VOCAB, 7):
            bit = (int(mask[row, t // 32]) >> (t % 32)) & 1
            assert bool(allowed[row, t]) == bool(bit)
    logits = torch.zeros(3, VOCAB)
    out = apply_bitmask(logits, mask, [1])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.equal(out[1] == 0, allowed[1])


def test_sampler_batch_mixes_constrained_and_free_rows(
    tokenizer, compiler: GrammarCompiler
) -> None:
    """Batch 8 over random logits: constrained rows end valid; free rows get exactly
    the tokens they get in a batch without any grammar."""
    schemas = [random_schema(random.Random(100 + i)) for i in range(4)]
    grammars = [compiler.compile("json", s, "p") for s in schemas]
    states = [g.new_state() for g in grammars] + [None] * 4
    outputs: list[list[int]] = [[] for _ in range(8)]
    done = [False] * 8
    eos = set(compiler.tokenizer.eos_tokens)
    gen = torch.Generator().manual_seed(7)
    sampler = Sampler()
    filler = BitmaskFiller(num_threads=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    try:
        for _ in range(400):
            logits = torch.randn(8, VOCAB, generator=gen) * 3
            rows = [SamplingRow(greedy, None, [1], outputs[i], (), states[i]) for i in range(8)]
            future = filler.start([r.grammar for r in rows], outputs, VOCAB)
            tokens, _ = sampler(logits, rows, future)
            free, _ = sampler(logits[4:], rows[4:])
            assert tokens[4:] == free
            for i, t in enumerate(tokens):
                if done[i] or i >= 4:
                    continue
                if t in eos:
                    done[i] = True
                else:
                    outputs[i].append(t)
            if all(done[:4]):
                break
    finally:
        filler.shutdown()
    assert all(done[:4])
    for schema, out in zip(schemas, outputs[:4], strict=False):
        jsonschema.validate(json.loads(tokenizer.decode(out)), schema)


ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TAG = {
    "structures": [
        {"begin": "<f=add>", "schema": ADD_SCHEMA, "end": "</f>"},
        {"begin": "<tool_call>city:", "schema": CITY_SCHEMA, "end": "</tool_call>"},
    ],
    "triggers": ["<f=", "<tool_call>"],
}


@pytest.mark.parametrize(("lead", "seed"), [("hi <f=", 0), ("x <f=", 1), ("ok <tool_call>", 2)])
def test_structural_tag_forces_the_structure_after_a_trigger(
    tokenizer, compiler: GrammarCompiler, lead: str, seed: int
) -> None:
    """Free text until a trigger; from the trigger on, one structure's begin, JSON valid
    for its schema and its end are the only continuations (the walk picks at random
    among the allowed tokens, ending whenever the grammar allows)."""
    grammar = compiler.compile("structural_tag", TAG, "p")
    state = grammar.new_state()
    out = tokenizer.encode(lead)
    rng = random.Random(seed)
    eos = set(grammar.tokenizer.eos_tokens)
    for _ in range(600):
        mask = fill_bitmask(None, [state], [out], VOCAB)
        allowed = unpack_bitmask(mask, VOCAB)[0].nonzero().flatten().tolist()
        assert not state.failed
        if eos & set(allowed) and rng.random() < 0.1:
            break
        out.append(rng.choice(allowed))
    text = tokenizer.decode(out)
    schemas = {s["begin"]: (s["schema"], s["end"]) for s in TAG["structures"]}
    rest = text[len(lead) - len(lead.split(" ")[1]) :]
    begin = next(b for b in schemas if rest.startswith(b))
    schema, end = schemas[begin]
    value, stop = json.JSONDecoder().raw_decode(rest, len(begin))
    jsonschema.validate(value, schema)
    assert rest[stop:].startswith(end)


def test_structural_tag_errors_name_the_structure(compiler: GrammarCompiler) -> None:
    bad = {
        **TAG,
        "structures": [TAG["structures"][0], {**TAG["structures"][1], "schema": {"type": "strin"}}],
    }
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile("structural_tag", bad, "response_format")
    assert info.value.param == "response_format.structures[1].schema"
    never = {**TAG, "structures": [{**TAG["structures"][0], "schema": False}]}
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile("structural_tag", never, "p")
    assert info.value.param == "p.structures[0].schema"


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """``[rows, V]`` bool -> ``[rows, ceil(V / 32)]`` int32 bitmask."""
    rows, vocab = allowed.shape
    width = (vocab + 31) // 32
    padded = torch.zeros(rows, width * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(rows, width, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("vocab", [VOCAB, 151_936])
def test_apply_bitmask_equals_the_elementwise_mask(vocab: int) -> None:
    """Sparse rows (few tokens allowed), dense rows (few refused), a half row and an
    empty one, masked alone, together and beside free rows: the result is the
    logits where allowed and -inf elsewhere, and the input is left as it was."""
    gen = torch.Generator().manual_seed(vocab)
    allowed = torch.zeros(6, vocab, dtype=torch.bool)
    allowed[0, torch.randperm(vocab, generator=gen)[:5]] = True
    allowed[1] = True
    allowed[1, torch.randperm(vocab, generator=gen)[:7]] = False
    allowed[2, : vocab // 2] = True
    allowed[4] = torch.rand(vocab, generator=gen) < 0.9
    allowed[5] = torch.rand(vocab, generator=gen) < 0.1
    mask = _pack(allowed)
    assert torch.equal(unpack_bitmask(mask, vocab), allowed)
    logits = torch.randn(6, vocab, generator=gen)
    before = logits.clone()
    for rows in ([0], [1], [3], [0, 1, 2, 3, 4, 5], [1, 4], [5, 0, 2]):
        out = apply_bitmask(logits, mask, rows)
        want = logits.clone()
        for r in rows:
            want[r] = torch.where(allowed[r], logits[r], float("-inf"))
        assert torch.equal(out, want), rows
        # In place: the same values, written into the given tensor (a contiguous one
        # and a strided view, which takes torch's path instead of numpy's).
        for given in (logits.clone(), logits.t().contiguous().t()):
            done = apply_bitmask(given, mask, rows, inplace=True)
            assert done.data_ptr() == given.data_ptr()
            assert torch.equal(given, want), rows
    assert torch.equal(logits, before)


def test_sampler_writes_masks_into_logits_only_when_allowed(compiler: GrammarCompiler) -> None:
    """The runner hands the sampler logits it never reads again (``logits_writable``):
    a constrained row is masked in that tensor instead of a copy of the batch, and the
    tokens equal the copying path's; without the flag the caller's tensor is kept."""
    grammar = compiler.compile("choice", ["yes", "no"], "structured_outputs.choice")
    params = SamplingParams(temperature=0.0, max_tokens=4)
    logits = torch.randn(4, compiler.vocab_size, generator=torch.Generator().manual_seed(3))
    before = logits.clone()

    def rows() -> list[SamplingRow]:
        return [
            SamplingRow(params, None, [1], [], (), grammar.new_state() if i == 2 else None)
            for i in range(4)
        ]

    kept, _ = Sampler()(logits, rows())
    assert torch.equal(logits, before)
    written, _ = Sampler()(logits, rows(), logits_writable=True)
    assert written == kept
    assert torch.equal(logits[[0, 1, 3]], before[[0, 1, 3]])
    assert torch.isinf(logits[2]).sum() > 0 and logits[2].argmax() == kept[2]


def test_worker_thread_and_parallel_executor_give_the_inline_masks(
    tokenizer, compiler: GrammarCompiler
) -> None:
    """Six constrained rows (some started, some fresh, one free row between them):
    the masks the worker thread computes with llguidance's parallel executor equal
    the ones computed inline, row by row."""
    schemas = [random_schema(random.Random(300 + i)) for i in range(6)]
    walks = [_walk(compiler, "json", s, seed=i)[0] for i, s in enumerate(schemas)]
    grammars = [compiler.compile("json", s, "p") for s in schemas]

    def batch() -> tuple[list, list[list[int]]]:
        states = [g.new_state() for g in grammars]
        states.insert(2, None)
        outputs = [w[: len(w) // 2] for w in walks]
        outputs.insert(2, [])
        # Rows 0 and 1 have seen a prefix already: their matchers are started.
        for i in (0, 1):
            fill_bitmask(None, [states[i]], [outputs[i][:1]], VOCAB)
        return states, outputs

    inline = fill_bitmask(None, *batch(), VOCAB)
    filler = BitmaskFiller(num_threads=2)
    filler.row_costs.extend([1.0] * 16)  # predicted slow: the worker thread computes
    try:
        future = filler.start(*batch(), VOCAB)
        assert isinstance(future, Future)
        assert torch.equal(future.result(), inline)
    finally:
        filler.shutdown()
    assert bool((inline[2] == -1).all())
    assert len(filler.row_costs) == 16
