"""What the Mooncake connectors share: the optional import, settings, bounded native calls.

Mooncake is an optional dependency (``pip install 'ec-frontend[mooncake]'``): it is
imported only when a configuration names a Mooncake connector, and its absence is
a :class:`ConfigError` at startup naming the extra.

Mooncake's native calls can block far longer than a request may wait: a Store
client set up against a master that accepts connections and never answers retries
for minutes, and a Transfer Engine read from a peer that never answers waits for
its socket timeout (60 s). :class:`BoundedCalls` runs them on one worker thread and
waits at most ``timeout_s``; a call that overruns is reported as failed and, while
it is still running, every later call fails at once instead of queueing behind it.
A call that may still write into memory is therefore never overlapped by another
one using the same buffers.

Mooncake's store library also tears every client down in a C exit handler, after
Python has finished: each client unmounts its segment from its master and joins
threads that wait on that master. With the master gone that takes seconds, with a
master that accepts connections and never answers it never ends, and the native
``close`` holds the GIL while it waits. :func:`leave_without_teardown` is the way
out for a client whose master does not answer: the client is kept alive to the
end and the process leaves, with its own exit status, before those handlers run.
"""

from __future__ import annotations

import ctypes
import http.client
import importlib
import ipaddress
import json
import logging
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import torch

from ec_frontend.errors import ConfigError

logger = logging.getLogger(__name__)

EXTRA = "ec-frontend[mooncake]"
CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"

T = TypeVar("T")

#: Mooncake's codes for the tensor dtypes an encoder output may have (the same codes
#: vLLM's Mooncake Store embedding codec writes).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 11,
    torch.bfloat16: 12,
}


def import_mooncake(module: str) -> Any:
    """``mooncake.<module>``, or a :class:`ConfigError` that names the extra to install."""
    # The PSM library of Mooncake's EFA build installs crash handlers that write a
    # backtrace file into the working directory unless this is set.
    os.environ.setdefault("IPATH_NO_BACKTRACE", "1")
    try:
        return importlib.import_module(f"mooncake.{module}")
    except ImportError as exc:
        raise ConfigError(
            f"the Mooncake connectors need the mooncake package ({exc}): install "
            f"'{EXTRA}' (CUDA hosts) or mooncake-transfer-engine-efa-non-cuda (CPU hosts, "
            "scripts/setup_mooncake.sh)",
            "mooncake",
        ) from None


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(gb|mb|kb|b)?\s*$", re.IGNORECASE)
_UNITS = {"gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10, "b": 1}


def parse_size(value: object, name: str) -> int:
    """A byte count: an integer or a string with a unit (``"512MB"``), as vLLM reads them."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is not None:
            size = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
            if size > 0:
                return size
    raise ConfigError(f"{name} must be a positive size (bytes, or a string like '64MB')", name)


def positive_float(extra: Mapping[str, Any], key: str, default: float, prefix: str) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{prefix}.{key} must be a positive number", f"{prefix}.{key}")
    return float(value)


def merged_extra(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The connector's extra config over the JSON file at ``$MOONCAKE_CONFIG_PATH``
    (vLLM's Mooncake configuration file), when that is set."""
    path = os.environ.get(CONFIG_PATH_ENV)
    base: dict[str, Any] = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"${CONFIG_PATH_ENV} ({path}) is unreadable: {exc}", "mooncake"
            ) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"${CONFIG_PATH_ENV} ({path}) must hold a JSON object", "mooncake")
        base = loaded
    return {**base, **extra}


def host_toward(address: str) -> str:
    """This host's address on the route to ``address`` (``host:port``): what peers reach."""
    host = address.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


_EXIT_GUARD_LOCK = threading.Lock()
_exit_guarded = False


def leave_without_teardown(client: Any) -> None:
    """Never destroy ``client`` and skip the native exit handlers registered so far.

    For a Store client whose master does not answer: its destructor and Mooncake's
    exit-time cleanup would wait on that master (forever, for one that hangs). The
    master forgets the client when its heartbeats stop. Python's own exit steps
    (``atexit``, flushing) still run; glibc's ``on_exit`` then calls ``_exit`` with
    the process's exit status ahead of the handlers Mooncake registered before.
    """
    global _exit_guarded
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))
    with _EXIT_GUARD_LOCK:
        if _exit_guarded:
            return
        libc = ctypes.CDLL(None)
        on_exit = getattr(libc, "on_exit", None)
        if on_exit is None:  # not glibc: the native teardown runs as it will
            logger.warning("this C library has no on_exit: Mooncake's exit handlers will run")
            return
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        if on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None) == 0:
            _exit_guarded = True


def unreachable(master: str, metadata_url: str, timeout_s: float) -> str | None:
    """Why the master at ``master`` (``host:port``) and its HTTP metadata server cannot
    serve a client (``None``: both answer).

    The Store's setup call holds the GIL and retries for minutes against a master that
    is down, so these checks run first, each bounded by ``timeout_s``.
    """
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        return f"master {master} unreachable ({exc})"
    if metadata_url.startswith("http://"):
        parts = urllib.parse.urlsplit(metadata_url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout_s)
        try:
            conn.request("GET", (parts.path or "/") + "?key=ec-frontend-probe")
            conn.getresponse().read()
        except (OSError, http.client.HTTPException) as exc:
            return f"metadata server {metadata_url} does not answer ({exc})"
        finally:
            conn.close()
    return None


class CallTimeout(RuntimeError):
    """A Mooncake call did not return in time (or an earlier one is still running)."""


class BoundedCalls:
    """Runs Mooncake calls one at a time on a daemon thread, each bounded by ``timeout_s``."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._stuck: Future[Any] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                fn, future = self._queue.pop(0)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    @property
    def stuck(self) -> bool:
        """Whether a call that overran its timeout is still running."""
        with self._lock:
            return self._stuck is not None and not self._stuck.done()

    def call(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """``fn()``'s result; :class:`CallTimeout` when it overruns or one is still stuck."""
        future: Future[T] = Future()
        with self._cond:
            if self._stuck is not None and not self._stuck.done():
                raise CallTimeout(f"{self.name}: an earlier Mooncake call has not returned")
            self._queue.append((fn, future))
            self._cond.notify()
        try:
            return future.result(timeout=timeout_s or self.timeout_s)
        except FutureTimeout:
            with self._lock:
                self._stuck = future
            raise CallTimeout(
                f"{self.name}: no answer from Mooncake in {timeout_s or self.timeout_s:g}s"
            ) from None

    def when_idle(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once no call is stuck any more (now, or when the stuck one returns)."""
        with self._lock:
            stuck = self._stuck
        if stuck is None or stuck.done():
            fn()
        else:
            stuck.add_done_callback(lambda _f: fn())
