"""The side channels' wire, settings, param parsing and producer store, on real sockets."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ec_frontend.config import (
    ConfigError,
    ECTransferConfig,
    KVTransferConfig,
    TransferTrust,
    parse_transfer_peers,
)
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.ec_side_channel import ECSideChannelConnector, parse_peer
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.kv_side_channel import KVSideChannelConnector
from ec_frontend.connectors.kv_transfer_params import parse_remote_prefill, prompt_hash
from ec_frontend.connectors.side_channel_wire import (
    SideChannelServer,
    WireError,
    request_header,
    request_tensor,
    tensor_payload,
)
from ec_frontend.connectors.transfer_settings import Settings
from ec_frontend.engine.request import Request
from ec_frontend.engine.sampling_params import SamplingParams

HASH = "0123456789abcdef" * 2


@pytest.fixture
def tensor_server() -> Iterator[tuple[SideChannelServer, dict[str, torch.Tensor]]]:
    tensors: dict[str, torch.Tensor] = {}

    def handler(req: dict[str, Any]) -> tuple[dict[str, Any], bytes, None]:
        header, payload = tensor_payload(tensors[req["key"]])
        return {"ok": True, **header}, payload, None

    server = SideChannelServer("127.0.0.1", 0, handler, timeout_s=2.0)
    yield server, tensors
    server.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 8), (1, 1), (2, 0), (2, 3, 4)])
def test_tensor_round_trip(
    tensor_server: tuple[SideChannelServer, dict[str, torch.Tensor]],
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> None:
    server, tensors = tensor_server
    tensors["t"] = torch.randn(shape).to(dtype)
    _, got = request_tensor("127.0.0.1", server.port, {"key": "t"}, timeout_s=2, max_bytes=1 << 20)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, tensors["t"])


def test_payload_over_the_limit_is_refused(
    tensor_server: tuple[SideChannelServer, dict[str, torch.Tensor]],
) -> None:
    server, tensors = tensor_server
    tensors["t"] = torch.zeros(64, 64)
    with pytest.raises(WireError, match="exceeds the limit"):
        request_tensor("127.0.0.1", server.port, {"key": "t"}, timeout_s=2, max_bytes=1000)


def test_handler_error_becomes_a_refusal(
    tensor_server: tuple[SideChannelServer, dict[str, torch.Tensor]],
) -> None:
    server, _ = tensor_server
    with pytest.raises(WireError, match="peer refused: the peer holds no such item"):
        request_tensor("127.0.0.1", server.port, {"key": "missing"}, timeout_s=2, max_bytes=10)


def _raw_server(answer: bytes) -> tuple[socket.socket, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def run() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return sock, thread


def _frame(header: bytes) -> bytes:
    return struct.pack(">I", len(header)) + header


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (_frame(b"not json"), "not JSON"),
        (_frame(b"[1, 2]"), "not a JSON object"),
        (struct.pack(">I", 1 << 30), "not a side-channel peer"),
        (_frame(b'{"ok": true, "dtype": "float32", "shape": [2], "nbytes": 4}'), "does not match"),
        (_frame(b'{"ok": true, "dtype": "int64", "shape": [2], "nbytes": 16}'), "unsupported"),
        (_frame(b'{"ok": true, "dtype": "float32", "shape": [-1], "nbytes": 0}'), "invalid shape"),
        (
            _frame(b'{"ok": true, "dtype": "float32", "shape": [4], "nbytes": 16}') + b"\0" * 8,
            "closed",
        ),
        (b"\0\0", "closed"),
    ],
)
def test_malformed_answers_are_wire_errors(answer: bytes, error: str) -> None:
    sock, thread = _raw_server(answer)
    try:
        with pytest.raises(WireError, match=error):
            request_tensor("127.0.0.1", sock.getsockname()[1], {}, timeout_s=2, max_bytes=1 << 20)
    finally:
        thread.join(2)
        sock.close()


def test_refused_and_silent_peers_fail_within_the_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(WireError):
        request_header("127.0.0.1", port, {}, timeout_s=1)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        started = time.monotonic()
        with pytest.raises(WireError, match="timed out"):
            request_header("127.0.0.1", silent.getsockname()[1], {}, timeout_s=0.3)
        assert 0.3 <= time.monotonic() - started < 2
    finally:
        silent.close()


DEFAULTS = {"max_items": 4, "max_bytes": 100, "ttl_s": 1.0, "timeout_s": 1.0, "max_item_bytes": 10}


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({}, {"host": "10.0.0.1", "port": 5501, "ttl_s": 1.0}),
        ({"host": "127.0.0.1", "port": 0}, {"host": "127.0.0.1", "port": 0}),
        ({"port": "6000", "ttl_s": 2}, {"port": 6000, "ttl_s": 2}),
        ({"advertise_host": "e1.local"}, {"advertise_host": "e1.local"}),
    ],
)
def test_settings(extra: dict[str, Any], want: dict[str, Any]) -> None:
    s = Settings.from_extra(extra, host="10.0.0.1", port="5501", defaults=DEFAULTS, prefix="x")
    assert {k: getattr(s, k) for k in want} == want


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"port": "x"}, "x.port"),
        ({"port": 70000}, "x.port"),
        ({"port": True}, "x.port"),
        ({"host": ""}, "x.host"),
        ({"ttl_s": 0}, "x.ttl_s"),
        ({"timeout_s": "1"}, "x.timeout_s"),
        ({"max_items": 1.5}, "x.max_items"),
        ({"advertise_host": 3}, "x.advertise_host"),
    ],
)
def test_settings_errors(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_extra(extra, host="h", port=1, defaults=DEFAULTS, prefix="x")
    assert info.value.param == param


TOKEN = "5" * 32
PEER = {"peer_host": "127.0.0.1", "peer_port": 5501, "num_tokens": 2, "dtype": "float32",
        "shape": [2, 4], "token": TOKEN}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "ok"),
    [
        ({}, True),
        ({"peer_port": 0}, False),
        ({"peer_port": "5501"}, False),
        ({"peer_host": ""}, False),
        ({"num_tokens": 3}, False),
        ({"dtype": "int8"}, False),
        ({"shape": [2, 4, 1]}, False),
        ({"shape": [2, 4000]}, False),
        ({"token": None}, False),
        ({"token": "short"}, False),
    ],
)
def test_parse_peer(change: dict[str, Any], ok: bool) -> None:
    settings = Settings.from_extra({}, host="h", port=1, defaults=DEFAULTS, prefix="x")
    settings = Settings(**{**settings.__dict__, "max_item_bytes": 1000})
    assert (parse_peer({**PEER, **change}, settings) is not None) is ok


def _request(ids: list[int], delta: int = 0) -> Request:
    return Request("r", ids, SamplingParams(max_tokens=4), mrope_position_delta=delta)


def _remote(ids: list[int], **change: Any) -> dict[str, Any]:
    params = {
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600,
        "remote_engine_id": "e", "remote_request_id": "p-1", "remote_block_ids": [1, 2],
        "remote_num_tokens": len(ids), "first_token_id": 9, "mrope_position_delta": 0,
        "prompt_hash": prompt_hash(ids), "token": TOKEN,
    }  # fmt: skip
    return {**params, **change}


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({}, None),
        ({"remote_host": None}, "remote_host"),
        ({"remote_port": 0}, "remote_host"),
        ({"remote_request_id": ""}, "remote_request_id"),
        ({"remote_block_ids": [1, "2"]}, "remote_block_ids"),
        ({"first_token_id": 1.5}, "first_token_id"),
        ({"remote_num_tokens": 4}, "this prompt has 5"),
        ({"prompt_hash": prompt_hash([1])}, "prompt_hash"),
        ({"mrope_position_delta": -3}, "mrope_position_delta"),
        ({"token": 7}, "token"),
    ],
)
def test_parse_remote_prefill(change: dict[str, Any], error: str | None) -> None:
    ids = [1, 2, 3, 4, 5]
    got = parse_remote_prefill(_remote(ids, **change), _request(ids))
    if error is None:
        assert not isinstance(got, str)
        assert (got.num_tokens, got.first_token_id, got.num_blocks) == (5, 9, 2)
    else:
        assert isinstance(got, str) and error in got


@pytest.fixture
def producer() -> Iterator[ECSideChannelConnector]:
    config = ECTransferConfig(
        "ECSideChannelConnector", "ec_producer", {"port": 0, "max_items": 2, "ttl_s": 0.5}
    )
    conn = ECSideChannelConnector(config, ECConnectorRole.WORKER)
    yield conn
    conn.close()


def _token(conn: ECSideChannelConnector, mm_hash: str) -> str:
    """The item's token as the producer's params would carry it (any token once it is gone)."""
    assert conn.store is not None
    item = conn.store.get(mm_hash)
    return item.token if item is not None else TOKEN


def _get(conn: ECSideChannelConnector, mm_hash: str, token: str | None = None) -> torch.Tensor:
    assert conn.store is not None
    port = conn.store.server.port
    request = {"op": "get_ec", "mm_hash": mm_hash, "token": token or _token(conn, mm_hash)}
    return request_tensor("127.0.0.1", port, request, timeout_s=2, max_bytes=1 << 20)[1]


def test_store_serves_once_then_frees(producer: ECSideChannelConnector) -> None:
    cache = {HASH: torch.arange(12.0).reshape(3, 4)}
    producer.save_caches(cache, HASH)
    assert producer.num_items_held() == 1
    assert torch.equal(_get(producer, HASH), cache[HASH])
    # The producer frees the item once its bytes are out, which its serving thread
    # notes after the last send returns: possibly just after the client has read them.
    deadline = time.monotonic() + 2.0
    while producer.num_items_held() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert producer.num_items_held() == 0
    with pytest.raises(WireError, match="no such item"):
        _get(producer, HASH)


def test_store_is_bounded_and_expires(producer: ECSideChannelConnector) -> None:
    hashes = [f"{i:032x}" for i in range(3)]
    cache = {h: torch.ones(2, 4) * i for i, h in enumerate(hashes)}
    for h in hashes:
        producer.save_caches(cache, h)
    assert producer.num_items_held() == 2
    with pytest.raises(WireError, match="no such item"):
        _get(producer, hashes[0])
    time.sleep(0.6)
    assert producer.num_items_held() == 0


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        ({"op": "get_ec", "mm_hash": "ABCDEF", "token": TOKEN}, "malformed"),
        ({"op": "get_ec", "mm_hash": "../etc/passwd", "token": TOKEN}, "malformed"),
        ({"op": "get_ec"}, "malformed"),
        ({"op": "get_ec", "mm_hash": HASH}, "malformed"),
        ({"op": "get_ec", "mm_hash": HASH, "token": "\u00e9" * 32}, "malformed"),
        ({"op": "delete", "mm_hash": HASH}, "malformed"),
        ({"op": "get_ec", "mm_hash": HASH, "token": TOKEN}, "no such item"),
    ],
)
def test_store_refuses_bad_requests(
    producer: ECSideChannelConnector, request_: dict[str, Any], error: str
) -> None:
    assert producer.store is not None
    with pytest.raises(WireError, match=error):
        request_header("127.0.0.1", producer.store.server.port, request_, timeout_s=2)


def test_release_frees_an_item_unsent(producer: ECSideChannelConnector) -> None:
    assert producer.store is not None
    producer.save_caches({HASH: torch.ones(1, 4)}, HASH)
    port = producer.store.server.port
    release = {"op": "release", "mm_hash": HASH, "token": TOKEN}
    with pytest.raises(WireError, match="no such item"):
        request_header("127.0.0.1", port, release, timeout_s=2)
    assert producer.num_items_held() == 1
    release["token"] = _token(producer, HASH)
    answer = request_header("127.0.0.1", port, release, timeout_s=2)
    assert answer["released"] is True and producer.num_items_held() == 0


@pytest.mark.parametrize(
    ("env", "extra", "want"),
    [
        ({}, {}, ("127.0.0.1", 5501)),
        ({"VLLM_EC_SIDE_CHANNEL_PORT": "6001"}, {}, ("127.0.0.1", 6001)),
        (
            {"EC_SIDE_CHANNEL_PORT": "6002", "VLLM_EC_SIDE_CHANNEL_PORT": "6001"},
            {},
            ("127.0.0.1", 6002),
        ),
        ({"VLLM_EC_SIDE_CHANNEL_HOST": "10.1.1.1"}, {}, ("10.1.1.1", 5501)),
        ({"EC_SIDE_CHANNEL_HOST": "10.1.1.1"}, {"host": "127.0.0.9", "port": 0}, ("127.0.0.9", 0)),
    ],
)
def test_ec_side_channel_address_from_env_and_config(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    extra: dict[str, Any],
    want: tuple[str, int],
) -> None:
    for name in ("EC_SIDE_CHANNEL_HOST", "EC_SIDE_CHANNEL_PORT", "VLLM_EC_SIDE_CHANNEL_HOST",
                 "VLLM_EC_SIDE_CHANNEL_PORT"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = ECTransferConfig("ECSideChannelConnector", "ec_consumer", extra)
    conn = ECSideChannelConnector(config, ECConnectorRole.SCHEDULER)
    assert (conn.settings.host, conn.settings.port) == want


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, 5600),
        ({"VLLM_KV_SIDE_CHANNEL_PORT": "7001"}, 7001),
        ({"KV_SIDE_CHANNEL_PORT": "7002"}, 7002),
    ],
)
def test_kv_side_channel_port_from_env(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: int
) -> None:
    for name in ("KV_SIDE_CHANNEL_PORT", "VLLM_KV_SIDE_CHANNEL_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    conn = KVSideChannelConnector(
        KVTransferConfig("KVSideChannelConnector", "kv_consumer"), KVConnectorRole.SCHEDULER
    )
    assert conn.state.settings.port == want and conn.state.server is None


def test_side_channel_port_in_use_is_a_config_error(producer: ECSideChannelConnector) -> None:
    assert producer.store is not None
    taken = producer.store.server.port
    config = ECTransferConfig("ECSideChannelConnector", "ec_producer", {"port": taken})
    with pytest.raises(ConfigError, match="cannot listen"):
        ECSideChannelConnector(config, ECConnectorRole.SCHEDULER)


@pytest.mark.parametrize(
    ("params", "want", "fallbacks"),
    [
        (None, (0, False), 0),
        ({"do_remote_decode": True}, (0, False), 0),
        ("valid", (5, True), 0),
        ({"do_remote_prefill": True, "remote_host": "127.0.0.1"}, (0, False), 1),
    ],
    ids=["none", "prefill-side", "valid", "malformed"],
)
def test_decode_consumes_params_once_and_keeps_a_pending_load(
    params: Any, want: tuple[int, bool], fallbacks: int
) -> None:
    ids = [1, 2, 3, 4, 5]
    extra = {"kv_transfer_params": _remote(ids) if params == "valid" else params}
    req = Request("r", ids, SamplingParams(max_tokens=4, extra_args=extra))
    # The operator names the prefill peer (with neither that nor a secret, nothing loads).
    trust = TransferTrust(peers=parse_transfer_peers("127.0.0.1"))
    conn = KVSideChannelConnector(
        KVTransferConfig("KVSideChannelConnector", "kv_consumer", trust=trust),
        KVConnectorRole.SCHEDULER,
    )
    assert conn.get_num_new_matched_tokens(req, 0) == want
    # Asked again (its blocks could not be allocated): the same answer, params used once.
    assert conn.get_num_new_matched_tokens(req, 0) == want
    assert conn.local_prefill_fallbacks == fallbacks
    if params is not None and params != {"do_remote_decode": True}:
        assert req.kv_transfer_params is None
