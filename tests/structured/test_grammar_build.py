"""A grammar's budget and its build off the engine step, with the built-in model's
real tokenizer and the real scheduler (no server, no model).

* The size budget is exact: a grammar of ``max_bytes`` passes, one byte less of
  budget refuses it, naming the request field (a property over random choice lists).
* A request whose grammar is being built waits aside (not scheduled) while its
  neighbours step; it is scheduled once the build is done, and fails with a clear
  error when the build outlasts the timeout.
* A matcher that fails, or a sampled token outside the mask, is reported as a
  violation (the runner then fails the request); library errors come back bounded.
"""

from __future__ import annotations

import time

import pytest
import torch
from ec_frontend.config import SchedulerConfig
from ec_frontend.engine.encoder_cache import EncoderCacheManager
from ec_frontend.engine.kv_cache import KVCacheManager
from ec_frontend.engine.outputs import ModelRunnerOutput
from ec_frontend.engine.request import Request, RequestStatus
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.scheduler import Scheduler
from ec_frontend.engine.structured_output import (
    GrammarBudget,
    GrammarCompiler,
    StructuredOutputError,
    bounded,
    fill_bitmask,
    grammar_violations,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VOCAB = 576  # the built-in model's logits (its tokenizer has fewer tokens)


CHOICES = st.lists(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12),
    min_size=1,
    max_size=40,
    unique=True,
)


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(choices=CHOICES)
def test_the_size_budget_is_exact_and_names_the_field(tokenizer, choices: list[str]) -> None:
    size = len(
        GrammarCompiler(tokenizer, VOCAB, []).compile("choice", choices, "p").grammar.encode()
    )
    at_limit = GrammarCompiler(tokenizer, VOCAB, [], GrammarBudget(max_bytes=size))
    assert at_limit.compile("choice", choices, "structured_outputs.choice").grammar
    below = GrammarCompiler(tokenizer, VOCAB, [], GrammarBudget(max_bytes=size - 1))
    with pytest.raises(StructuredOutputError) as info:
        below.compile("choice", choices, "structured_outputs.choice")
    assert info.value.param == "structured_outputs.choice"
    assert f"{size:,} bytes" in info.value.message
    assert "--structured-outputs-max-grammar-bytes" in info.value.message


def test_validation_over_the_time_budget_is_refused(tokenizer) -> None:
    """A grammar whose validation outlasts the budget: refused, naming the field."""
    rules = " | ".join(f'"w{i:05d}x"' for i in range(12_000))
    slow = GrammarCompiler(tokenizer, VOCAB, [], GrammarBudget(compile_timeout_s=0.01))
    with pytest.raises(StructuredOutputError) as info:
        slow.compile("grammar", f"start: {rules}", "structured_outputs.grammar")
    assert info.value.param == "structured_outputs.grammar"
    assert "--structured-outputs-compile-timeout" in info.value.message


def _scheduler(timeout_s: float = 30.0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64, max_model_len=128, grammar_compile_timeout_s=timeout_s
        ),
        kv_cache=KVCacheManager(64, 4),
        encoder_cache=EncoderCacheManager(64),
    )


def _request(rid: str, grammar=None) -> Request:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    params.structured_outputs = grammar
    return Request(rid, [1, 2, 3], params)


def _step(sched: Scheduler) -> tuple[set[str], list]:
    so = sched.schedule()
    out = ModelRunnerOutput(sampled_token_ids={s.request_id: [5] for s in so.scheduled if s.sample})
    return {s.request_id for s in so.scheduled}, sched.update_from_output(so, out)


def _large_choice(compiler: GrammarCompiler, n: int, tag: str):
    """A choice list whose matcher takes a noticeable time to build (tens of ms)."""
    return compiler.compile("choice", [f"{tag}-{i:06d}" for i in range(n)], "p")


def test_a_request_waits_aside_while_its_grammar_builds(compiler: GrammarCompiler) -> None:
    grammar = _large_choice(compiler, 10_000, "aside")
    assert not grammar.ready
    sched = _scheduler()
    sched.add_request(_request("free"))
    sched.add_request(_request("constrained", grammar))
    assert sched.requests["constrained"].status == RequestStatus.WAITING_FOR_FSM
    assert sched.num_waiting == 2
    neighbour_steps = 0
    deadline = time.monotonic() + 60
    while True:
        scheduled, _ = _step(sched)
        if "constrained" in scheduled:
            break
        neighbour_steps += "free" in scheduled
        assert time.monotonic() < deadline
    # Scheduled only once built, and the neighbour stepped meanwhile.
    assert grammar.ready
    assert neighbour_steps > 0
    assert sched.requests["constrained"].status == RequestStatus.RUNNING


def test_a_build_over_the_timeout_fails_the_request_alone(compiler: GrammarCompiler) -> None:
    grammar = _large_choice(compiler, 10_000, "late")
    sched = _scheduler(timeout_s=0.001)
    sched.add_request(_request("free"))
    sched.add_request(_request("constrained", grammar))
    time.sleep(0.01)
    scheduled, outs = _step(sched)
    assert scheduled == {"free"}
    failed = [o for o in outs if o.request_id == "constrained"]
    assert failed and failed[0].finish_reason == "error"
    assert failed[0].error is not None
    assert failed[0].error.startswith("structured output: ")
    assert "--structured-outputs-compile-timeout" in failed[0].error
    assert "constrained" not in sched.requests
    assert sched.num_waiting == 0


def test_an_abort_while_building_frees_the_request(compiler: GrammarCompiler) -> None:
    grammar = _large_choice(compiler, 10_000, "abort")
    sched = _scheduler()
    sched.add_request(_request("constrained", grammar))
    outs = sched.finish_requests("constrained", RequestStatus.FINISHED_ABORTED)
    assert [o.finish_reason for o in outs] == ["abort"]
    assert not sched.has_unfinished_requests()


def test_violations_end_the_request_instead_of_leaving_the_grammar(
    compiler: GrammarCompiler,
) -> None:
    grammar = compiler.compile("regex", "[0-9]+", "p")
    digit, letter = compiler.tokenizer.tokenize_str("7")[0], compiler.tokenizer.tokenize_str("x")[0]
    ok, outside, failed = grammar.new_state(), grammar.new_state(), grammar.new_state()
    failed.fail("lexer fuel exhausted")
    states = [ok, outside, failed, None]
    mask = fill_bitmask(None, states, [[], [], [], []], VOCAB)
    bad = grammar_violations(states, mask, [digit, letter, digit, letter])
    assert sorted(bad) == [1, 2]
    assert bad[1].startswith("structured output: the output left its grammar: token ")
    assert bad[2].startswith("structured output: the grammar's matcher failed: ")
    assert "lexer fuel exhausted" in bad[2]
    assert outside.failed and not ok.failed


def test_library_errors_are_bounded() -> None:
    grammar_text = "start: " + " | ".join(f'"{i}"' for i in range(50_000))
    line = bounded(f"parse error near\n{grammar_text}")
    assert len(line) < 400
    assert "\n" not in line
    assert line.endswith("characters)")
    assert bounded("short") == "short"


def test_a_refused_grammar_is_reported_on_its_state(compiler: GrammarCompiler) -> None:
    """A grammar the library refuses when it builds the lexer: the state fails, the
    mask row allows only end-of-sequence, and the error text is bounded."""
    grammar = compiler.compile("grammar", "start: <[99999]>", "structured_outputs.grammar")
    grammar.build()
    assert grammar.error is not None
    assert len(grammar.error) < 400
    state = grammar.new_state()
    mask = fill_bitmask(None, [state], [[]], VOCAB)
    assert state.failed
    allowed = torch.nonzero(
        (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    ).shape[0]
    assert allowed == len(compiler.tokenizer.eos_tokens)
