"""Scheduler bookkeeping for the disaggregated paths, with small fake connectors.

* EC items fetched in the background: the request waits aside while others run;
* a remote prefill that covers the whole prompt and hands over its sampled
  token; a failed load fails the request alone.
"""

from __future__ import annotations

from typing import Any

import pytest
from ec_frontend.config import SchedulerConfig
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.kv_base import KVConnectorRole, KVLoadResult
from ec_frontend.connectors.noop import NoOpECConnector, NoOpKVConnector
from ec_frontend.engine.encoder_cache import EncoderCacheManager
from ec_frontend.engine.kv_cache import KVCacheManager
from ec_frontend.engine.outputs import EngineCoreOutput, ModelRunnerOutput
from ec_frontend.engine.request import Request, RequestStatus
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.scheduler import Scheduler

TOKEN = 5


def scheduler(ec: Any = None, kv: Any = None) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128),
        kv_cache=KVCacheManager(64, 4),
        encoder_cache=EncoderCacheManager(64),
        ec_connector=ec,
        kv_connector=kv,
    )


def request(rid: str, n: int = 10, max_tokens: int = 3) -> Request:
    return Request(rid, [1] * n, SamplingParams(max_tokens=max_tokens), eos_token_id=99)


def step(sched: Scheduler, **runner: Any) -> tuple[list[str], list[EngineCoreOutput]]:
    so = sched.schedule()
    out = ModelRunnerOutput(
        sampled_token_ids={s.request_id: [TOKEN] for s in so.scheduled if s.sample}, **runner
    )
    return [s.request_id for s in so.scheduled], sched.update_from_output(so, out)


def run(sched: Scheduler, limit: int = 100) -> list[EngineCoreOutput]:
    outs: list[EngineCoreOutput] = []
    for _ in range(limit):
        if not sched.has_pending_work():
            return outs
        outs += step(sched)[1]
    raise AssertionError("did not drain")


class SlowEC(NoOpECConnector):
    """Not ready for ``rid`` until ``ready_after`` calls have been made."""

    def __init__(self, rid: str, ready_after: int) -> None:
        super().__init__(None, ECConnectorRole.SCHEDULER)
        self.rid, self.left = rid, ready_after

    def is_request_ready(self, request: Request) -> bool:
        if request.request_id != self.rid:
            return True
        self.left -= 1
        return self.left < 0


def test_request_fetching_items_waits_aside_while_others_run() -> None:
    sched = scheduler(ec=SlowEC("slow", ready_after=3))
    sched.add_request(request("slow"))
    sched.add_request(request("fast"))
    first, _ = step(sched)
    assert first == ["fast"]
    assert sched.num_waiting == 1 and sched.has_unfinished_requests()
    seen = [step(sched)[0] for _ in range(3)]
    assert ["slow"] in seen
    outs = run(sched)
    assert {o.request_id for o in outs if o.finished} >= {"slow"}
    assert not sched.requests and sched.kv_cache is not None
    assert sched.kv_cache.num_used_blocks == 0


def test_request_aborted_while_fetching_items_is_released() -> None:
    sched = scheduler(ec=SlowEC("slow", ready_after=1000))
    sched.add_request(request("slow"))
    assert step(sched)[0] == []
    outs = sched.finish_requests("slow", RequestStatus.FINISHED_ABORTED)
    assert [o.finish_reason for o in outs] == ["abort"]
    assert not sched.has_unfinished_requests() and sched.num_waiting == 0


class RemotePrefillKV(NoOpKVConnector):
    """Loads the whole prompt asynchronously and hands over ``result``."""

    hands_over_sampled_token = True

    def __init__(self, result: KVLoadResult | None) -> None:
        super().__init__(None, KVConnectorRole.SCHEDULER)
        self.result = result
        self.allocated: list[int] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        return request.num_prompt_tokens - num_computed, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], n: int) -> None:
        self.allocated.append(n)

    def get_load_result(self, request: Request) -> KVLoadResult | None:
        return self.result


@pytest.mark.parametrize(
    ("max_tokens", "first", "want_tokens", "want_reason"),
    [
        (3, 42, [42, TOKEN, TOKEN], "length"),
        (1, 42, [42], "length"),
        (5, 99, [99], "stop"),
    ],
    ids=["continues", "max-tokens-1", "eos-first"],
)
def test_remote_prefill_hands_over_the_sampled_token(
    max_tokens: int, first: int, want_tokens: list[int], want_reason: str
) -> None:
    kv = RemotePrefillKV(KVLoadResult(first_token_id=first))
    sched = scheduler(kv=kv)
    sched.add_request(request("d", n=10, max_tokens=max_tokens))
    scheduled, _ = step(sched)
    assert scheduled == [] and kv.allocated == [10]
    _, outs = step(sched, kv_finished_recving={"d"})
    outs += run(sched)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == want_tokens
    assert outs[-1].finished and outs[-1].finish_reason == want_reason
    assert sched.counters.kv_tokens_received == 10
    assert sched.counters.prompt_tokens_computed == 0
    assert sched.kv_cache is not None and sched.kv_cache.num_used_blocks == 0


def test_remote_prefill_without_a_token_recomputes_the_last_prompt_token() -> None:
    sched = scheduler(kv=RemotePrefillKV(None))
    sched.add_request(request("d", n=10, max_tokens=2))
    step(sched)
    step(sched, kv_finished_recving={"d"})
    outs = run(sched)
    assert [t for o in outs for t in o.new_token_ids] == [TOKEN, TOKEN]
    assert sched.counters.prompt_tokens_computed == 1


def test_failed_remote_load_fails_the_request_alone() -> None:
    sched = scheduler(kv=RemotePrefillKV(KVLoadResult(error="prefill is gone")))
    sched.add_request(request("d"))
    step(sched)
    _, outs = step(sched, kv_finished_recving={"d"})
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [
        ("d", "error", "prefill is gone")
    ]
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache is not None and sched.kv_cache.num_used_blocks == 0
