"""The runner's own state: plain scheduler outputs, the persistent input batch,
per-request penalty counts and batched logprobs, token ids checked once."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from ec_frontend.config import SchedulerConfig
from ec_frontend.engine.encoder_cache import EncoderCacheManager
from ec_frontend.engine.kv_cache import KVCacheManager
from ec_frontend.engine.model_inputs import InputBatch, StepRequest
from ec_frontend.engine.model_runner import ModelRunner
from ec_frontend.engine.request import Request
from ec_frontend.engine.sampler import PenaltyState, Sampler, SamplingRow
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.scheduler import Scheduler
from ec_frontend.engine.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput

CPU = torch.device("cpu")


def _objects(value: Any, seen: set[int] | None = None) -> list[Any]:
    """Every object reachable from ``value`` through dataclass fields, lists, tuples,
    sets and dicts (tensors and strings are leaves)."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, torch.Tensor)):
        return [value]
    seen.add(id(value))
    found = [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            found += _objects(getattr(value, f.name), seen)
    elif isinstance(value, dict):
        for k, v in value.items():
            found += _objects(k, seen) + _objects(v, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            found += _objects(v, seen)
    return found


def test_scheduler_output_carries_plain_data(h: Any) -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256),
        kv_cache=KVCacheManager(64, 16, enable_prefix_caching=True),
        encoder_cache=EncoderCacheManager(256),
    )
    sched.add_request(h.fake_request("a", 40, images=[("x", 4, 8)], max_tokens=3))
    sched.add_request(h.fake_request("b", 20, max_tokens=3))
    steps = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        steps.append(so)
        sched.update_from_output(so, h.fake_runner_output(so))
    reached = [o for so in steps for o in _objects(so)]
    assert not [o for o in reached if isinstance(o, Request)]
    firsts = {}
    for so in steps:
        for item in so.scheduled:
            assert isinstance(item, ScheduledRequest)
            if item.request_id not in firsts:
                firsts[item.request_id] = item
            elif item.new_request is not None:
                pytest.fail(f"{item.request_id} was sent as new twice without a preemption")
    # The first step of each request carries its data and its whole block table.
    for rid, n in (("a", 40), ("b", 20)):
        first = firsts[rid]
        assert first.new_request is not None and len(first.new_request.prompt_token_ids) == n
        assert first.new_block_ids
    # Later steps send only blocks the table gained: 40 prompt tokens + 3 outputs
    # need 3 blocks, sent once each in total.
    sent = [b for so in steps for s in so.scheduled if s.request_id == "a" for b in s.new_block_ids]
    assert len(sent) == len(set(sent)) == 3


def test_preempted_request_is_sent_again_with_its_outputs(h: Any) -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
        kv_cache=KVCacheManager(4, 16, enable_prefix_caching=False),  # 3 usable blocks
        encoder_cache=EncoderCacheManager(64),
    )
    sched.add_request(h.fake_request("a", 15, max_tokens=20))
    sched.add_request(h.fake_request("b", 15, max_tokens=20))
    resent: list[NewRequestData] = []
    preempted: list[str] = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        preempted += so.preempted_req_ids
        resent += [
            s.new_request
            for s in so.scheduled
            if s.new_request is not None and s.new_request.output_token_ids
        ]
        sched.update_from_output(so, h.fake_runner_output(so))
    assert preempted
    assert resent and all(set(d.output_token_ids) == {5} for d in resent)


def test_input_batch_matches_a_reference_built_from_lists() -> None:
    """Random mixes of prefill chunks and decodes, with and without M-RoPE tables:
    ids, positions, slots and block tables equal a straightforward per-token build."""
    rng = random.Random(7)
    bs = 16
    batch = InputBatch(bs, CPU)
    live: dict[int, dict[str, Any]] = {}
    next_block = iter(range(1, 100_000))
    for _step in range(40):
        # Retire some, admit some.
        for row in [r for r in live if rng.random() < 0.15]:
            batch.free_row(row)
            del live[row]
        while len(live) < 6:
            tokens = [rng.randrange(1000) for _ in range(rng.randint(1, 90))]
            prompt_len = rng.randint(1, len(tokens))
            mrope = None
            if rng.random() < 0.5:
                mrope = torch.randint(0, 500, (3, prompt_len))
            blocks = [next(next_block) for _ in range(-(-len(tokens) // bs))]
            row = batch.add_row(tokens, blocks)
            assert row not in live
            live[row] = {
                "tokens": tokens, "blocks": blocks, "done": rng.randint(0, len(tokens) - 1),
                "prompt_len": prompt_len, "mrope": mrope, "delta": rng.randint(-5, 5),
            }  # fmt: skip
        items = []
        for row, r in live.items():
            if r["done"] >= len(r["tokens"]):
                new = rng.randint(0, 3)
                r["tokens"] += [rng.randrange(1000) for _ in range(new)]
                batch.append_tokens(row, r["tokens"][len(r["tokens"]) - new :])
                more = -(-len(r["tokens"]) // bs) - len(r["blocks"])
                extra = [next(next_block) for _ in range(more)]
                r["blocks"] += extra
                batch.append_blocks(row, extra)
            if r["done"] >= len(r["tokens"]):
                continue
            n = rng.randint(1, len(r["tokens"]) - r["done"])
            items.append((row, r, r["done"], n))
            r["done"] += n
        if not items:
            continue
        rng.shuffle(items)
        got = batch.build(
            [
                StepRequest(row, start, n, r["prompt_len"], r["mrope"], r["delta"])
                for row, r, start, n in items
            ]
        )
        ids, slots, cols, qs, lens = [], [], [], [0], []
        for _row, r, start, n in items:
            for p in range(start, start + n):
                ids.append(r["tokens"][p])
                slots.append(r["blocks"][p // bs] * bs + p % bs)
                if r["mrope"] is not None and p < r["prompt_len"]:
                    cols.append(r["mrope"][:, p].tolist())
                else:
                    cols.append([p + r["delta"]] * 3)
            qs.append(qs[-1] + n)
            lens.append(start + n)
        assert got.input_ids.tolist() == ids
        assert got.attn_metadata.slot_mapping.tolist() == slots
        assert got.positions.T.tolist() == cols
        assert got.query_start == qs
        assert got.attn_metadata.seq_lens_cpu == lens
        tables = got.attn_metadata.block_tables
        for i, (_row, r, start, n) in enumerate(items):
            need = -(-(start + n) // bs)
            assert tables[i, :need].tolist() == r["blocks"][:need]


def test_input_batch_refuses_a_step_past_its_rows() -> None:
    batch = InputBatch(16, CPU)
    row = batch.add_row([1, 2, 3], [4])
    with pytest.raises(ValueError, match="row holds 3 tokens"):
        batch.build([StepRequest(row, 2, 2, 3, None, 0)])


@pytest.mark.parametrize(
    ("prompt", "outputs"),
    [([1, 2, 3], [4, 4, 5, 9]), ([], [0, 0, 0]), ([7] * 5, []), ([2, 60, 3], [61, 2, 70])],
)
def test_penalty_state_kept_incrementally_equals_one_rebuilt(
    prompt: list[int], outputs: list[int]
) -> None:
    vocab = 64
    rebuilt = PenaltyState(vocab, CPU, prompt, outputs)
    kept = PenaltyState(vocab, CPU, prompt, [])
    for token in outputs:
        kept.add(token)
    assert torch.equal(kept.output_counts, rebuilt.output_counts)
    assert torch.equal(kept.seen, rebuilt.seen)
    assert kept.seen[[t for t in prompt + outputs if t < vocab]].all()
    assert int(kept.output_counts.sum()) == sum(1 for t in outputs if t < vocab)


def _reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The per-row formula: repetition over prompt and output, then frequency, presence."""
    p = row.params
    vocab = logits.shape[-1]
    out = logits.clone()
    counts = torch.bincount(
        torch.tensor(list(row.output_token_ids), dtype=torch.int64), minlength=vocab
    )
    counts = counts[:vocab].float()
    if p.repetition_penalty != 1.0:
        for t in set(row.prompt_token_ids) | set(row.output_token_ids):
            v = out[t]
            out[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    return out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def test_batched_penalties_equal_the_per_row_formula() -> None:
    from ec_frontend.engine.sampler import _apply_penalties

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=gen) * 3
    rng = random.Random(3)
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0),
        SamplingParams(presence_penalty=1.0),
    ]
    rows = []
    for i, p in enumerate(params):
        prompt = [rng.randrange(40) for _ in range(6)]
        out = [rng.randrange(40) for _ in range(rng.randint(0, 12))]
        kept = PenaltyState(40, CPU, prompt, []) if i % 2 == 0 else None
        for t in out if kept is not None else ():
            kept.add(t)
        rows.append(SamplingRow(p, None, prompt, out, (), None, kept))
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    got = _apply_penalties(logits, rows, penalized)
    for i, r in enumerate(rows):
        want = _reference_penalties(logits[i], r) if i in penalized else logits[i]
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)


def test_batched_logprobs_equal_per_row_values() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 30, generator=gen)
    asks = [3, None, 0, 30]
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=k), None, [0], []) for k in asks]
    tokens, logprobs = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    for i, k in enumerate(asks):
        if k is None:
            assert logprobs[i] is None
            continue
        lp = logprobs[i]
        assert lp.token_id == tokens[i] == int(ref[i].argmax())
        assert lp.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-6)
        assert lp.rank == 1
        assert [t for t, _ in lp.top] == ref[i].argsort(descending=True)[:k].tolist()
        assert [v for _, v in lp.top] == pytest.approx(
            ref[i].sort(descending=True).values[:k].tolist(), abs=1e-6
        )


def test_sampled_token_rank_counts_better_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]])
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1, logit_bias={4: 9.0}), None, [0], [])
    ]
    tokens, logprobs = Sampler()(logits, rows)
    assert tokens == [4] and logprobs[0].rank == 5  # raw logprobs: four tokens beat it
    assert logprobs[0].top[0][0] == 1


# ---- on the built-in model ------------------------------------------------------


def _new(rid: str, prompt: list[int], outputs: list[int], params: SamplingParams) -> NewRequestData:
    return NewRequestData(rid, prompt, outputs, params)


def test_out_of_vocabulary_ids_fail_their_request_alone(vlm: Any) -> None:
    runner = ModelRunner(vlm, ec_connector=_noop_ec(), num_kv_blocks=16, block_size=16)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    bad = _new("bad", [1, 2, 3], [vlm.vocab_size + 3], params)
    ok = _new("ok", [1, 2, 3], [], params)
    so = SchedulerOutput(
        scheduled=[
            ScheduledRequest("bad", 3, 1, [1], sample=True, new_request=bad),
            ScheduledRequest("ok", 0, 3, [2], sample=True, new_request=ok),
        ]
    )
    out = runner.execute(so)
    assert "vocabulary" in out.failed["bad"] and "output" in out.failed["bad"]
    assert "ok" not in out.failed and len(out.sampled_token_ids["ok"]) == 1
    assert runner.counters.lm_requests == 1


def _noop_ec() -> Any:
    from ec_frontend.connectors.base import ECConnectorRole
    from ec_frontend.connectors.noop import NoOpECConnector

    return NoOpECConnector(None, ECConnectorRole.WORKER)


@pytest.mark.slow
def test_incremental_sampling_state_matches_history_under_preemption(
    make_engine: Any, processor: Any, h: Any
) -> None:
    """Penalties, logprobs and seeded draws: a tight engine (preemptions) and an
    engine whose sampler rebuilds penalties from each row's whole history every step
    give the same tokens and logprobs as a roomy engine keeping them incrementally."""

    def params(i: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=30, temperature=0.8, seed=10 + i, ignore_eos=True, logprobs=2,
            repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
        )  # fmt: skip

    inputs = [h.chat_inputs(processor, f"say something {i}", []) for i in range(3)]

    def run(core: Any) -> dict[str, Any]:
        for i, x in enumerate(inputs):
            core.add_request(f"r{i}", x, params(i))
        got = h.run_to_completion(core)
        return {
            rid: (o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs])
            for rid, o in got.items()
        }

    roomy, _ = make_engine(enable_prefix_caching=False)
    want = run(roomy)
    assert all(len(v[0]) == 30 for v in want.values())

    history, _ = make_engine(enable_prefix_caching=False)
    rows = history.runner._sampling_row
    history.runner._sampling_row = lambda state: dataclasses.replace(rows(state), penalties=None)
    assert run(history) == want

    tight, _ = make_engine(num_kv_blocks=8, max_model_len=96, enable_prefix_caching=False)
    got = run(tight)
    # A recomputed prefix gives the same tokens; its logprobs may differ in the last
    # float digits (a prefill's sums run in another order than the decodes').
    for rid, (tokens, lps) in want.items():
        assert got[rid][0] == tokens, rid
        for (t, lp, top), (t2, lp2, top2) in zip(lps, got[rid][1], strict=True):
            assert t == t2 and [i for i, _ in top] == [i for i, _ in top2]
            assert lp2 == pytest.approx(lp, abs=1e-4)
    assert tight.stats().preemptions_total > 0
    assert not tight.runner.requests
    h.assert_no_leaks(tight)
