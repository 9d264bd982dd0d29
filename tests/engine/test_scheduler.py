"""Scheduler bookkeeping with fake requests and a fake runner (no model)."""

from __future__ import annotations

from typing import Any

import pytest
from ec_frontend.config import ECTransferConfig, SchedulerConfig
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.noop import NoOpECConnector, NoOpKVConnector
from ec_frontend.engine.encoder_cache import EncoderCacheManager
from ec_frontend.engine.kv_cache import KVCacheManager
from ec_frontend.engine.outputs import EngineCoreOutput, ModelRunnerOutput
from ec_frontend.engine.request import Request, RequestStatus
from ec_frontend.engine.scheduler import Scheduler


def make_scheduler(
    *,
    budget: int = 64,
    max_seqs: int = 8,
    max_len: int = 128,
    blocks: int | None = 64,
    block_size: int = 4,
    encoder_budget: int | None = None,
    encoder_cache: int = 64,
    ec: Any = None,
    kv: Any = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            encoder_compute_budget=encoder_budget,
        ),
        kv_cache=KVCacheManager(blocks, block_size) if blocks is not None else None,
        encoder_cache=EncoderCacheManager(encoder_cache),
        ec_connector=ec,
        kv_connector=kv,
    )


def drive(
    sched: Scheduler, h: Any, max_steps: int = 500
) -> tuple[list[Any], list[EngineCoreOutput]]:
    """Step with a fake runner until idle; (scheduler outputs, engine outputs)."""
    steps, outs = [], []
    for _ in range(max_steps):
        if not sched.has_pending_work():
            return steps, outs
        so = sched.schedule()
        steps.append(so)
        outs.extend(sched.update_from_output(so, h.fake_runner_output(so)))
    raise AssertionError("scheduler did not drain")


def assert_clean(sched: Scheduler) -> None:
    if sched.kv_cache is not None:
        assert sched.kv_cache.num_used_blocks == 0
    assert sched.encoder_cache.num_references() == 0
    assert not sched.requests and not sched.running and not sched.waiting


def test_chunked_prefill_within_token_budget(h: Any) -> None:
    sched = make_scheduler(budget=8)
    sched.add_request(h.fake_request("a", 20, max_tokens=2))
    steps, outs = drive(sched, h)
    chunks = [so.num_scheduled_tokens["a"] for so in steps if so.scheduled]
    assert chunks == [8, 8, 4, 1]
    assert [s.scheduled[0].sample for s in steps if s.scheduled] == [False, False, True, True]
    assert outs[-1].finish_reason == "length"
    assert sched.counters.prompt_tokens_computed == 20
    assert_clean(sched)


def test_running_first_then_waiting_share_the_budget(h: Any) -> None:
    sched = make_scheduler(budget=10)
    sched.add_request(h.fake_request("a", 6, max_tokens=3))
    so = sched.schedule()
    sched.update_from_output(so, h.fake_runner_output(so))
    sched.add_request(h.fake_request("b", 20, max_tokens=1))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert so.total_num_scheduled_tokens == 10


def test_max_num_seqs(h: Any) -> None:
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add_request(h.fake_request(f"r{i}", 4, max_tokens=2))
    so = sched.schedule()
    assert sorted(so.num_scheduled_tokens) == ["r0", "r1"]
    assert sched.num_waiting == 1
    outs = sched.update_from_output(so, h.fake_runner_output(so))
    outs += drive(sched, h)[1]
    assert {o.request_id for o in outs if o.finished} == {"r0", "r1", "r2"}
    assert_clean(sched)


def test_encoder_budget_cuts_chunk_before_an_image(h: Any) -> None:
    sched = make_scheduler(encoder_budget=8)
    sched.add_request(h.fake_request("a", 20, images=[("i1", 2, 8)]))
    sched.add_request(h.fake_request("b", 20, images=[("i2", 5, 8)]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 20, "b": 5}  # b stops before its image
    assert [s.encoder_inputs for s in so.scheduled] == [[0], []]
    so2 = sched.update_from_output(so, h.fake_runner_output(so)) and sched.schedule()
    assert so2.num_scheduled_tokens["b"] == 15
    assert so2.scheduled[1].encoder_inputs == [0]


@pytest.mark.parametrize(
    ("params", "tokens", "want_reason", "want_stop_reason", "want_len"),
    [
        ({"max_tokens": 3}, [5, 5, 5, 5], "length", None, 3),
        ({"max_tokens": 9}, [5, 2, 5], "stop", None, 2),  # 2 is EOS
        ({"max_tokens": 9, "ignore_eos": True}, [5, 2, 5], "length", None, 9),
        ({"max_tokens": 9, "stop_token_ids": [6]}, [5, 6, 5], "stop", 6, 2),
        ({"max_tokens": None}, [5] * 200, "length", None, 128 - 10),  # max_model_len
    ],
)
def test_stop_conditions(
    params: dict[str, Any], tokens: list[int], want_reason: str, want_stop_reason: Any,
    want_len: int, h: Any,
) -> None:  # fmt: skip
    sched = make_scheduler()
    request = h.fake_request("r", 10, **params)
    request.eos_token_ids = frozenset({2})
    sched.add_request(request)
    outs: list[EngineCoreOutput] = []
    for i in range(300):
        if not sched.has_pending_work():
            break
        so = sched.schedule()
        token = tokens[min(i, len(tokens) - 1)]
        outs.extend(sched.update_from_output(so, h.fake_runner_output(so, token)))
    assert outs[-1].finish_reason == want_reason
    assert outs[-1].stop_reason == want_stop_reason
    assert len(request.output_token_ids) == want_len
    assert_clean(sched)


def test_preemption_when_kv_is_full_never_crashes(h: Any) -> None:
    # 8 usable blocks of 4 tokens = 32 tokens; three requests want 3 x 20.
    sched = make_scheduler(blocks=9, block_size=4, max_len=32)
    for i in range(3):
        sched.add_request(h.fake_request(f"r{i}", 8, max_tokens=12))
    _, outs = drive(sched, h)
    finished = {o.request_id: o for o in outs if o.finished}
    assert set(finished) == {"r0", "r1", "r2"}
    assert all(o.finish_reason == "length" for o in finished.values())
    assert sched.counters.num_preemptions > 0
    assert sched.counters.generation_tokens == 36
    assert_clean(sched)


def test_abort_waiting_and_running(h: Any) -> None:
    sched = make_scheduler(max_seqs=1)
    sched.add_request(h.fake_request("run", 8, images=[("i", 0, 4)], max_tokens=50))
    sched.add_request(h.fake_request("wait", 8, max_tokens=50))
    so = sched.schedule()
    sched.update_from_output(so, h.fake_runner_output(so))
    outs = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("run", "abort"), ("wait", "abort")]
    assert_clean(sched)
    assert not sched.has_unfinished_requests()


class FakeEC(NoOpECConnector):
    """An EC consumer whose 'remote' holds the hashes in ``available``."""

    def __init__(self, available: set[str], role: str = "ec_consumer") -> None:
        super().__init__(ECTransferConfig("FakeEC", role), ECConnectorRole.SCHEDULER)
        self.available = available
        self.allocated: list[tuple[str, int]] = []
        self.queries: list[str] = []

    def has_cache_item(self, mm_hash: str, request: Request | None = None) -> bool:
        self.queries.append(mm_hash)
        return mm_hash in self.available

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self.allocated.append((request.request_id, index))


def test_ec_flow_cache_hit_then_load_then_encode(h: Any) -> None:
    ec = FakeEC({h.fake_hash("remote")})
    sched = make_scheduler(ec=ec)
    sched.add_request(
        h.fake_request("a", 30, images=[("local", 0, 4), ("remote", 10, 4), ("local", 20, 4)])
    )
    so = sched.schedule()
    item = so.scheduled[0]
    assert item.encoder_inputs == [0]  # encoded once; index 2 is the same image
    assert item.ec_loads == [1]
    assert ec.allocated == [("a", 1)]
    sched.update_from_output(so, h.fake_runner_output(so))
    # A second request with the cached image: a hit, no load, no encode, no connector query.
    ec.queries.clear()
    sched.add_request(h.fake_request("b", 12, images=[("local", 4, 4)]))
    so = sched.schedule()
    b = next(s for s in so.scheduled if s.request_id == "b")
    assert b.encoder_inputs == [] and b.ec_loads == []
    assert ec.queries == []
    assert sched.counters.encoder_cache_hits == 1


def test_producer_does_not_query_for_loads(h: Any) -> None:
    ec = FakeEC({h.fake_hash("img")}, role="ec_producer")
    sched = make_scheduler(ec=ec)
    sched.add_request(h.fake_request("a", 10, images=[("img", 0, 4)]))
    so = sched.schedule()
    assert so.scheduled[0].encoder_inputs == [0] and ec.queries == []


def test_item_without_source_fails_alone(h: Any) -> None:
    sched = make_scheduler(ec=FakeEC(set()))
    sched.add_request(h.fake_request("bad", 10, images=[("gone", 0, 4)], pixels=False))
    sched.add_request(h.fake_request("good", 10, max_tokens=2))
    _, outs = drive(sched, h)
    final = {o.request_id: o for o in outs if o.finished}
    assert final["bad"].finish_reason == "error"
    assert "carries no image to encode" in final["bad"].error
    assert final["good"].finish_reason == "length"
    assert_clean(sched)


def test_encoder_only_finishes_after_encoding(h: Any) -> None:
    sched = make_scheduler(blocks=None, encoder_budget=8)
    sched.add_request(h.fake_request("a", 30, images=[("i1", 2, 8), ("i2", 20, 8)]))
    sched.add_request(h.fake_request("t", 5))
    steps, outs = drive(sched, h)
    assert [[s.encoder_inputs for s in so.scheduled] for so in steps if so.scheduled] == [
        [[0], []],
        [[1]],
    ]
    assert not any(s.sample for so in steps for s in so.scheduled)
    assert {o.request_id: o.finish_reason for o in outs} == {"a": "stop", "t": "stop"}
    assert all(o.new_token_ids == [] for o in outs)
    assert sched.counters.prompt_tokens_computed == 0
    assert_clean(sched)


class FakeKV(NoOpKVConnector):
    def __init__(self, matched: int, load_async: bool) -> None:
        super().__init__(None, KVConnectorRole.SCHEDULER)
        self.matched = matched
        self.load_async = load_async
        self.allocs: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        return self.matched, self.load_async

    def update_state_after_alloc(self, request: Request, block_ids: list[int], n: int) -> None:
        self.allocs.append((request.request_id, n))


@pytest.mark.parametrize("load_async", [False, True])
def test_remote_kv_tokens_are_not_recomputed(load_async: bool, h: Any) -> None:
    kv = FakeKV(matched=100, load_async=load_async)  # more than the prompt: capped at 19
    sched = make_scheduler(kv=kv)
    sched.add_request(h.fake_request("r", 20, max_tokens=2))
    so = sched.schedule()
    if load_async:
        assert so.scheduled == []
        assert sched.num_waiting == 1
        so = sched.schedule()
        assert so.scheduled == []  # still parked
        sched.update_from_output(so, ModelRunnerOutput(kv_finished_recving={"r"}))
        so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 1}
    assert so.scheduled[0].num_computed_tokens == 19 and so.scheduled[0].sample
    assert kv.allocs[0] == ("r", 19)
    sched.update_from_output(so, h.fake_runner_output(so))
    drive(sched, h)
    assert sched.counters.kv_tokens_received == 19
    assert sched.counters.prompt_tokens_computed == 1
    assert_clean(sched)


def test_item_larger_than_the_encoder_budget_runs_alone(h: Any) -> None:
    sched = make_scheduler(encoder_budget=4)
    sched.add_request(h.fake_request("a", 12, images=[("big", 0, 8)]))
    sched.add_request(h.fake_request("b", 12, images=[("small", 0, 2)]))
    so = sched.schedule()
    assert [(s.request_id, s.encoder_inputs) for s in so.scheduled] == [("a", [0])]
    sched.update_from_output(so, h.fake_runner_output(so))
    so = sched.schedule()
    assert [(s.request_id, s.encoder_inputs) for s in so.scheduled] == [("a", []), ("b", [0])]


def test_waiting_request_pins_nothing_and_counts_its_hit_once(h: Any) -> None:
    # 5 usable blocks of 4: "first" (16 + 3 tokens) leaves no room for "second".
    sched = make_scheduler(blocks=6, block_size=4, max_len=20)
    sched.add_request(h.fake_request("first", 16, images=[("img", 0, 4)], max_tokens=3))
    so = sched.schedule()
    sched.update_from_output(so, h.fake_runner_output(so))
    sched.add_request(h.fake_request("second", 8, images=[("img", 0, 4)], max_tokens=2))
    waited = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        if "second" not in so.num_scheduled_tokens and sched.requests.get("second"):
            waited += 1
            assert sched.encoder_cache.num_references() == 0  # the hit is not pinned
        sched.update_from_output(so, h.fake_runner_output(so))
    assert waited >= 2
    assert sched.counters.encoder_cache_hits == 1
    assert_clean(sched)
