"""Where a media fetch may go: the settings and the checks, with no I/O.

Contract:

* :class:`MediaFetchConfig` holds what ``ec-frontend serve`` was told
  (``--allowed-media-domains``, ``--allowed-media-networks``,
  ``--allowed-local-media-path``, the fetch timeout, the byte caps, the redirect
  cap, the cache size and the number of concurrent fetches). It is frozen and
  picklable (API server processes get a copy).
* :func:`check_url` checks a URL before anything is resolved or opened: scheme
  (``http``, ``https``, ``file``), no credentials, a host, and for http(s) the
  domain allowlist (exact host names, compared case-insensitively, as vLLM
  compares them). It is applied to the first URL and to every redirect target.
* :func:`check_address` checks one resolved address: it must be in an allowed
  network, or else a global unicast address. Loopback, private, link-local
  (cloud metadata included), shared (CGNAT), reserved, multicast and
  unspecified addresses are refused; an IPv4 address embedded in an IPv6 one
  (IPv4-mapped, NAT64, 6to4) is judged as the IPv4 address it carries.
* Every refusal is a :class:`MediaError` with a ``reason`` from a fixed set
  (the metrics label) and a message that names the flag that would allow it.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT`` default, in seconds.
DEFAULT_TIMEOUT_S = 5.0
#: Bytes one fetched item may have.
DEFAULT_MAX_ITEM_BYTES = 32 * 1024 * 1024
#: Bytes the fetched items of one request may have together.
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
#: Bytes of one fetched video.
DEFAULT_MAX_VIDEO_BYTES = 64 * 1024 * 1024
#: Redirects followed per item.
DEFAULT_MAX_REDIRECTS = 5
#: Fetches from origins in progress at once, server-wide.
DEFAULT_MAX_CONCURRENT = 64

#: The reasons a fetch gives no bytes (the ``reason`` label of the refusal counter).
REASONS = (
    "scheme",  # not http, https or file (a redirect included)
    "credentials",  # user:password@ in the URL
    "domain",  # host not in --allowed-media-domains
    "address",  # resolved to an address the policy refuses
    "local_path",  # file:// without --allowed-local-media-path, or outside it
    "redirects",  # more than --max-media-redirects
    "unreachable",  # DNS failure, connection refused or reset
    "timeout",  # past --media-fetch-timeout
    "http_status",  # the origin answered with something else than 200
    "content_type",  # the origin's Content-Type is not an image type
    "too_large",  # one item over --max-media-item-bytes
    "request_too_large",  # the request's items over --max-media-request-bytes
)


class MediaError(ValueError):
    """A media item that cannot be had: the request gets a 400 naming the item.

    ``code`` is the OpenAI-style error code, ``reason`` one of :data:`REASONS`
    (``None`` for problems found in the bytes, counted elsewhere), ``param`` the
    item's place in the body once known.
    """

    def __init__(
        self, message: str, *, code: str, reason: str | None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.param = param

    def at(self, param: str) -> MediaError:
        """The same error, naming ``param`` (the item's path in the body)."""
        return MediaError(self.message, code=self.code, reason=self.reason, param=param)


def refused(message: str, reason: str) -> MediaError:
    """A URL or address the policy does not allow."""
    return MediaError(message, code="media_url_refused", reason=reason)


def parse_networks(text: str | Iterable[str] | None) -> tuple[IPNetwork, ...]:
    """``CIDR[,CIDR...]`` (a bare address is a /32 or /128); ``ValueError`` names a bad one."""
    if text is None:
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[IPNetwork] = []
    for raw in items:
        for piece in raw.split(","):
            piece = piece.strip()
            if not piece:
                continue
            try:
                out.append(ipaddress.ip_network(piece, strict=False))
            except ValueError as exc:
                raise ValueError(f"not a network: {piece!r} ({exc})") from None
    return tuple(out)


def parse_domains(items: Iterable[str] | None) -> tuple[str, ...]:
    """Host names, lower-cased, from a list whose items may also be comma-separated."""
    if items is None:
        return ()
    out: list[str] = []
    for raw in items:
        out.extend(d.strip().lower().rstrip(".") for d in raw.split(",") if d.strip())
    return tuple(out)


@dataclass(frozen=True, slots=True)
class MediaFetchConfig:
    """How this server fetches media given by URL.

    ``enabled`` off: every URL item is refused (the server takes inline ``data:``
    items only). ``allowed_domains`` empty: any host whose addresses pass the
    address policy. ``allowed_networks``: private networks allowed on top of the
    global unicast addresses. ``allowed_local_path`` ``None``: ``file://`` URLs are
    refused. ``cache_bytes`` 0: no cache.
    """

    enabled: bool = True
    allowed_domains: tuple[str, ...] = ()
    allowed_networks: tuple[IPNetwork, ...] = ()
    allowed_local_path: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    #: A video item's byte cap (its bytes also count toward ``max_request_bytes``).
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    cache_bytes: int = 0
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    #: Sent as ``User-Agent``.
    user_agent: str = field(default="ec-frontend-media-fetch")

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError("the media fetch timeout must be > 0")
        if min(self.max_item_bytes, self.max_request_bytes, self.max_video_bytes) <= 0:
            raise ValueError("the media byte caps must be > 0")
        if self.max_redirects < 0 or self.cache_bytes < 0:
            raise ValueError("the redirect cap and the cache size must be >= 0")
        if self.max_concurrent <= 0:
            raise ValueError("the number of concurrent media fetches must be > 0")

    def local_root(self) -> Path | None:
        """The resolved ``--allowed-local-media-path``; ``ValueError`` when it is not a
        directory (checked at start, as vLLM checks it)."""
        if self.allowed_local_path is None:
            return None
        root = Path(os.path.realpath(self.allowed_local_path))
        if not root.is_dir():
            raise ValueError(
                f"--allowed-local-media-path {self.allowed_local_path}: not a directory"
            )
        return root


def check_url(url: str, config: MediaFetchConfig) -> SplitResult:
    """The parsed URL if the policy lets it be fetched; :class:`MediaError` otherwise.

    Nothing is resolved here: the host's addresses are checked by
    :func:`check_address` once resolved.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise refused(f"the URL cannot be parsed: {exc}", "scheme") from None
    scheme = parts.scheme.lower()
    if scheme == "file":
        if config.allowed_local_path is None:
            raise refused(
                "file:// URLs are not served unless the server is started with "
                "--allowed-local-media-path",
                "local_path",
            )
        if parts.netloc not in ("", "localhost"):
            raise refused("a file:// URL must name no host (file:///path)", "local_path")
        return parts
    if scheme not in ("http", "https"):
        raise refused(
            f"media URLs must be http, https, file or data URLs, not {scheme or 'none'}:",
            "scheme",
        )
    if parts.username is not None or parts.password is not None:
        raise refused("media URLs must not carry credentials (user:password@)", "credentials")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise refused("the media URL has no host", "scheme")
    if port == 0:
        raise refused("the media URL's port must not be 0", "scheme")
    if config.allowed_domains and host.lower() not in config.allowed_domains:
        raise refused(
            f"the host {host} is not one of --allowed-media-domains "
            f"({', '.join(config.allowed_domains)})",
            "domain",
        )
    return parts


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (IPv4-mapped, NAT64 well-known prefix,
    6to4, IPv4-compatible), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if int(address) >> 32 == 0 and int(address) > 1:  # ::a.b.c.d (deprecated)
        return ipaddress.IPv4Address(int(address))
    return None


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def check_address(address: str | IPAddress, config: MediaFetchConfig) -> IPAddress:
    """The address if the policy lets the server connect to it; :class:`MediaError` else."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        raise refused(f"the media URL resolves to a scoped address ({ip})", "address")
    for network in config.allowed_networks:
        if ip.version == network.version and ip in network:
            return ip
    judged: IPAddress = ip
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_v4(ip)
        if inner is not None:
            judged = inner
            for network in config.allowed_networks:
                if network.version == 4 and inner in network:
                    return ip
    if not judged.is_global or judged.is_multicast:
        raise refused(
            f"the media URL resolves to {ip}, a {_kind(judged)} address; such addresses "
            "are refused unless --allowed-media-networks names them",
            "address",
        )
    return ip


def _kind(ip: IPAddress) -> str:
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local (cloud metadata)"
    if ip.is_multicast:
        return "multicast"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_private:
        return "private"
    return "non-global"
