"""E+PD and E+P+D over the side channels without a transfer secret (named peers).

The rest of the suite runs with signed transfer params; this module runs the
main flows of ``test_epd.py`` with no secret anywhere, as in a single-host
deployment whose operator names its producers (``--transfer-peers 127.0.0.1``;
with no secret and no named peer nothing is trusted, ``tests/security/
test_transfer_default.py``): same tokens and logprobs as an aggregated instance,
nothing recomputed.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..helpers.processes import Proc, free_port, start_all, stop_all
from .conftest import messages, proxy, serve, side_channel_ec, side_channel_kv
from .test_epd import CASES, assert_same, chat, fresh_images

pytestmark = pytest.mark.slow

TOPOLOGIES = ("E+PD/side-channel", "E+P+D")


@pytest.fixture(scope="module")
def dep(builtin_model_dir: Path) -> Iterator[dict[str, Proc]]:
    m = builtin_model_dir
    named = ["--transfer-peers", "127.0.0.1"]
    engines = {
        "agg": serve(m, "agg", secret=None),
        "e": serve(m, "e", ec=side_channel_ec("ec_producer"), secret=None),
        "pd": serve(m, "pd", ec=side_channel_ec("ec_consumer"),
                    kv=side_channel_kv("kv_both", ttl_s=10.0), secret=None, extra=named),
        "d": serve(m, "d", kv=side_channel_kv("kv_consumer"), secret=None, extra=named),
    }  # fmt: skip
    procs = start_all(list(engines.values()))
    proxies = {
        "E+PD/side-channel": proxy(
            "px_sc", encode=[engines["e"].url], decode=[engines["pd"].url], secret=None
        ),
        "E+P+D": proxy(
            "px_epd",
            encode=[engines["e"].url],
            prefill=[engines["pd"].url],
            decode=[engines["d"].url],
            secret=None,
        ),
    }
    procs += start_all(list(proxies.values()))
    yield {**engines, **proxies}
    stop_all(procs)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_unsigned_flows_are_token_identical_to_aggregated(
    dep: dict[str, Proc], topology: str, case: str, stream: bool
) -> None:
    want = chat(dep["agg"], CASES[case], stream=False)
    assert_same(chat(dep[topology], CASES[case], stream=stream), want)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_unsigned_flows_recompute_nothing(dep: dict[str, Proc], topology: str) -> None:
    names = ["e", "pd", "d"]
    before = {n: dep[n].metrics() for n in names}
    a, b = fresh_images(2, seed=zlib.crc32(b"unsigned" + topology.encode()))
    for msgs in (messages("one", a), messages("two", a, b, a)):
        chat(dep[topology], msgs, stream=False)

    def delta(name: str, metric: str) -> float:
        key = "ec_frontend_" + metric
        return dep[name].metrics().get(key, 0.0) - before[name].get(key, 0.0)

    assert delta("e", "encoder_items_computed_total") == 2
    assert delta("pd", "encoder_items_computed_total") == 0
    assert delta("pd", "ec_items_loaded_total") == 2
    assert delta("pd", "transfer_params_rejected_total") == 0
    if topology == "E+P+D":
        assert delta("d", "prompt_tokens_computed_total") <= 2
        assert delta("d", "kv_tokens_received_total") > 0
        assert delta("d", "transfer_params_rejected_total") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_unverified_kv_peer_that_fails_is_the_requests_own_error(
    dep: dict[str, Proc], stream: bool
) -> None:
    """Without a secret, params naming a named peer that cannot serve the KV are a 400."""
    ids = [2, 7, 1, 8, 2, 8]
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0},
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    r = httpx.post(dep["pd"].url + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    kv = {**r.json()["kv_transfer_params"], "remote_port": free_port()}
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 4, "temperature": 0},
            "kv_transfer_params": kv, "stream": stream}  # fmt: skip
    r = httpx.post(dep["d"].url + "/inference/v1/generate", json=body, timeout=60)
    if stream:
        assert r.status_code == 200
        assert '"code":"kv_transfer_failed"' in r.text and '"param":"kv_transfer_params"' in r.text
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("kv_transfer_failed", "kv_transfer_params")
        assert "unverified kv_transfer_params" in error["message"]
    assert httpx.get(dep["d"].url + "/health").status_code == 200
