"""Fetching media by URL so that the fetch cannot be aimed (SSRF defence).

Contract of :meth:`MediaFetcher.fetch` (one URL -> its bytes, or a
:class:`~ec_frontend.media.policy.MediaError`):

* ``http(s)``: the URL passes :func:`~ec_frontend.media.policy.check_url`; its
  host is resolved **once** (by the injectable resolver; an IP literal is not
  resolved); **every** resolved address must pass
  :func:`~ec_frontend.media.policy.check_address`, and the connection is made
  to a checked address, never to the name again, with the original ``Host``
  header and TLS server name (a DNS answer that changes between check and
  connect changes nothing). Redirects are not followed by the HTTP client:
  each ``Location`` is checked and resolved again as a new URL, at most
  ``max_redirects`` times, never to another scheme than http(s) and never
  from https down to http. Proxy settings of the environment are ignored.
* The whole fetch (resolution, every hop, the body) runs under one deadline,
  ``timeout_s``; the body is read as it streams in and refused as soon as it
  passes ``max_item_bytes`` or (with the other items of its request, through a
  :class:`RequestBudget`) ``max_request_bytes``; a ``Content-Length`` over the
  cap is refused before the body is read. Only ``200`` is a success; the
  ``Content-Type`` must be of the item's kind, ``image/*`` for an image and
  ``video/*`` for a video (or none, or ``application/octet-stream``); a content
  coding other than identity is refused. A video item's byte cap is
  ``max_video_bytes`` in place of ``max_item_bytes``.
* ``file``: only below ``allowed_local_path``: no ``..`` segment, the resolved
  path (symlinks followed) must stay below the root, the file is then opened
  component by component with ``O_NOFOLLOW`` (a symlink swapped in meanwhile is
  refused), and it must be a regular file (no device, FIFO or directory) within
  the same byte caps.
* The optional :class:`~ec_frontend.media.cache.MediaCache` answers a URL
  before any resolution (the domain check still applies) and stores what the
  origin lets it store, for redirect-free fetches only.
* At most ``max_concurrent`` fetches from origins are in progress at once,
  server-wide; a fetch that waits for a slot waits within its deadline.
* Nothing here blocks the event loop: sockets are asynchronous, name
  resolution and file reads run in threads.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import ssl
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import SplitResult, unquote

import h11
import httpx

from ec_frontend.media.cache import MediaCache
from ec_frontend.media.metrics import FetchMetrics
from ec_frontend.media.policy import (
    IPAddress,
    MediaError,
    MediaFetchConfig,
    check_address,
    check_url,
    refused,
)

#: ``host, port -> addresses`` (strings); raises ``OSError`` when the name does not resolve.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

#: The kinds of item fetched: each has its content types and byte cap.
MediaKind = Literal["image", "video"]

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
#: Content types accepted besides ``image/*`` (origins that do not know the type).
_GENERIC_TYPES = frozenset({"", "application/octet-stream", "binary/octet-stream"})
_READ_CHUNK = 64 * 1024
#: Largest response head (status line and headers) read from an origin.
_MAX_HEAD_BYTES = 64 * 1024


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` from the system resolver (in a worker thread)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    out: list[str] = []
    for *_, sockaddr in infos:
        address = str(sockaddr[0])
        if address not in out:
            out.append(address)
    return out


class RequestBudget:
    """The bytes the fetched items of one request may have together."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def charge(self, size: int) -> None:
        self.used += size
        if self.used > self.limit:
            raise MediaError(
                f"the request's media URLs hold more than {self.limit} bytes together "
                "(--max-media-request-bytes)",
                code="media_too_large",
                reason="request_too_large",
            )


@dataclass(frozen=True, slots=True)
class Fetched:
    """What one fetch gave: the bytes and whether they came from the cache."""

    data: bytes
    cached: bool = False


def _tls_context() -> ssl.SSLContext:
    """Certificate and host-name checks on, with certifi's CA bundle when it is there
    (httpx's), else the system's."""
    try:
        import certifi
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(_READ_CHUNK))


def _failed(message: str, reason: str, code: str = "media_fetch_failed") -> MediaError:
    return MediaError(message, code=code, reason=reason)


@dataclass(frozen=True, slots=True)
class _Want:
    """What one fetch accepts: the item's kind, its byte cap and the flag naming it."""

    kind: MediaKind
    cap: int
    flag: str

    @property
    def article(self) -> str:
        return "an" if self.kind == "image" else "a"

    @classmethod
    def of(cls, kind: MediaKind, config: MediaFetchConfig) -> _Want:
        if kind == "video":
            return cls("video", config.max_video_bytes, "--max-media-video-bytes")
        return cls("image", config.max_item_bytes, "--max-media-item-bytes")


class MediaFetcher:
    """Fetches media URLs under a :class:`MediaFetchConfig` policy (module docstring)."""

    def __init__(
        self,
        config: MediaFetchConfig,
        *,
        metrics: FetchMetrics | None = None,
        resolver: Resolver | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``resolver`` and ``tls`` (the client TLS context: certificate authorities)
        replace the system's; tests use them to resolve names without DNS and to
        trust a test certificate."""
        self.config = config
        self.root = config.local_root()
        self.metrics = metrics if metrics is not None else FetchMetrics()
        self.cache = MediaCache(config.cache_bytes) if config.cache_bytes > 0 else None
        self._resolve = resolver if resolver is not None else system_resolver
        # Made now, not on the event loop at the first fetch: loading the CA bundle
        # takes tens of milliseconds.
        self._tls = tls if tls is not None else _tls_context()
        #: Fetches in progress at once, server-wide (a waiting fetch's deadline runs).
        self._slots = asyncio.Semaphore(config.max_concurrent)

    async def aclose(self) -> None:
        """Nothing is held between fetches (no pooled connection); kept for callers."""

    async def fetch(
        self, url: str, budget: RequestBudget | None = None, kind: MediaKind = "image"
    ) -> Fetched:
        """The bytes behind ``url`` (module docstring), an item of ``kind``; counts
        every outcome."""
        budget = budget if budget is not None else RequestBudget(self.config.max_request_bytes)
        timeout = self.config.timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._fetch(url, budget, _Want.of(kind, self.config))
        except TimeoutError:
            self.metrics.refused.inc(("timeout",))
            raise _failed(
                f"fetching the media URL took longer than {timeout:g} s (--media-fetch-timeout)",
                "timeout",
                "media_fetch_timeout",
            ) from None
        except MediaError as exc:
            if exc.reason is not None:
                self.metrics.refused.inc((exc.reason,))
            raise

    async def _fetch(self, url: str, budget: RequestBudget, want: _Want) -> Fetched:
        parts = check_url(url, self.config)
        if parts.scheme.lower() == "file":
            started = time.perf_counter()
            self.metrics.fetches.inc(("file",))
            async with self._slots:
                data = await asyncio.to_thread(self._read_file, parts, want)
            budget.charge(len(data))
            self._count(data, started)
            return Fetched(data)
        # A cached body was checked for its kind when fetched: the kind is in the key.
        key = url if want.kind == "image" else f"{want.kind} {url}"
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                budget.charge(len(hit))
                self.metrics.cache_hits.inc()
                return Fetched(hit, cached=True)
        started = time.perf_counter()
        self.metrics.fetches.inc((parts.scheme.lower(),))
        async with self._slots:
            data, headers, hops = await self._fetch_http(url, budget, want)
        self._count(data, started)
        if self.cache is not None and hops == 0:
            self.cache.put(key, data, headers)
        return Fetched(data)

    def _count(self, data: bytes, started: float) -> None:
        self.metrics.bytes.inc(amount=float(len(data)))
        self.metrics.latency.observe(time.perf_counter() - started)

    # ------------------------------------------------------------------ http(s)

    async def _fetch_http(
        self, url: str, budget: RequestBudget, want: _Want
    ) -> tuple[bytes, dict[str, str], int]:
        """``(body, lower-case headers, redirects followed)``."""
        try:
            current = httpx.URL(url).copy_with(fragment=None)
            current.raw_host.decode("ascii")
        except (httpx.InvalidURL, ValueError) as exc:
            raise refused(f"the media URL cannot be parsed ({exc})", "scheme") from None
        first_scheme = current.scheme
        for hop in range(self.config.max_redirects + 1):
            if hop:
                if current.scheme not in ("http", "https"):
                    raise refused(f"the media URL redirects to a {current.scheme}: URL", "scheme")
                if first_scheme == "https" and current.scheme == "http":
                    raise refused("the media URL redirects from https to http", "scheme")
                check_url(str(current), self.config)
            addresses = await self._addresses(current)
            result = await self._get(current, addresses, budget, want)
            if isinstance(result, httpx.URL):
                current = result.copy_with(fragment=None)
                continue
            return result[0], result[1], hop
        raise refused(
            f"the media URL redirects more than {self.config.max_redirects} times "
            "(--max-media-redirects)",
            "redirects",
        )

    async def _addresses(self, url: httpx.URL) -> list[IPAddress]:
        """The checked addresses of ``url``'s host: all of them must pass the policy."""
        host = url.raw_host.decode("ascii")
        try:
            literal: IPAddress | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            return [check_address(literal, self.config)]
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            found = await self._resolve(host, port)
        except (OSError, UnicodeError) as exc:
            message = f"the media URL's host {host} cannot be resolved ({exc})"
            raise _failed(message, "unreachable") from None
        if not found:
            raise _failed(f"the media URL's host {host} has no address", "unreachable")
        return [check_address(a, self.config) for a in found]

    async def _get(
        self, url: httpx.URL, addresses: list[IPAddress], budget: RequestBudget, want: _Want
    ) -> tuple[bytes, dict[str, str]] | httpx.URL:
        """GET ``url`` from the first of ``addresses`` that accepts a connection: the body
        and headers, or the redirect target. The socket is opened to the address; the
        name goes only into ``Host`` and, for https, the TLS server name (SNI and the
        certificate check)."""
        host = url.raw_host.decode("ascii")
        port = url.port or (443 if url.scheme == "https" else 80)
        tls = self._tls if url.scheme == "https" else None
        last: OSError | None = None
        for address in addresses:
            try:
                reader, writer = await asyncio.open_connection(
                    str(address), port, ssl=tls, server_hostname=host if tls else None
                )
            except OSError as exc:  # refused, unreachable, TLS handshake or certificate
                last = exc
                continue
            try:
                return await self._exchange(url, reader, writer, budget, want)
            finally:
                writer.close()
        raise _failed(f"the media URL's host {host} cannot be reached ({last})", "unreachable")

    async def _exchange(
        self,
        url: httpx.URL,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        budget: RequestBudget,
        want: _Want,
    ) -> tuple[bytes, dict[str, str]] | httpx.URL:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD_BYTES)
        request = h11.Request(
            method="GET",
            target=url.raw_path,
            headers=[
                (b"Host", url.netloc),
                (b"User-Agent", self.config.user_agent.encode()),
                (b"Accept", f"{want.kind}/*".encode()),
                (b"Accept-Encoding", b"identity"),
                (b"Connection", b"close"),
            ],
        )
        try:
            writer.write(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
            await writer.drain()
            event = await _next_event(conn, reader)
            while isinstance(event, h11.InformationalResponse):
                event = await _next_event(conn, reader)
            if not isinstance(event, h11.Response):
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
            headers: dict[str, str] = {}
            for raw_name, raw_value in event.headers:
                name, value = raw_name.decode("ascii").lower(), raw_value.decode("latin-1")
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            answer = self._check_head(url, event.status_code, event.reason, headers, want)
            if answer is not None:
                return answer
            cap = want.cap
            chunks: list[bytes] = []
            size = 0
            while True:
                event = await _next_event(conn, reader)
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > cap:
                        raise self._too_large(cap, None, want)
                    budget.charge(len(event.data))
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(chunks), headers
        except (h11.ProtocolError, OSError) as exc:
            message = f"the media URL's origin broke off or is not an HTTP server ({exc})"
            raise _failed(message, "unreachable") from None

    def _check_head(
        self, url: httpx.URL, status: int, reason: bytes, headers: dict[str, str], want: _Want
    ) -> httpx.URL | None:
        """The redirect target, ``None`` when the body is to be read, or the error."""
        if status in _REDIRECTS:
            location = headers.get("location")
            if not location:
                raise _failed(f"the origin answered {status} without a Location", "http_status")
            try:
                target = url.join(location)
                target.raw_host.decode("ascii")
                return target
            except (httpx.InvalidURL, ValueError) as exc:
                raise refused(f"the origin redirects to an invalid URL ({exc})", "scheme") from None
        if status != 200:
            phrase = reason.decode("latin-1", "replace")
            message = f"the media URL's origin answered {status} {phrase}".rstrip()
            raise _failed(message, "http_status")
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if not ctype.startswith(want.kind + "/") and ctype not in _GENERIC_TYPES:
            raise _failed(
                f"the media URL's origin sent {ctype}, not {want.article} {want.kind}",
                "content_type",
                "invalid_media_content_type",
            )
        coding = headers.get("content-encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            raise _failed(
                f"the media URL's origin sent a {coding}-encoded body; media are fetched "
                "without content coding",
                "content_type",
                "invalid_media_content_type",
            )
        cap = want.cap
        length = headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > cap:
            raise self._too_large(cap, int(length), want)
        return None

    @staticmethod
    def _too_large(cap: int, size: int | None, want: _Want) -> MediaError:
        told = f" ({size} bytes)" if size is not None else ""
        return MediaError(
            f"the media item is larger than {cap} bytes{told} ({want.flag})",
            code="media_too_large",
            reason="too_large",
        )

    # -------------------------------------------------------------------- file

    def _read_file(self, parts: SplitResult, want: _Want) -> bytes:
        """A file below the allowed root (module docstring), in a worker thread."""
        root = self.root
        if root is None:  # check_url refused it already; kept for direct callers
            raise refused("file:// URLs need --allowed-local-media-path", "local_path")
        path = unquote(parts.path)
        if "\x00" in path or not path.startswith("/"):
            raise refused("the file:// URL's path must be absolute", "local_path")
        if ".." in path.split("/"):
            raise refused("the file:// URL's path must not contain '..'", "local_path")
        real = os.path.realpath(path)
        rel = os.path.relpath(real, root)
        if rel == os.curdir or rel == os.pardir or rel.startswith(os.pardir + os.sep):
            raise refused(
                "the file:// URL is not below --allowed-local-media-path "
                "(symlinks are followed before the check)",
                "local_path",
            )
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            *dirs, name = rel.split(os.sep)
            for part in dirs:
                nxt = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
                os.close(fd)
                fd = nxt
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
            file_fd = os.open(name, flags, dir_fd=fd)
        except FileNotFoundError:
            raise _failed("the file:// URL names no file", "unreachable") from None
        except OSError as exc:
            raise refused(
                f"the file:// URL cannot be opened safely ({exc.strerror})", "local_path"
            ) from None
        finally:
            os.close(fd)
        try:
            info = os.fstat(file_fd)
            if not stat.S_ISREG(info.st_mode):
                raise refused("the file:// URL does not name a regular file", "local_path")
            cap = want.cap
            if info.st_size > cap:
                raise self._too_large(cap, info.st_size, want)
            with os.fdopen(file_fd, "rb", closefd=False) as f:
                data = f.read(cap + 1)
        finally:
            os.close(file_fd)
        if len(data) > cap:
            raise self._too_large(cap, None, want)
        return data
