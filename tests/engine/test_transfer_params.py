"""Transfer params through the engine types (the spirit of vLLM's test_ec_transfer_params.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from ec_frontend import parse_request
from ec_frontend.config import SchedulerConfig
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.noop import NoOpECConnector, NoOpKVConnector
from ec_frontend.engine.encoder_cache import EncoderCacheManager
from ec_frontend.engine.kv_cache import KVCacheManager
from ec_frontend.engine.outputs import RequestOutput
from ec_frontend.engine.request import Request, RequestStatus
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.scheduler import Scheduler

KV = {"do_remote_decode": True}
EC = {"ab12": {"peer_host": "10.0.0.1", "peer_port": 5501, "num_tokens": 4}}


@pytest.mark.parametrize(
    ("body_extra", "want_kv", "want_ec"),
    [
        ({"kv_transfer_params": KV, "ec_transfer_params": EC}, KV, EC),
        ({"ec_transfer_params": EC}, None, EC),
        ({"kv_transfer_params": KV}, KV, None),
        ({"kv_transfer_params": {}, "ec_transfer_params": {}}, {}, {}),
        ({"kv_transfer_params": None, "ec_transfer_params": None}, None, None),
        ({}, None, None),
        ({"vllm_xargs": {"other": 1}, "ec_transfer_params": EC}, None, EC),
        ({"vllm_xargs": {"kv_transfer_params": {"old": 1}}, "kv_transfer_params": KV}, KV, None),
    ],
)
def test_params_routed_into_extra_args_and_read_by_request(
    body_extra: dict[str, Any], want_kv: Any, want_ec: Any
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body_extra}
    parsed = parse_request("chat", orjson.dumps(body))
    params = SamplingParams.from_dict(parsed.sampling)
    if want_kv is None and want_ec is None and "vllm_xargs" not in body_extra:
        assert params.extra_args is None
    request = Request("r", [1, 2, 3], params)
    assert request.kv_transfer_params == want_kv
    assert request.ec_transfer_params == want_ec


@pytest.mark.parametrize(
    ("extra_args", "want_kv", "want_ec"),
    [
        (None, None, None),
        ({}, None, None),
        ({"kv_transfer_params": KV}, KV, None),
        ({"ec_transfer_params": EC, "x": 1}, None, EC),
        ({"kv_transfer_params": "not-an-object"}, None, None),
    ],
)
def test_request_reads_params_from_extra_args(
    extra_args: dict[str, Any] | None, want_kv: Any, want_ec: Any
) -> None:
    request = Request("r", [1], SamplingParams(extra_args=extra_args))
    assert request.kv_transfer_params == want_kv
    assert request.ec_transfer_params == want_ec


@pytest.mark.parametrize(
    ("first", "second", "want"),
    [
        (None, EC, EC),  # None then params
        (EC, None, EC),  # params then None
        (None, None, None),
        ({}, None, {}),
        (EC, {"cd34": {}}, {"cd34": {}}),  # a later value replaces
    ],
)
@pytest.mark.parametrize("field", ["kv_transfer_params", "ec_transfer_params"])
def test_request_output_add_keeps_params(field: str, first: Any, second: Any, want: Any) -> None:
    acc = RequestOutput("r", [1], [10], "a", **{field: first})
    acc.add(RequestOutput("r", [1], [11], "b", True, "stop", **{field: second}))
    assert getattr(acc, field) == want
    assert acc.token_ids == [10, 11]
    assert acc.text == "ab"
    assert acc.finished and acc.finish_reason == "stop"


def test_request_output_add_rejects_other_request() -> None:
    with pytest.raises(ValueError, match="cannot add"):
        RequestOutput("a").add(RequestOutput("b"))


class ParamsKV(NoOpKVConnector):
    def __init__(self, delay: bool) -> None:
        super().__init__(None, KVConnectorRole.SCHEDULER)
        self.delay = delay
        self.seen_blocks: list[int] = []

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        self.seen_blocks = block_ids
        return self.delay, {"remote_block_ids": block_ids, "do_remote_prefill": True}


class ParamsEC(NoOpECConnector):
    def __init__(self, delay: bool) -> None:
        super().__init__(None, ECConnectorRole.SCHEDULER)
        self.delay = delay

    def request_finished(self, request: Request) -> tuple[bool, Any]:
        return self.delay, {f.mm_hash: {"num_tokens": f.length} for f in request.mm_features}


def _scheduler(kv: Any, ec: Any) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
        kv_cache=KVCacheManager(16, 4),
        encoder_cache=EncoderCacheManager(64),
        ec_connector=ec,
        kv_connector=kv,
    )


def _run_one(sched: Scheduler, request: Request, h: Any) -> None:
    sched.add_request(request)
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled] == [request.request_id]


def test_free_request_returns_connector_params(h: Any) -> None:
    kv, ec = ParamsKV(False), ParamsEC(False)
    sched = _scheduler(kv, ec)
    request = h.fake_request("r", 10, images=[("img", 2, 4)])
    _run_one(sched, request, h)
    blocks = list(sched.kv_cache.block_table("r"))
    kv_params, ec_params = sched._free_request(request)
    assert kv_params == {"remote_block_ids": blocks, "do_remote_prefill": True}
    assert ec_params == {h.fake_hash("img"): {"num_tokens": 4}}
    assert sched.kv_cache.num_used_blocks == 0
    assert sched.encoder_cache.num_references() == 0


def test_free_request_without_connectors(h: Any) -> None:
    sched = _scheduler(None, None)
    request = h.fake_request("r", 10)
    _run_one(sched, request, h)
    assert sched._free_request(request) == (None, None)
    assert sched.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize(("kv_delay", "ec_delay"), [(True, False), (False, True), (True, True)])
def test_delayed_free_waits_for_the_connector(kv_delay: bool, ec_delay: bool, h: Any) -> None:
    from ec_frontend.engine.outputs import ModelRunnerOutput

    sched = _scheduler(ParamsKV(kv_delay), ParamsEC(ec_delay))
    request = h.fake_request("r", 10, images=[("img", 2, 4)])
    _run_one(sched, request, h)
    outs = sched.finish_requests("r", RequestStatus.FINISHED_STOPPED)
    assert outs[0].kv_transfer_params is not None and outs[0].ec_transfer_params is not None
    assert (sched.kv_cache.num_used_blocks > 0) == kv_delay
    assert (sched.encoder_cache.num_references() > 0) == ec_delay
    assert "r" in sched.requests and sched.has_pending_work()

    so = sched.schedule()
    sched.update_from_output(
        so,
        ModelRunnerOutput(
            kv_finished_sending={"r"} if kv_delay else None,
            ec_finished_sending={"r"} if ec_delay else None,
        ),
    )
    assert sched.kv_cache.num_used_blocks == 0
    assert sched.encoder_cache.num_references() == 0
    assert "r" not in sched.requests
    assert "r" in sched.schedule().finished_req_ids
