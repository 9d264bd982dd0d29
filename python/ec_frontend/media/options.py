"""The ``serve`` flags of media by URL, and the :class:`MediaFetchConfig` they make.

Contract: :func:`add_media_args` adds the flags (vLLM's names where vLLM has the
flag: ``--allowed-media-domains``, ``--allowed-local-media-path``);
:func:`media_config` turns parsed arguments into a checked
:class:`~ec_frontend.media.policy.MediaFetchConfig` or raises ``ValueError``
with a message naming the flag (the CLI prints it and exits 2). The fetch
timeout's default is ``$VLLM_IMAGE_FETCH_TIMEOUT`` when set, as in vLLM.
"""

from __future__ import annotations

import argparse
import os

from ec_frontend.media.policy import (
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_ITEM_BYTES,
    DEFAULT_MAX_REDIRECTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_VIDEO_BYTES,
    DEFAULT_TIMEOUT_S,
    MediaFetchConfig,
    parse_domains,
    parse_networks,
)


def _default_timeout() -> float:
    raw = os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def add_media_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("media by URL (docs/security.md, 'Media by URL')")
    g.add_argument(
        "--fetch-media-urls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fetch http(s) image URLs (default on; --no-fetch-media-urls refuses them)",
    )
    g.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="DOMAIN",
        help="only fetch from these host names (exact, as vLLM; default: any host whose "
        "addresses are public)",
    )
    g.add_argument(
        "--allowed-media-networks",
        default=None,
        metavar="CIDR[,CIDR...]",
        help="private networks media may be fetched from (default: none; loopback, "
        "private, link-local and metadata addresses are refused)",
    )
    g.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="serve file:// image URLs below this directory (default: file:// refused)",
    )
    g.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=_default_timeout(),
        metavar="S",
        help="seconds for a whole fetch, redirects and body included "
        "(default $VLLM_IMAGE_FETCH_TIMEOUT or %(default)s)",
    )
    g.add_argument(
        "--max-media-item-bytes",
        type=int,
        default=DEFAULT_MAX_ITEM_BYTES,
        metavar="N",
        help="bytes one fetched item may have (default %(default)s)",
    )
    g.add_argument(
        "--max-media-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help="bytes the fetched items of one request may have together (default %(default)s)",
    )
    g.add_argument(
        "--max-media-video-bytes",
        type=int,
        default=DEFAULT_MAX_VIDEO_BYTES,
        metavar="N",
        help="bytes one fetched video may have (it counts toward "
        "--max-media-request-bytes too; default %(default)s)",
    )
    g.add_argument(
        "--max-media-redirects",
        type=int,
        default=DEFAULT_MAX_REDIRECTS,
        metavar="N",
        help="redirects followed per item, each checked again (default %(default)s)",
    )
    g.add_argument(
        "--max-concurrent-media-fetches",
        type=int,
        default=DEFAULT_MAX_CONCURRENT,
        metavar="N",
        help="fetches from origins in progress at once, server-wide; more wait, within "
        "their timeout (default %(default)s)",
    )
    g.add_argument(
        "--media-cache-bytes",
        type=int,
        default=0,
        metavar="N",
        help="in-memory cache of fetched bytes, honouring the origin's Cache-Control / "
        "Expires (default 0: off)",
    )


def media_config(args: argparse.Namespace) -> MediaFetchConfig:
    """The checked config; ``ValueError`` names the flag at fault."""
    try:
        networks = parse_networks(args.allowed_media_networks)
    except ValueError as exc:
        raise ValueError(f"--allowed-media-networks: {exc}") from None
    checks = (
        ("--media-fetch-timeout", args.media_fetch_timeout > 0, "> 0"),
        ("--max-media-item-bytes", args.max_media_item_bytes > 0, "> 0"),
        ("--max-media-request-bytes", args.max_media_request_bytes > 0, "> 0"),
        ("--max-media-video-bytes", args.max_media_video_bytes > 0, "> 0"),
        ("--max-media-redirects", args.max_media_redirects >= 0, ">= 0"),
        ("--media-cache-bytes", args.media_cache_bytes >= 0, ">= 0"),
        ("--max-concurrent-media-fetches", args.max_concurrent_media_fetches > 0, "> 0"),
    )
    for flag, ok, bound in checks:
        if not ok:
            raise ValueError(f"{flag} must be {bound}")
    config = MediaFetchConfig(
        enabled=args.fetch_media_urls,
        allowed_domains=parse_domains(args.allowed_media_domains),
        allowed_networks=networks,
        allowed_local_path=args.allowed_local_media_path,
        timeout_s=args.media_fetch_timeout,
        max_item_bytes=args.max_media_item_bytes,
        max_request_bytes=args.max_media_request_bytes,
        max_video_bytes=args.max_media_video_bytes,
        max_redirects=args.max_media_redirects,
        cache_bytes=args.media_cache_bytes,
        max_concurrent=args.max_concurrent_media_fetches,
    )
    config.local_root()  # a path that is not a directory is refused at start
    return config
