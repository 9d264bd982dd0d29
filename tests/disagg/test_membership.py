"""The proxy's membership rules without processes: registration records as vLLM's
EPD proxy takes them, the E+PD / E+P+D conflict, eviction after ``fail_threshold``
failures, probing with backoff, and forgetting registered instances after
``evicted_ttl`` (the probe loop on real processes is in ``test_fleet.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from ec_frontend.entrypoints.proxy import membership as ms


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def members(**config: Any) -> tuple[ms.Membership, Clock, list[str]]:
    clock = Clock()
    ejected: list[str] = []
    m = ms.Membership(
        ms.MembershipConfig(**config), on_eject=lambda i: ejected.append(i.url), clock=clock
    )
    return m, clock, ejected


def test_a_vllm_record_parses_and_a_bad_one_names_its_field() -> None:
    inst = ms.parse_registration({"role": "prefill_decode", "url": "http://h:8000/",
                               "ec_zmq_addrs": ["tcp://h:5555"], "dp_size": 1})  # fmt: skip
    assert (inst.role, inst.url, inst.ec_zmq_addrs, inst.dp_size) == (
        ms.Role.PREFILL_DECODE, "http://h:8000", ["tcp://h:5555"], 1,
    )  # fmt: skip
    bad = [
        ([], "body"),
        ({"role": "encoder", "url": "http://h"}, "role"),
        ({"role": "encode", "url": "h:8000"}, "url"),
        ({"role": "encode", "url": "http://h", "dp_size": 0}, "dp_size"),
        ({"role": "encode", "url": "http://h", "ec_zmq_addrs": ["a"]}, "ec_zmq_addrs"),
        ({"role": "prefill", "url": "http://h", "ec_zmq_addrs": ["a", "b"]}, "ec_zmq_addrs"),
    ]
    for body, param in bad:
        with pytest.raises(ms.BadRecord) as info:
            ms.parse_registration(body)
        assert info.value.param == param, body


def test_prefill_decode_does_not_mix_with_split_roles() -> None:
    m, _, _ = members()
    assert m.register(ms.Instance(ms.Role.PREFILL_DECODE, "http://pd"))
    with pytest.raises(ms.MembershipConflict):
        m.register(ms.Instance(ms.Role.DECODE, "http://d"))
    with pytest.raises(ms.MembershipConflict):
        m.register(ms.Instance(ms.Role.ENCODE, "http://pd"))
    assert not m.register(ms.Instance(ms.Role.PREFILL_DECODE, "http://pd", dp_size=2))
    assert m.get("http://pd") is not None and m.get("http://pd").dp_size == 2  # type: ignore[union-attr]


def test_eviction_backoff_and_return() -> None:
    m, clock, ejected = members(probe_interval=1.0, fail_threshold=3)
    m.add_static(ms.Role.ENCODE, ["http://a", "http://b"])
    for _ in range(2):
        m.report_failure("http://a")
    assert m.live(ms.Role.ENCODE) == ["http://a", "http://b"]
    m.report_success("http://a")
    for _ in range(3):
        m.report_failure("http://a")
    assert m.live(ms.Role.ENCODE) == ["http://b"] and ejected == ["http://a"]
    a = m.get("http://a")
    assert a is not None and a.next_probe == clock.now + 1.0
    waits = []
    for _ in range(6):
        m.report_failure("http://a")
        waits.append(a.next_probe - clock.now)
    assert waits == [2.0, 4.0, ms.MAX_BACKOFF, ms.MAX_BACKOFF, ms.MAX_BACKOFF, ms.MAX_BACKOFF]
    m.report_success("http://a")
    assert m.live(ms.Role.ENCODE) == ["http://a", "http://b"]
    assert m.status()["encode"] == {"live": ["http://a", "http://b"], "evicted": []}


def test_registered_instances_are_forgotten_after_the_ttl_static_ones_never() -> None:
    m, clock, _ = members(probe_interval=1.0, fail_threshold=1, evicted_ttl=10.0)
    m.add_static(ms.Role.ENCODE, ["http://127.0.0.1:9"])
    m.register(ms.Instance(ms.Role.ENCODE, "http://127.0.0.1:7"))

    async def rounds() -> None:
        async with httpx.AsyncClient() as client:
            await m.probe_once(client)
            assert m.live(ms.Role.ENCODE) == []
            clock.now += 11.0
            await m.probe_once(client)

    asyncio.run(rounds())
    assert m.status()["encode"] == {"live": [], "evicted": ["http://127.0.0.1:9"]}


def test_one_command_line_url_in_two_roles_shares_its_health() -> None:
    m, _, ejected = members(fail_threshold=2)
    m.add_static(ms.Role.ENCODE, ["http://agg"])
    m.add_static(ms.Role.PREFILL_DECODE, ["http://agg", "http://pd"])
    assert m.live(ms.Role.ENCODE) == ["http://agg"]
    assert m.live(ms.Role.PREFILL_DECODE) == ["http://agg", "http://pd"]
    with pytest.raises(ms.MembershipConflict):
        m.register(ms.Instance(ms.Role.ENCODE, "http://pd"))
    m.report_failure("http://agg")
    m.report_failure("http://agg")
    assert m.live(ms.Role.ENCODE) == [] and m.live(ms.Role.PREFILL_DECODE) == ["http://pd"]
    assert ejected == ["http://agg", "http://agg"]
    m.report_success("http://agg")
    assert m.live(ms.Role.ENCODE) == ["http://agg"]
    assert m.unregister("http://agg") and m.roles() == {ms.Role.PREFILL_DECODE}
    assert m.live(ms.Role.PREFILL_DECODE) == ["http://pd"]


def test_an_instance_that_never_answered_is_probed_every_interval() -> None:
    m, clock, _ = members(probe_interval=1.0, fail_threshold=1)
    m.add_static(ms.Role.ENCODE, ["http://starting", "http://known"])
    m.report_success("http://known")
    waits: dict[str, list[float]] = {"http://starting": [], "http://known": []}
    for _ in range(5):
        for url, seen in waits.items():
            m.report_failure(url)
            inst = m.get(url)
            assert inst is not None
            seen.append(inst.next_probe - clock.now)
    # Still starting: every interval. Known and gone: backing off.
    assert waits["http://starting"] == [1.0] * 5
    assert waits["http://known"] == [1.0, 2.0, 4.0, ms.MAX_BACKOFF, ms.MAX_BACKOFF]
    assert m.live(ms.Role.ENCODE) == []
    assert m.evicted(ms.Role.ENCODE) == ["http://starting", "http://known"]
    m.report(url="http://starting", ok=True)
    assert m.live(ms.Role.ENCODE) == ["http://starting"]
