"""Transfer-param trust (issue 15, H2; DESIGN 4.3): a client never chooses the sockets an
instance opens.

Before: any client of an EC or KV consumer (directly, or through the proxy, which
forwarded client params) named ``peer_host``/``peer_port`` or
``remote_host``/``remote_port`` and the consumer connected there; 500 entries in one
text-only request opened 500 connections. Here a loopback listener (:func:`recording_peer`) stands
where a client points, and counts the connections it receives. A consumer that
trusts it (an allowlist naming it) shows that it would see them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ec_frontend.config import (
    TRANSFER_SECRET_ENV,
    ConfigError,
    ECTransferConfig,
    KVTransferConfig,
    TransferTrust,
    parse_transfer_peers,
)
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.ec_side_channel import ECSideChannelConnector
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.kv_side_channel import KVSideChannelConnector
from ec_frontend.connectors.kv_transfer_params import prompt_hash
from ec_frontend.connectors.transfer_trust import (
    check_peer,
    check_signature,
    loggable,
    new_token,
    sign,
    signed,
)
from ec_frontend.engine.request import Request
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.entrypoints.proxy.app import strip_transfer_params
from ec_frontend.model.processor import MultiModalFeature

from ..disagg.conftest import messages, png_data_url, proxy, serve, side_channel_ec, side_channel_kv
from ..helpers.processes import Proc, start_all, stop_all
from .test_side_channel_limits import FakePeer

SECRET = b"transfer-trust-test-secret-01234"
HASH = "0123456789abcdef" * 2


def recording_peer() -> FakePeer:
    """A loopback listener that counts the connections it accepts (``accepted``) and
    closes each after reading the request."""
    return FakePeer(lambda conn: None)


@pytest.fixture
def recorder() -> Iterator[FakePeer]:
    r = recording_peer()
    yield r
    r.close()


def entry(port: int, host: str = "127.0.0.1", rows: int = 4) -> dict[str, Any]:
    return {"peer_host": host, "peer_port": port, "num_tokens": rows, "dtype": "float32",
            "shape": [rows, 32], "token": new_token()}  # fmt: skip


# ---- signatures -------------------------------------------------------------------


def _signed_entry() -> dict[str, Any]:
    return signed(SECRET, "ec", HASH, entry(5501), 60.0)


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda e: e, None),
        (lambda e: {**e, "peer_port": 5502}, "bad signature"),
        (lambda e: {**e, "peer_host": "10.0.0.9"}, "bad signature"),
        (lambda e: {**e, "shape": [4, 33]}, "bad signature"),
        (lambda e: {**e, "extra": 1}, "bad signature"),
        (lambda e: {k: v for k, v in e.items() if k != "signature"}, "unsigned"),
        (lambda e: {**e, "signature": "v1.1.2.3"}, "malformed"),
        (lambda e: {**e, "signature": 7}, "malformed"),
        (lambda e: signed(b"another-secret-of-enough-length", "ec", HASH, e, 60), "bad signature"),
        (lambda e: signed(SECRET, "kv", HASH, e, 60), "bad signature"),
        (lambda e: signed(SECRET, "ec", "f" * 32, e, 60), "bad signature"),
        (lambda e: signed(SECRET, "ec", HASH, e, -60), "expired"),
        (lambda e: signed(SECRET, "ec", HASH, e, 10**6), "too far in the future"),
    ],
    ids=[
        "valid",
        "port",
        "host",
        "shape",
        "added-key",
        "unsigned",
        "malformed",
        "not-a-string",
        "other-secret",
        "other-kind",
        "other-item",
        "expired",
        "far-future",
    ],
)
def test_signature_binds_every_field_the_item_and_the_time(tamper: Any, reason: str | None) -> None:
    got = check_signature(SECRET, "ec", HASH, tamper(_signed_entry()))
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


def test_a_signed_entry_is_accepted_once() -> None:
    e = _signed_entry()
    assert check_signature(SECRET, "ec", HASH, e, consume=False) is None
    assert check_signature(SECRET, "ec", HASH, e) is None
    assert check_signature(SECRET, "ec", HASH, e) == "signature already used (replay)"
    # The same entry signed again (a fresh nonce) is a new credential.
    fresh = {**e, "signature": sign(SECRET, "ec", HASH, {k: v for k, v in e.items()
                                                        if k != "signature"}, 60)}  # fmt: skip
    assert check_signature(SECRET, "ec", HASH, fresh) is None


# ---- the peer allowlist ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("secret", "peers", "host", "port", "allowed"),
    [
        # Neither a secret nor named peers: no peer at all, loopback included.
        (None, None, "127.0.0.1", 5501, False),
        (None, None, "127.9.9.9", 1, False),
        (None, None, "::1", 5600, False),
        (None, None, "localhost", 5501, False),
        (None, None, "10.0.0.1", 5501, False),
        (None, None, "0.0.0.0", 5501, False),
        (SECRET, None, "10.0.0.1", 5501, True),
        (SECRET, None, "encoder-1.internal", 5501, True),
        (None, "10.0.0.0/8:5500-5600", "10.1.2.3", 5550, True),
        (None, "10.0.0.0/8:5500-5600", "10.1.2.3", 5601, False),
        (None, "10.0.0.0/8:5500-5600", "127.0.0.1", 5550, False),
        (SECRET, "10.0.0.0/8:5500-5600", "11.0.0.1", 5550, False),
        (None, "encoder-1:5501", "encoder-1", 5501, True),
        (None, "encoder-1:5501", "ENCODER-1", 5501, True),
        (None, "encoder-1:5501", "encoder-1.evil", 5501, False),
        (None, "[fd00::/8]:*", "fd00::1", 9, True),
        (None, "[fd00::/8]", "fe80::1", 9, False),
        (None, "192.168.1.5", "192.168.1.5", 22, True),
        (None, "192.168.1.5", "::ffff:192.168.1.5", 22, False),
    ],
)
def test_peer_allowlist(
    secret: bytes | None, peers: str | None, host: str, port: int, allowed: bool
) -> None:
    trust = TransferTrust(secret=secret, peers=parse_transfer_peers(peers) if peers else None)
    assert (check_peer(trust, host, port) is None) is allowed


@pytest.mark.parametrize(
    "spec", ["", " , ", "10.0.0.0/8:0", "10.0.0.0/8:6-5", "h:x", "[::1", "a b:1", "h:70000"]
)
def test_bad_peer_lists_are_config_errors(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_transfer_peers(spec)
    assert info.value.param == "transfer_peers"


def test_secret_from_flag_file_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRANSFER_SECRET_ENV, raising=False)
    assert TransferTrust.from_options().secret is None
    monkeypatch.setenv(TRANSFER_SECRET_ENV, "from-the-environment-0123")
    assert TransferTrust.from_options().secret == b"from-the-environment-0123"
    assert TransferTrust.from_options("from-the-flag-0123456").secret == b"from-the-flag-0123456"
    path = tmp_path / "secret"
    path.write_text("from-a-file-0123456789\n")
    assert TransferTrust.from_options(secret_file=str(path)).secret == b"from-a-file-0123456789"
    assert "from-the" not in repr(TransferTrust.from_options())
    for kwargs, param in [
        ({"secret": "short"}, "transfer_secret"),
        ({"secret": "a" * 20, "secret_file": str(path)}, "transfer_secret"),
        ({"secret_file": str(tmp_path / "missing")}, "transfer_secret_file"),
        ({"peers": "nope:x"}, "transfer_peers"),
    ]:
        with pytest.raises(ConfigError) as info:
            TransferTrust.from_options(**kwargs)
        assert info.value.param == param


# ---- consumers, in process, against a recorder ------------------------------------------


def ec_request(
    rid: str, params: dict[str, Any] | None, hashes: tuple[str, ...] = (HASH,)
) -> Request:
    feats = [MultiModalFeature(h, 1 + 4 * i, 4, (1, 4, 4), torch.zeros(16, 8))
             for i, h in enumerate(hashes)]  # fmt: skip
    extra = {"ec_transfer_params": params} if params is not None else None
    return Request(rid, [1] * 20, SamplingParams(max_tokens=1, extra_args=extra), mm_features=feats)


def ec_consumer(**trust: Any) -> ECSideChannelConnector:
    config = ECTransferConfig(
        "ECSideChannelConnector", "ec_consumer", {"timeout_s": 1.0}, trust=TransferTrust(**trust)
    )
    return ECSideChannelConnector(config, ECConnectorRole.SCHEDULER)


def settle(recorder: FakePeer, conn: ECSideChannelConnector, request: Request) -> int:
    """Runs the request through the consumer's scheduler half (prefetch, then finish and
    release) and returns the connections the recorder saw."""
    deadline = time.monotonic() + 5
    while not conn.is_request_ready(request) and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.request_finished(request)
    if conn._pool is not None:
        conn._pool.shutdown(wait=True)
        conn._pool = None
    time.sleep(0.2)
    return recorder.accepted


def test_signed_consumer_pulls_a_signed_entry_once_and_refuses_its_replay(
    recorder: FakePeer,
) -> None:
    conn = ec_consumer(secret=SECRET)
    params = {HASH: signed(SECRET, "ec", HASH, entry(recorder.port), 60)}
    assert settle(recorder, conn, ec_request("r1", params)) == 1
    assert conn.params_rejected == 0
    assert settle(recorder, conn, ec_request("r2", params)) == 1
    assert conn.params_rejected == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda port: entry(port),
        lambda port: signed(b"a-guessed-secret-0123456789", "ec", HASH, entry(port), 60),
        lambda port: signed(SECRET, "ec", HASH, entry(port), -30),
        lambda port: signed(SECRET, "ec", "e" * 32, entry(port), 60),
    ],
    ids=["unsigned", "forged", "expired", "other-item"],
)
def test_signed_consumer_refuses_other_entries_without_connecting(
    recorder: FakePeer, make: Any
) -> None:
    conn = ec_consumer(secret=SECRET)
    request = ec_request("r", {HASH: make(recorder.port)})
    assert not conn.has_cache_item(HASH, request)
    assert settle(recorder, conn, request) == 0
    assert conn.params_rejected == 1


def test_without_a_secret_only_named_peers_are_contacted(recorder: FakePeer) -> None:
    # The default (no secret, no named peer) trusts no one, loopback included.
    default = ec_consumer()
    assert settle(recorder, default, ec_request("a", {HASH: entry(recorder.port)})) == 0
    assert default.params_rejected == 1
    loopback = ec_consumer(peers=parse_transfer_peers("127.0.0.1"))
    assert settle(recorder, loopback, ec_request("a", {HASH: entry(recorder.port)})) == 1
    # A name is never resolved: "localhost" is not an address on the list.
    named = ec_request("b", {HASH: entry(recorder.port, host="localhost")})
    assert settle(recorder, loopback, named) == 1 and loopback.params_rejected == 1
    narrow = ec_consumer(peers=parse_transfer_peers(f"127.0.0.1:{recorder.port + 1}"))
    assert settle(recorder, narrow, ec_request("c", {HASH: entry(recorder.port)})) == 1
    assert narrow.params_rejected == 1


@pytest.mark.parametrize("own_item", [False, True], ids=["text-only", "with-its-image"])
def test_500_entries_open_no_connection(recorder: FakePeer, own_item: bool) -> None:
    # Before: a text-only request with 500 entries made 500 outbound connections
    # (the consumer "released" every entry it was offered).
    params = {f"{i:032x}": entry(recorder.port) for i in range(500)}
    if own_item:
        params[HASH] = entry(recorder.port)
    conn = ec_consumer()
    request = ec_request("r", params, (HASH,) if own_item else ())
    assert settle(recorder, conn, request) == 0
    assert conn.params_rejected == (1 if own_item else 0)


def kv_request(ids: list[int], params: dict[str, Any]) -> Request:
    return Request(
        "d", ids, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    )


def kv_params(ids: list[int], port: int) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
            "remote_request_id": "p-1", "remote_block_ids": [1], "remote_host": "127.0.0.1",
            "remote_port": port, "remote_num_tokens": len(ids), "first_token_id": 3,
            "mrope_position_delta": 0, "prompt_hash": prompt_hash(ids),
            "token": new_token()}  # fmt: skip


@pytest.mark.parametrize(
    ("secret", "peers", "sign_with", "loads"),
    [
        (SECRET, None, None, False),
        (SECRET, None, b"a-guessed-secret-0123456789", False),
        (SECRET, None, SECRET, True),
        (None, "127.0.0.1", None, True),
        (None, None, None, False),
    ],
    ids=["unsigned", "forged", "signed", "no-secret-named-peer", "no-secret-no-peer"],
)
def test_kv_consumer_checks_params_before_anything_else(
    recorder: FakePeer,
    secret: bytes | None,
    peers: str | None,
    sign_with: bytes | None,
    loads: bool,
) -> None:
    ids = [4, 5, 6, 7]
    params = kv_params(ids, recorder.port)
    if sign_with is not None:
        params = signed(sign_with, "kv", "p-1", params, 30)
    trust = TransferTrust(secret, parse_transfer_peers(peers) if peers else None)
    conn = KVSideChannelConnector(
        KVTransferConfig("KVSideChannelConnector", "kv_consumer", trust=trust),
        KVConnectorRole.SCHEDULER,
    )
    got = conn.get_num_new_matched_tokens(kv_request(ids, params), 0)
    assert got == ((len(ids), True) if loads else (0, False))
    assert conn.params_rejected == (0 if loads else 1)
    assert conn.local_prefill_fallbacks == (0 if loads else 1)


# ---- the proxy's public edge ------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "removed", "left"),
    [
        ("chat", {"ec_transfer_params": {"h": 1}, "kv_transfer_params": {}},
         ["ec_transfer_params", "kv_transfer_params"], {}),
        ("chat", {"vllm_xargs": {"ec_transfer_params": {}, "x": 1}},
         ["vllm_xargs.ec_transfer_params"], {"vllm_xargs": {"x": 1}}),
        ("generate", {"sampling_params": {"extra_args": {"kv_transfer_params": {}}, "n": 1}},
         ["sampling_params.extra_args.kv_transfer_params"],
         {"sampling_params": {"extra_args": {}, "n": 1}}),
        ("chat", {"ec_transfer_params": None, "model": "m"}, [], {"model": "m"}),
        ("chat", {"vllm_xargs": {"a": 1}}, [], {"vllm_xargs": {"a": 1}}),
    ],
    ids=["top-level", "vllm-xargs", "generate-extra-args", "null", "untouched"],
)  # fmt: skip
def test_proxy_strips_client_transfer_params(
    endpoint: str, body: dict[str, Any], removed: list[str], left: dict[str, Any]
) -> None:
    assert strip_transfer_params(endpoint, body) == removed
    assert body == left


def test_loggable_keeps_client_text_short_and_printable() -> None:
    assert loggable("ok-host") == "ok-host"
    assert loggable("a\nb\x1b[31m") == "a?b?[31m"
    assert loggable("x" * 300).endswith("...") and len(loggable("x" * 300)) == 67


# ---- real processes ------------------------------------------------------------------------

TEST_SECRET = "transfer-trust-process-secret-0123"
OTHER_SECRET = "another-proxy-secret-012"


@pytest.fixture(scope="module")
def dep(builtin_model_dir: Path) -> Iterator[dict[str, Any]]:
    rec = recording_peer()
    m = builtin_model_dir
    procs = {
        "e": serve(m, "e", ec=side_channel_ec("ec_producer"), secret=TEST_SECRET),
        "pd": serve(m, "pd", ec=side_channel_ec("ec_consumer"), kv=side_channel_kv("kv_both"),
                    secret=TEST_SECRET),
        "open": serve(m, "open", ec=side_channel_ec("ec_consumer"), secret=None,
                      extra=["--transfer-peers", f"127.0.0.1:{rec.port}"]),
    }  # fmt: skip
    start_all(list(procs.values()))
    e, pd = procs["e"].url, procs["pd"].url
    proxies = {
        "px": proxy("px", decode=[procs["open"].url], secret=None),
        "px_signed": proxy("px_signed", encode=[e], decode=[pd], secret=TEST_SECRET),
        "px_other": proxy("px_other", encode=[e], decode=[pd], secret=OTHER_SECRET),
        "px_other_pd": proxy("px_other_pd", prefill=[pd], decode=[pd], secret=OTHER_SECRET),
    }
    start_all(list(proxies.values()))
    yield {**procs, **proxies, "recorder": rec}
    stop_all([*procs.values(), *proxies.values()])
    rec.close()


_colors = iter(range(1, 10_000))


def fresh_image() -> str:
    k = next(_colors)
    return png_data_url(56, ((k * 71) % 256, (k * 13) % 256, (k * 101) % 256))


def item_hash(e: Proc, image: str) -> str:
    """The item's ``mm_hash``, as the encoder names it (and then drops it, released)."""
    body = {"model": "tiny", "messages": messages("x", image), "max_tokens": 1}
    r = httpx.post(e.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (mm_hash,) = r.json()["ec_transfer_params"]
    return str(mm_hash)


def chat(url: str, image: str | None, **extra: Any) -> httpx.Response:
    msgs = messages("hello", image) if image else messages("hello")
    body = {"model": "tiny", "messages": msgs, "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def pointed_at(rec: FakePeer, mm_hash: str, host: str = "127.0.0.1") -> dict[str, Any]:
    return {mm_hash: {**entry(rec.port, host), "num_tokens": 16, "shape": [16, 64]}}


def connections_after(rec: FakePeer, response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    time.sleep(0.3)
    return rec.accepted


@pytest.mark.slow
def test_client_peer_gets_no_connection_from_a_signed_consumer(dep: dict[str, Any]) -> None:
    pd, rec = dep["pd"], dep["recorder"]
    image = fresh_image()
    params = pointed_at(rec, item_hash(dep["e"], image))
    before = rec.accepted
    rejected = pd.metric("transfer_params_rejected_total")
    computed = pd.metric("encoder_items_computed_total")
    assert connections_after(rec, chat(pd.url, image, ec_transfer_params=params)) == before
    assert pd.metric("transfer_params_rejected_total") == rejected + 1
    assert pd.metric("encoder_items_computed_total") == computed + 1
    assert "refused: unsigned" in pd.output()


@pytest.mark.slow
def test_client_kv_peer_gets_no_connection_from_a_signed_consumer(dep: dict[str, Any]) -> None:
    pd, rec = dep["pd"], dep["recorder"]
    ids = [31, 41, 59, 26, 53]
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 3, "temperature": 0},
            "kv_transfer_params": kv_params(ids, rec.port)}  # fmt: skip
    before = rec.accepted
    fallbacks = pd.metric("kv_local_prefill_fallbacks_total")
    r = httpx.post(pd.url + "/inference/v1/generate", json=body, timeout=60)
    assert connections_after(rec, r) == before
    assert len(r.json()["choices"][0]["token_ids"]) == 3
    assert pd.metric("kv_local_prefill_fallbacks_total") == fallbacks + 1


@pytest.mark.slow
def test_allowlisted_peer_is_contacted_but_never_through_the_proxy(dep: dict[str, Any]) -> None:
    open_, px, rec = dep["open"], dep["px"], dep["recorder"]
    # Control: the consumer allowlists the recorder, so a direct client reaches it.
    image = fresh_image()
    before = rec.accepted
    params = pointed_at(rec, item_hash(dep["e"], image))
    assert connections_after(rec, chat(open_.url, image, ec_transfer_params=params)) > before
    # Through the proxy the same params, top-level or in vllm_xargs, are dropped.
    for field in ("top-level", "vllm_xargs"):
        image = fresh_image()
        params = pointed_at(rec, item_hash(dep["e"], image))
        extra = (
            {"ec_transfer_params": params}
            if field == "top-level"
            else {"vllm_xargs": {"ec_transfer_params": params}}
        )
        before = rec.accepted
        assert connections_after(rec, chat(px.url, image, **extra)) == before, field
    # A name is not resolved, even one that would reach the recorder.
    image = fresh_image()
    params = pointed_at(rec, item_hash(dep["e"], image), host="localhost")
    before = rec.accepted
    assert connections_after(rec, chat(open_.url, image, ec_transfer_params=params)) == before


@pytest.mark.slow
@pytest.mark.parametrize("target", ["pd", "open"])
def test_500_entries_in_one_request_open_no_connection(dep: dict[str, Any], target: str) -> None:
    rec = dep["recorder"]
    params = {f"{i:032x}": entry(rec.port) for i in range(500)}
    before = rec.accepted
    assert connections_after(rec, chat(dep[target].url, None, ec_transfer_params=params)) == before
    assert httpx.get(dep[target].url + "/health").status_code == 200


@pytest.mark.slow
def test_proxy_with_the_secret_checks_what_the_encoders_issued(dep: dict[str, Any]) -> None:
    pd = dep["pd"]
    loaded = pd.metric("ec_items_loaded_total")
    computed = pd.metric("encoder_items_computed_total")
    r = chat(dep["px_signed"].url, fresh_image())
    assert r.status_code == 200 and "x-ec-fallback" not in r.headers
    assert pd.metric("ec_items_loaded_total") == loaded + 1
    # A proxy with another secret: the encoder's entries do not verify there, so it
    # drops them and says so; the item is encoded on PD.
    r = chat(dep["px_other"].url, fresh_image())
    assert r.status_code == 200 and r.headers["x-ec-fallback"] == "local-encode"
    assert pd.metric("encoder_items_computed_total") == computed + 1
    assert "fail: bad signature" in dep["px_other"].output()


@pytest.mark.slow
def test_proxy_with_another_secret_refuses_prefill_params(dep: dict[str, Any]) -> None:
    body = {"token_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_tokens": 2}}
    r = httpx.post(dep["px_other_pd"].url + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "untrusted_kv" and "bad signature" in error["message"]
