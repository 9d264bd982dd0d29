"""Side-channel hardening (issue 15, M1 and the Low items), on real sockets and files.

Fake peers are plain TCP servers on loopback that misbehave on purpose: they
drip bytes, answer with another protocol, send NaN tensors or hold
connections open. Each test names the old behaviour it guards against.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from ec_frontend.config import ECTransferConfig, KVTransferConfig, TransferTrust
from ec_frontend.connectors.base import ECConnectorMetadata, ECConnectorRole, ECLoadSpec
from ec_frontend.connectors.ec_side_channel import (
    ECSideChannelConnector,
    ECSideChannelMetadata,
    Peer,
)
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.kv_side_channel import KVSideChannelConnector, _Load
from ec_frontend.connectors.kv_transfer_params import RemotePrefill
from ec_frontend.connectors.shared_storage import ECSharedStorageConnector
from ec_frontend.connectors.side_channel_wire import (
    SideChannelServer,
    WireError,
    auth_tag,
    request_header,
    request_tensor,
    tensor_payload,
)
from ec_frontend.connectors.tensor_checks import all_finite

SECRET = b"side-channel-limits-secret-0123456789"
TOKEN = "7" * 32


def frame(header: dict[str, Any]) -> bytes:
    data = orjson.dumps(header)
    return struct.pack(">I", len(data)) + data


class FakePeer:
    """A loopback TCP server: ``behave(conn)`` runs for every accepted connection."""

    def __init__(self, behave: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._behave = behave
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(30)
                conn.recv(65536)
                self._behave(conn)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def fake_peer() -> Iterator[Callable[[Callable[[socket.socket], None]], FakePeer]]:
    peers: list[FakePeer] = []

    def start(behave: Callable[[socket.socket], None]) -> FakePeer:
        peers.append(FakePeer(behave))
        return peers[-1]

    yield start
    for p in peers:
        p.close()


def tensor_answer(tensor: torch.Tensor, **extra: Any) -> Callable[[socket.socket], None]:
    header, payload = tensor_payload(tensor)

    def behave(conn: socket.socket) -> None:
        conn.sendall(frame({"ok": True, **header, **extra}) + payload)

    return behave


# ---- whole-pull deadline ------------------------------------------------------


def dripping(first: bytes, interval_s: float) -> Callable[[socket.socket], None]:
    """Sends ``first`` at once, then one zero byte every ``interval_s`` (for up to a minute)."""

    def behave(conn: socket.socket) -> None:
        conn.sendall(first)
        for _ in range(int(60 / interval_s)):
            time.sleep(interval_s)
            conn.sendall(b"\0")

    return behave


@pytest.mark.parametrize(
    "first",
    [frame({"ok": True, "dtype": "float32", "shape": [1024], "nbytes": 4096}), b"\0\0\0\x10"],
    ids=["payload", "header"],
)
def test_drip_peer_is_cut_at_the_whole_pull_deadline(fake_peer: Any, first: bytes) -> None:
    # Before: every recv had its own timeout, so a byte every 3 s held a pull for as
    # long as the peer liked (75 s with a 10 s timeout). Here a byte comes every
    # 0.3 s, well inside any per-operation timeout, and the pull still ends at 1.5 s.
    peer = fake_peer(dripping(first, 0.3))
    started = time.monotonic()
    with pytest.raises(WireError, match="deadline"):
        request_tensor("127.0.0.1", peer.port, {}, timeout_s=1.5, max_bytes=1 << 20)
    elapsed = time.monotonic() - started
    assert 1.4 <= elapsed < 4.0


def test_server_cuts_a_client_dripping_its_request() -> None:
    def handler(request: dict[str, Any]) -> tuple[dict[str, Any], None, None]:
        return {"ok": True}, None, None

    server = SideChannelServer("127.0.0.1", 0, handler, timeout_s=1.0, workers=1)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.settimeout(10)
            sock.sendall(b"\0\0")
            started = time.monotonic()
            cut = False
            while time.monotonic() - started < 8:
                time.sleep(0.2)
                try:
                    sock.sendall(b"\0")
                    if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                        cut = True
                        break
                except BlockingIOError:
                    continue
                except OSError:
                    cut = True
                    break
            assert cut and time.monotonic() - started < 4.0
        # The one worker is free again: a well-behaved request is answered.
        assert request_header("127.0.0.1", server.port, {}, timeout_s=2)["ok"] is True
    finally:
        server.close()


# ---- bounded workers and backlog ------------------------------------------------


def test_server_threads_are_bounded_and_idle_connections_expire() -> None:
    # Before: a thread per connection, without bound (and a listen backlog of 5).
    def handler(request: dict[str, Any]) -> tuple[dict[str, Any], None, None]:
        return {"ok": True}, None, None

    server = SideChannelServer("127.0.0.1", 0, handler, timeout_s=1.0, workers=3, backlog=16)
    prefix = f"side-channel-{server.port}"
    idle: list[socket.socket] = []
    try:
        for _ in range(12):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        time.sleep(0.3)
        threads = [t.name for t in threading.enumerate() if t.name.startswith(prefix)]
        assert sorted(threads) == [f"{prefix}-accept", f"{prefix}_0", f"{prefix}_1", f"{prefix}_2"]
        # The idle ones are served three at a time and cut by the deadline; a real
        # request waits in the listen queue and is answered once they are gone
        # (12 / 3 * 1 s, with a wide margin).
        started = time.monotonic()
        assert request_header("127.0.0.1", server.port, {}, timeout_s=30)["ok"] is True
        assert 3.0 <= time.monotonic() - started < 15
    finally:
        for s in idle:
            s.close()
        server.close()
    time.sleep(0.2)
    assert not [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


# ---- errors name no remote bytes --------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "leak"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n", [b"SSH", str(int.from_bytes(b"SSH-", "big")).encode()]),
        (
            b"HTTP/1.1 400 Bad Request\r\n\r\n",
            [b"HTTP", str(int.from_bytes(b"HTTP", "big")).encode()],
        ),
        (frame({"ok": False, "error": "db password is hunter2"}), [b"hunter2"]),
        (frame({"ok": False, "code": "x" * 40}), [b"xxxx"]),
        (struct.pack(">I", 9) + b"{not json", [b"not json}"]),
    ],
    ids=["ssh", "http", "error-text", "unknown-code", "bad-json"],
)
def test_errors_never_echo_what_the_peer_sent(
    fake_peer: Any, answer: bytes, leak: list[bytes]
) -> None:
    # Before: "header of 1397966893 bytes exceeds ..." told a client the first four
    # bytes of whatever listened on the port, and a refusal echoed the peer's text.
    peer = fake_peer(lambda conn: conn.sendall(answer))
    with pytest.raises(WireError) as info:
        request_tensor("127.0.0.1", peer.port, {}, timeout_s=2, max_bytes=1 << 20)
    message = str(info.value).encode()
    assert not any(piece in message for piece in leak), message


# ---- tensors are checked before they enter a cache --------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finiteness_check_is_exact(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    extremes = torch.tensor([info.max, info.min, info.tiny, -info.tiny, 0.0, -0.0], dtype=dtype)
    assert all_finite(extremes) and all_finite(torch.randn(300, 7).to(dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensor = torch.randn(300, 7).to(dtype)
        tensor[298, 6] = bad
        assert not all_finite(tensor)
        assert not all_finite(tensor[::2].t())  # a non-contiguous view too
        tensor[298, 6] = 0
        tensor[0, 0] = bad
        assert not all_finite(tensor[::2].t())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_tensor_is_refused_by_the_wire(
    fake_peer: Any, bad: float, dtype: torch.dtype
) -> None:
    tensor = torch.ones(4, 8, dtype=dtype)
    tensor[2, 3] = bad
    peer = fake_peer(tensor_answer(tensor))
    with pytest.raises(WireError, match="non-finite"):
        request_tensor("127.0.0.1", peer.port, {}, timeout_s=2, max_bytes=1 << 20)


def ec_consumer(**trust: Any) -> ECSideChannelConnector:
    config = ECTransferConfig(
        "ECSideChannelConnector",
        "ec_consumer",
        {"port": 0, "timeout_s": 2.0},
        trust=TransferTrust(**trust),
    )
    return ECSideChannelConnector(config, ECConnectorRole.WORKER)


def pull_into_cache(conn: ECSideChannelConnector, port: int, shape: list[int]) -> dict[str, Any]:
    mm_hash = "ab" * 16
    nbytes = shape[0] * shape[1] * 4
    peer = Peer("127.0.0.1", port, shape[0], nbytes, "float32", shape, TOKEN)
    meta = ECSideChannelMetadata([ECLoadSpec(mm_hash, shape[0], "r")], {mm_hash: peer})
    cache: dict[str, Any] = {}
    with conn.bound(meta):
        conn.start_load_caches(cache)
    return cache


def test_nan_encoder_output_from_a_fake_peer_never_enters_the_cache(fake_peer: Any) -> None:
    # Before: a fake peer's NaN tensor went into the encoder cache and was served to
    # every request with that image.
    tensor = torch.ones(3, 8)
    tensor[0, 0] = float("nan")
    peer = fake_peer(tensor_answer(tensor))
    conn = ec_consumer()
    cache = pull_into_cache(conn, peer.port, [3, 8])
    assert cache == {} and conn.stats.load_failures == 1
    good = fake_peer(tensor_answer(torch.ones(3, 8)))
    (pulled,) = pull_into_cache(conn, good.port, [3, 8]).values()
    assert pulled.shape == (3, 8)


@pytest.mark.parametrize(
    ("sent", "match"),
    [
        (torch.ones(3, 9), r"shape \[3, 9\] where \[3, 8\]"),
        (torch.ones(3, 8, dtype=torch.float16), "dtype torch.float16 where torch.float32"),
    ],
)
def test_encoder_output_of_another_shape_or_dtype_is_refused(
    fake_peer: Any, sent: torch.Tensor, match: str
) -> None:
    peer = fake_peer(tensor_answer(sent))
    with pytest.raises(WireError, match=match):
        request_tensor(
            "127.0.0.1",
            peer.port,
            {},
            timeout_s=2,
            max_bytes=1 << 20,
            shape=[3, 8],
            dtype="float32",
        )


@pytest.fixture
def kv_consumer() -> KVSideChannelConnector:
    return KVSideChannelConnector(
        KVTransferConfig("KVSideChannelConnector", "kv_consumer", {"timeout_s": 2.0}),
        KVConnectorRole.WORKER,
    )


def kv_caches() -> list[torch.Tensor]:
    """Two layers of ``[2 (k, v), blocks, block_size, heads, head_dim]``."""
    return [torch.zeros(2, 6, 4, 2, 8) for _ in range(2)]


def kv_load(port: int, num_tokens: int) -> _Load:
    remote = RemotePrefill("127.0.0.1", port, "e", "p-1", 2, num_tokens, 5, TOKEN)
    return _Load("r", [1, 3], remote)


@pytest.mark.parametrize(
    ("mutate", "header", "match"),
    [
        (lambda t: t.fill_(float("nan")), {"num_tokens": 8}, "non-finite"),
        (lambda t: t[..., :4], {"num_tokens": 8}, r"shape \[2, 2, 2, 4, 2, 4\] where"),
        (lambda t: t, {"num_tokens": 7}, "not for the 8 tokens"),
        (lambda t: t.half(), {"num_tokens": 8}, "dtype"),
    ],
    ids=["nan", "shape", "num-tokens", "dtype"],
)
def test_kv_pull_names_the_real_mismatch(
    fake_peer: Any,
    kv_consumer: KVSideChannelConnector,
    mutate: Callable[[torch.Tensor], torch.Tensor],
    header: dict[str, Any],
    match: str,
) -> None:
    # Before: a token-count mismatch was reported as "KV of shape [...] does not fit
    # [...]" between two identical shapes, and NaN blocks went into the KV cache.
    caches = kv_caches()
    sent = mutate(torch.ones(2, 2, 2, 4, 2, 8))
    peer = fake_peer(tensor_answer(sent.contiguous(), **header))
    with pytest.raises(WireError, match=match) as info:
        kv_consumer._pull(kv_load(peer.port, 8), caches)
    if match == "not for the 8 tokens":
        assert "shape" not in str(info.value)
    assert all(float(c.abs().sum()) == 0 for c in caches)


def test_kv_pull_of_a_well_formed_answer_succeeds(
    fake_peer: Any, kv_consumer: KVSideChannelConnector
) -> None:
    sent = torch.randn(2, 2, 2, 4, 2, 8)
    peer = fake_peer(tensor_answer(sent, num_tokens=8))
    assert torch.equal(kv_consumer._pull(kv_load(peer.port, 8), kv_caches()), sent)


# ---- authentication ---------------------------------------------------------------


@pytest.fixture
def secured_server() -> Iterator[SideChannelServer]:
    def handler(request: dict[str, Any]) -> tuple[dict[str, Any], None, None]:
        return {"ok": True, "echo": request.get("op")}, None, None

    server = SideChannelServer("127.0.0.1", 0, handler, timeout_s=2.0, secret=SECRET)
    yield server
    server.close()


@pytest.mark.parametrize(
    ("secret", "match"),
    [
        (None, "requires authentication"),
        (b"another-secret-of-enough-length", "refused the authentication"),
        (SECRET, None),
    ],
    ids=["no-secret", "wrong-secret", "right-secret"],
)
def test_connections_authenticate_with_the_secret(
    secured_server: SideChannelServer, secret: bytes | None, match: str | None
) -> None:
    call = lambda: request_header(  # noqa: E731
        "127.0.0.1", secured_server.port, {"op": "x"}, timeout_s=2, secret=secret
    )
    if match is None:
        assert call()["echo"] == "x"
    else:
        with pytest.raises(WireError, match=match):
            call()


@pytest.mark.parametrize("forge", ["replay", "non-ascii", "missing"])
def test_a_request_that_does_not_answer_this_challenge_is_refused(
    secured_server: SideChannelServer, forge: str
) -> None:
    # A request recorded from an authenticated exchange does not answer another
    # challenge; nor does a tag of the wrong kind, or none.
    with socket.create_connection(("127.0.0.1", secured_server.port), timeout=2) as sock:
        first = sock.recv(65536)
        challenge = orjson.loads(first[4:])["challenge"]
        recorded = {"op": "x", "auth": auth_tag(SECRET, challenge, {"op": "x"})}
    forged = {
        "replay": recorded,
        "non-ascii": {"op": "x", "auth": "\u00e9" * 64},
        "missing": {"op": "x"},
    }[forge]
    with socket.create_connection(("127.0.0.1", secured_server.port), timeout=2) as sock:
        sock.recv(65536)
        sock.sendall(frame(forged))
        answer = orjson.loads(sock.recv(65536)[4:])
    assert answer == {"ok": False, "code": "unauthorized"}


def test_a_client_with_a_secret_meets_a_server_without_one() -> None:
    def handler(request: dict[str, Any]) -> tuple[dict[str, Any], None, None]:
        return {"ok": True}, None, None

    server = SideChannelServer("127.0.0.1", 0, handler, timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(WireError, match="no challenge"):
            request_header("127.0.0.1", server.port, {}, timeout_s=1.0, secret=SECRET)
        assert time.monotonic() - started < 3.0
    finally:
        server.close()


# ---- shared storage: no symlinks ----------------------------------------------------


def storage(path: Path, role: str) -> ECSharedStorageConnector:
    config = ECTransferConfig("ECSharedStorageConnector", role, {"shared_storage_path": str(path)})
    side = ECConnectorRole.WORKER if role == "ec_producer" else ECConnectorRole.SCHEDULER
    return ECSharedStorageConnector(config, side)


def load(conn: ECSharedStorageConnector, mm_hash: str, rows: int) -> dict[str, torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}
    with conn.bound(ECConnectorMetadata([ECLoadSpec(mm_hash, rows, "r")])):
        conn.start_load_caches(cache)
    return cache


def test_symlink_in_the_shared_directory_is_not_followed(tmp_path: Path) -> None:
    # Before: a link planted in the directory was read through to its target.
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    elsewhere.mkdir()
    writer = storage(elsewhere, "ec_producer")
    real = hashlib.sha256(b"real").hexdigest()
    writer.save_caches({real: torch.ones(3, 8)}, real)
    target = elsewhere / f"{real}.safetensors"
    shared.mkdir()
    linked = hashlib.sha256(b"linked").hexdigest()
    os.symlink(target, shared / f"{linked}.safetensors")
    copied = hashlib.sha256(b"copied").hexdigest()
    (shared / f"{copied}.safetensors").write_bytes(target.read_bytes())
    reader = storage(shared, "ec_consumer")
    assert not reader.has_cache_item(linked)
    assert load(reader, linked, 3) == {} and reader.stats.load_failures == 1
    # The same bytes as a regular file load (the check is about the link alone).
    assert reader.has_cache_item(copied)
    assert torch.equal(load(reader, copied, 3)[copied], torch.ones(3, 8))


def test_nan_file_in_the_shared_directory_is_a_miss(tmp_path: Path) -> None:
    writer, reader = storage(tmp_path, "ec_producer"), storage(tmp_path, "ec_consumer")
    mm_hash = hashlib.sha256(b"nan").hexdigest()
    bad = torch.ones(3, 8)
    bad[1, 1] = float("nan")
    writer.save_caches({mm_hash: bad}, mm_hash)
    assert reader.has_cache_item(mm_hash)
    assert load(reader, mm_hash, 3) == {} and reader.stats.load_failures == 1
