"""The side channels' wire format and a small threaded TCP server.

One exchange per connection, no pickle anywhere:

* request: ``[4-byte big-endian length][JSON object]``
* response: ``[4-byte big-endian length][JSON object][payload]``; the JSON
  header says ``"ok"`` and, when there is a payload, ``"nbytes"``, ``"dtype"``
  and ``"shape"`` of the raw tensor bytes (C order) that follow.

Both ends bound what they accept: a header over :data:`MAX_HEADER_BYTES` or a
payload over the reader's limit ends the exchange with :class:`WireError`.
Tensors travel as their raw bytes; the dtype is one of :data:`DTYPES`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from typing import Any

import orjson
import torch

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
_LEN = struct.Struct(">I")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WireError(Exception):
    """A peer that cannot be reached, answered badly, or sent too much."""


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise WireError(f"dtype {dtype} cannot travel over the side channel")
    return name


def tensor_nbytes(dtype: str, shape: list[int]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``; ``WireError`` when either is invalid."""
    torch_dtype = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if torch_dtype is None:
        raise WireError(f"unsupported dtype {dtype!r}")
    if (
        not isinstance(shape, list)
        or not shape
        or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)
    ):
        raise WireError(f"invalid shape {shape!r}")
    return math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | None = None) -> None:
    data = orjson.dumps(header)
    sock.sendall(_LEN.pack(len(data)) + data)
    if payload:
        sock.sendall(payload)


def recv_header(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > MAX_HEADER_BYTES:
        raise WireError(f"header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = orjson.loads(bytes(_recv_exact(sock, length)))
    except orjson.JSONDecodeError as exc:
        raise WireError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a JSON object")
    return header


def tensor_payload(tensor: torch.Tensor) -> tuple[dict[str, Any], bytes]:
    """``({"dtype", "shape", "nbytes"}, bytes)`` of a tensor (copied to the CPU)."""
    cpu = tensor.detach().to("cpu").contiguous()
    data = cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return {"dtype": dtype_name(cpu.dtype), "shape": list(cpu.shape), "nbytes": len(data)}, data


def request_tensor(
    host: str,
    port: int,
    request: dict[str, Any],
    *,
    timeout_s: float,
    max_bytes: int,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Send ``request`` to ``host:port`` and read back ``(header, tensor)``.

    Raises :class:`WireError` for anything short of a complete, well-formed
    tensor of at most ``max_bytes``: refused or timed-out connections, an
    ``ok: false`` answer (its ``error`` in the message), a size that does not
    match dtype and shape.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            send_frame(sock, request)
            header = recv_header(sock)
            if header.get("ok") is not True:
                raise WireError(f"peer refused: {header.get('error', 'no reason given')}")
            dtype, shape, nbytes = header.get("dtype"), header.get("shape"), header.get("nbytes")
            expected = tensor_nbytes(dtype, shape)
            if nbytes != expected:
                raise WireError(f"payload of {nbytes!r} bytes does not match {dtype}{shape}")
            if expected > max_bytes:
                raise WireError(f"payload of {expected} bytes exceeds the limit of {max_bytes}")
            data = _recv_exact(sock, expected)
    except (OSError, struct.error) as exc:
        raise WireError(f"{host}:{port}: {exc}") from None
    tensor = (
        torch.frombuffer(data, dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8)
    )
    return header, tensor.view(DTYPES[dtype]).reshape(shape)


def request_header(
    host: str, port: int, request: dict[str, Any], *, timeout_s: float
) -> dict[str, Any]:
    """Send ``request`` and read back a header-only answer; ``WireError`` on failure."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            send_frame(sock, request)
            header = recv_header(sock)
    except (OSError, struct.error) as exc:
        raise WireError(f"{host}:{port}: {exc}") from None
    if header.get("ok") is not True:
        raise WireError(f"peer refused: {header.get('error', 'no reason given')}")
    return header


#: ``handler(request) -> (header, payload, on_sent)``; ``on_sent`` runs after the
#: payload went out completely (the item may then be freed).
Handler = Callable[[dict[str, Any]], tuple[dict[str, Any], bytes | None, Callable[[], None] | None]]


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False


class SideChannelServer:
    """Serves one request per connection on a daemon thread per connection.

    ``port`` 0 binds an ephemeral port (read :attr:`port` after construction).
    A handler exception becomes an ``ok: false`` answer; the server goes on.
    """

    def __init__(self, host: str, port: int, handler: Handler, *, timeout_s: float) -> None:
        outer = self

        class _Conn(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve_one(self.request)

        self._handler = handler
        self._timeout_s = timeout_s
        self._server = _TCPServer((host, port), _Conn)
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"side-channel-{self.port}", daemon=True
        )
        self._thread.start()

    def _serve_one(self, sock: socket.socket) -> None:
        sock.settimeout(self._timeout_s)
        try:
            request = recv_header(sock)
        except (OSError, WireError) as exc:
            logger.debug("side channel: bad request: %s", exc)
            return
        try:
            header, payload, on_sent = self._handler(request)
        except Exception as exc:
            with contextlib.suppress(OSError):
                send_frame(sock, {"ok": False, "error": str(exc)})
            return
        try:
            send_frame(sock, header, payload)
        except OSError as exc:
            logger.warning("side channel: sending to a peer failed: %s", exc)
            return
        if on_sent is not None:
            on_sent()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def env_setting(names: tuple[str, ...], default: str) -> str:
    """The first of the environment variables ``names`` that is set, else ``default``."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return default
