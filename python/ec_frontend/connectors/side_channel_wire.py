"""The side channels' wire format and a small TCP server with a bounded worker pool.

One exchange per connection, no pickle anywhere:

* request: ``[4-byte big-endian length][JSON object]``
* response: ``[4-byte big-endian length][JSON object][payload]``; the JSON
  header says ``"ok"`` and, when there is a payload, ``"nbytes"``, ``"dtype"``
  and ``"shape"`` of the raw tensor bytes (C order) that follow. A refusal is
  ``{"ok": false, "code": ...}`` with a code of :data:`REFUSALS`.

With a transfer secret the server speaks first: ``{"challenge": <32 hex>}``,
and the request must carry ``"auth"``, the HMAC-SHA256 (with the secret) of
the challenge and the rest of the request; anything else is refused
(``unauthorized``) before the handler sees it.

Bounds: a header over :data:`MAX_HEADER_BYTES` or a payload over the reader's
limit ends the exchange with :class:`WireError`; ``timeout_s`` bounds the whole
exchange (connect, request, answer and payload together), not each socket
operation, at both ends. The server serves connections on a pool of
``workers`` threads and accepts only when one is free; the listen queue holds
``backlog`` more. Errors never quote what the peer sent: a port that answers with
something else is "not a side-channel peer", whatever its bytes were.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import orjson
import torch

from ec_frontend.connectors.tensor_checks import tensor_problem
from ec_frontend.types import JSONDict, JSONObject

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
_LEN = struct.Struct(">I")
_AUTH_CONTEXT = b"ec-frontend side channel v1\0"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

#: Refusal codes a server sends and what a client says about each.
REFUSALS: dict[str, str] = {
    "bad_request": "the peer found the request malformed",
    "not_found": "the peer holds no such item (never produced there, already sent, "
    "expired, or another request's)",
    "unauthorized": "the peer refused the authentication (do the transfer secrets match?)",
    "internal": "the peer failed to serve the item",
}


class WireError(Exception):
    """A peer that cannot be reached, answered badly, or sent too much."""


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise WireError(f"dtype {dtype} cannot travel over the side channel")
    return name


def tensor_nbytes(dtype: object, shape: object) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``; ``WireError`` when either is invalid."""
    return tensor_layout(dtype, shape)[2]


def tensor_layout(dtype: object, shape: object) -> tuple[str, list[int], int]:
    """``(dtype, shape, nbytes)`` of an announced tensor (values from a peer's JSON);
    ``WireError`` when either is invalid."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError("unsupported dtype")
    torch_dtype = DTYPES[dtype]
    if (
        not isinstance(shape, list)
        or not shape
        or len(shape) > 8
        or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < 1 << 40 for d in shape)
    ):
        raise WireError("invalid shape")
    nbytes = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
    return dtype, shape, nbytes


class Deadline:
    """The end of one whole exchange; :meth:`arm` gives a socket what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def arm(self, sock: socket.socket) -> None:
        left = self.at - time.monotonic()
        if left <= 0:
            raise WireError(f"timed out: the exchange exceeded its {self.seconds:g} s deadline")
        sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, deadline: Deadline) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        deadline.arm(sock)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def send_frame(
    sock: socket.socket,
    header: JSONObject,
    payload: bytes | None = None,
    deadline: Deadline | None = None,
) -> None:
    data = orjson.dumps(header)
    if deadline is not None:
        deadline.arm(sock)
    sock.sendall(_LEN.pack(len(data)) + data)
    if payload:
        if deadline is not None:
            deadline.arm(sock)
        sock.sendall(payload)


def recv_header(sock: socket.socket, deadline: Deadline) -> JSONDict:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if length > MAX_HEADER_BYTES:
        raise WireError(
            f"not a side-channel peer (its answer does not start with a frame of at most "
            f"{MAX_HEADER_BYTES} bytes)"
        )
    try:
        header = orjson.loads(bytes(_recv_exact(sock, length, deadline)))
    except orjson.JSONDecodeError:
        raise WireError("not a side-channel peer (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise WireError("not a side-channel peer (its header is not a JSON object)")
    return header


def tensor_payload(tensor: torch.Tensor) -> tuple[JSONObject, bytes]:
    """``({"dtype", "shape", "nbytes"}, bytes)`` of a tensor (copied to the CPU)."""
    cpu = tensor.detach().to("cpu").contiguous()
    data = cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return {"dtype": dtype_name(cpu.dtype), "shape": list(cpu.shape), "nbytes": len(data)}, data


def auth_tag(secret: bytes, challenge: str, request: JSONObject) -> str:
    """The ``auth`` a request answering ``challenge`` carries."""
    fields = {k: v for k, v in request.items() if k != "auth"}
    body = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
    message = _AUTH_CONTEXT + challenge.encode() + b"\0" + body
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _refusal(header: JSONObject) -> WireError:
    if "challenge" in header:
        return WireError("the peer requires authentication, and no transfer secret is set here")
    code = header.get("code")
    reason = REFUSALS.get(code) if isinstance(code, str) else None
    return WireError(f"peer refused: {reason or 'no known reason given'}")


@contextlib.contextmanager
def _exchange(
    host: str, port: int, request: JSONObject, timeout_s: float, secret: bytes | None
) -> Iterator[tuple[socket.socket, JSONObject, Deadline]]:
    """Connect, authenticate (with ``secret``), send ``request``, read the answer's header.

    ``WireError`` for anything but an ``ok: true`` header; the socket stays open
    for a payload until the block ends.
    """
    deadline = Deadline(timeout_s)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if secret is not None:
                try:
                    hello = recv_header(sock, deadline)
                except (WireError, OSError) as exc:
                    reason = "timed out" if isinstance(exc, OSError) else str(exc)
                    message = (
                        f"no challenge from the peer ({reason}; is a transfer secret set there?)"
                    )
                    raise WireError(message) from None
                challenge = hello.get("challenge")
                if not isinstance(challenge, str) or len(challenge) != 32:
                    raise WireError("no challenge from the peer (is a transfer secret set there?)")
                request = {**request, "auth": auth_tag(secret, challenge, request)}
            send_frame(sock, request, deadline=deadline)
            header = recv_header(sock, deadline)
            if header.get("ok") is not True:
                raise _refusal(header)
            yield sock, header, deadline
    except (OSError, struct.error) as exc:
        if isinstance(exc, TimeoutError):
            message = f"timed out: the exchange exceeded its {timeout_s:g} s deadline"
            raise WireError(message) from None
        why = exc.strerror if isinstance(exc, OSError) else None
        raise WireError(f"{host}:{port}: {why or type(exc).__name__}") from None


def request_tensor(
    host: str,
    port: int,
    request: JSONObject,
    *,
    timeout_s: float,
    max_bytes: int,
    secret: bytes | None = None,
    shape: list[int] | None = None,
    dtype: str | None = None,
) -> tuple[JSONObject, torch.Tensor]:
    """Send ``request`` to ``host:port`` and read back ``(header, tensor)`` within ``timeout_s``.

    Raises :class:`WireError` for anything short of a complete, well-formed,
    finite tensor of at most ``max_bytes`` (and of ``shape`` / ``dtype`` when
    given): refused, timed-out or unauthenticated connections, an ``ok:
    false`` answer, a size that does not match dtype and shape, NaN or Inf.
    """
    with _exchange(host, port, request, timeout_s, secret) as (sock, header, deadline):
        got_dtype, got_shape, expected = tensor_layout(header.get("dtype"), header.get("shape"))
        nbytes = header.get("nbytes")
        if nbytes != expected:
            raise WireError("the announced payload size does not match its dtype and shape")
        if expected > max_bytes:
            raise WireError(f"the announced payload exceeds the limit of {max_bytes} bytes")
        data = _recv_exact(sock, expected, deadline)
    flat = torch.frombuffer(data, dtype=torch.uint8) if expected else torch.empty(0).byte()
    tensor = flat.view(DTYPES[got_dtype]).reshape(got_shape)
    problem = tensor_problem(tensor, shape=shape, dtype=DTYPES.get(dtype) if dtype else None)
    if problem is not None:
        raise WireError(problem)
    return header, tensor


def request_header(
    host: str,
    port: int,
    request: JSONObject,
    *,
    timeout_s: float,
    secret: bytes | None = None,
) -> JSONObject:
    """Send ``request`` and read back a header-only answer; ``WireError`` on failure."""
    with _exchange(host, port, request, timeout_s, secret) as (_, header, _):
        return header


#: ``handler(request) -> (header, payload, on_sent)``; ``on_sent`` runs after the
#: payload went out completely (the item may then be freed). A handler raises
#: ``ValueError`` for a malformed request, ``KeyError`` for an unknown item or a
#: wrong credential.
Handler = Callable[[JSONObject], tuple[JSONObject, bytes | None, Callable[[], None] | None]]


class SideChannelServer:
    """Serves one request per connection on a pool of ``workers`` threads.

    ``port`` 0 binds an ephemeral port (read :attr:`port` after construction).
    A handler exception becomes an ``ok: false`` answer; the server goes on.
    One thread accepts, and only when a worker is free: at most ``workers``
    connections are served at once, the kernel's listen queue holds up to
    ``backlog`` more, and beyond that new connections wait for the kernel
    (their own deadlines bound them). Each accepted connection is bounded by
    ``timeout_s`` in all.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        timeout_s: float,
        secret: bytes | None = None,
        workers: int = 8,
        backlog: int = 64,
    ) -> None:
        self._handler = handler
        self._timeout_s = timeout_s
        self._secret = secret
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=backlog)
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(workers)
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"side-channel-{self.port}")
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"side-channel-{self.port}-accept", daemon=True
        )
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            if not self._slots.acquire(timeout=0.5):
                continue
            try:
                conn, _ = self._listener.accept()
            except OSError:
                self._slots.release()
                if self._closed.is_set():
                    return
                time.sleep(0.05)
                continue
            deadline = Deadline(self._timeout_s)
            try:
                self._pool.submit(self._serve_conn, conn, deadline)
            except RuntimeError:
                self._slots.release()
                conn.close()
                return

    def _serve_conn(self, conn: socket.socket, deadline: Deadline) -> None:
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._serve_one(conn, deadline)
        except Exception:
            logger.exception("side channel: serving a connection failed")
        finally:
            self._slots.release()

    def _serve_one(self, sock: socket.socket, deadline: Deadline) -> None:
        try:
            challenge = None
            if self._secret is not None:
                challenge = secrets.token_hex(16)
                send_frame(sock, {"challenge": challenge}, deadline=deadline)
            request = recv_header(sock, deadline)
        except (OSError, WireError) as exc:
            logger.debug("side channel: no usable request: %s", exc)
            return
        if challenge is not None and not self._authentic(challenge, request):
            logger.warning("side channel: a connection failed authentication")
            with contextlib.suppress(OSError, WireError):
                send_frame(sock, {"ok": False, "code": "unauthorized"}, deadline=deadline)
            return
        request.pop("auth", None)
        try:
            header, payload, on_sent = self._handler(request)
        except Exception as exc:
            code = "internal"
            if isinstance(exc, ValueError):
                code = "bad_request"
            elif isinstance(exc, KeyError):
                code = "not_found"
            else:
                logger.exception("side channel: the handler failed")
            logger.debug("side channel: refused (%s): %s", code, exc)
            with contextlib.suppress(OSError, WireError):
                send_frame(sock, {"ok": False, "code": code}, deadline=deadline)
            return
        try:
            send_frame(sock, header, payload, deadline=deadline)
        except (OSError, WireError) as exc:
            logger.warning("side channel: sending to a peer failed: %s", exc)
            return
        if on_sent is not None:
            on_sent()

    def _authentic(self, challenge: str, request: JSONObject) -> bool:
        tag = request.get("auth")
        secret = self._secret
        return (
            secret is not None
            and isinstance(tag, str)
            and tag.isascii()
            and hmac.compare_digest(tag, auth_tag(secret, challenge, request))
        )

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout=1.0)
        self._listener.close()
        self._pool.shutdown(wait=False)


def env_setting(names: tuple[str, ...], default: str) -> str:
    """The first of the environment variables ``names`` that is set, else ``default``."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return default
