"""``ec-frontend proxy`` on the command line: flags, then uvicorn until SIGTERM.

The app (FastAPI) is imported when the proxy's parser is built or it runs, not when
``serve`` borrows :func:`add_transfer_trust_args`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import replace
from typing import Any

from ec_frontend.config import TRANSFER_SECRET_ENV, TransferTrust
from ec_frontend.entrypoints.http.protocol import (
    add_http_args,
    connection_cap,
    http_limits,
    limits_group,
    uvicorn_http_settings,
)

#: The environment variable holding the key that ``POST`` / ``DELETE /instances``
#: need in ``X-API-Key`` (vLLM's EPD proxy's name).
ADMIN_KEY_ENV = "ADMIN_API_KEY"

log = logging.getLogger("ec_frontend.proxy")


def add_transfer_trust_args(p: argparse.ArgumentParser, *, peers: bool = True) -> None:
    """``--transfer-secret`` / ``--transfer-secret-file`` (and ``--transfer-peers``)."""
    p.add_argument(
        "--transfer-secret",
        default=None,
        help="shared secret (16+ bytes) that signs and checks transfer params and "
        f"authenticates side channels (env: {TRANSFER_SECRET_ENV}; see docs/security.md)",
    )
    p.add_argument(
        "--transfer-secret-file",
        default=None,
        metavar="PATH",
        help="read the transfer secret from a file (kept out of the process list)",
    )
    if peers:
        p.add_argument(
            "--transfer-peers",
            default=None,
            metavar="LIST",
            help="comma-separated HOST[:PORT[-PORT]] or CIDR[:PORTS] a consumer may pull from "
            "(default: any signed peer with a secret; with neither a secret nor this list, "
            "transfer params are ignored)",
        )


class _CommaUrls(argparse.Action):
    """vLLM's EPD proxy spelling: one comma-separated list (``none``: no instance)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        urls = [u.strip() for u in str(values).split(",") if u.strip()]
        setattr(namespace, self.dest, [u for u in urls if u.lower() != "none"])


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    from ec_frontend.entrypoints.http.cli_args import add_log_args
    from ec_frontend.entrypoints.proxy.app import ProxyConfig
    from ec_frontend.entrypoints.proxy.membership import (
        DEFAULT_EVICTED_TTL,
        DEFAULT_FAIL_THRESHOLD,
        DEFAULT_PROBE_INTERVAL,
        DEFAULT_PROBE_TIMEOUT,
    )
    from ec_frontend.entrypoints.proxy.routing import (
        DEFAULT_LOAD_FACTOR,
        ENCODER_POLICIES,
        PREFILL_POLICIES,
    )

    p.add_argument("--encode", nargs="*", default=[], metavar="URL", help="encoder instances")
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill instances")
    p.add_argument(
        "--decode",
        nargs="+",
        default=[],
        metavar="URL",
        help="decode instances (prefill+decode ones when there is no --prefill); "
        "required unless --dynamic-registration",
    )
    for role in ("encode", "prefill", "decode"):
        p.add_argument(
            f"--{role}-servers-urls",
            dest=role,
            action=_CommaUrls,
            metavar="URL,URL",
            help=f"vLLM's EPD proxy spelling of --{role}: comma-separated URLs",
        )
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health "
        "(env: EC_FRONTEND_API_KEY or VLLM_API_KEY)",
    )
    r = p.add_argument_group("routing and membership (see docs/disaggregation.md)")
    r.add_argument(
        "--encoder-routing",
        choices=ENCODER_POLICIES,
        default="affinity",
        help="which encoder gets a media item: by its content identity (rendezvous hashing "
        "with bounded load), or each in turn (default %(default)s)",
    )
    r.add_argument(
        "--routing",
        choices=PREFILL_POLICIES,
        default="cache-aware",
        help="which prefill (or prefill+decode) instance gets a request: by its prompt "
        "prefix with bounded load, the least loaded, or each in turn (default %(default)s)",
    )
    r.add_argument(
        "--load-factor",
        type=float,
        default=DEFAULT_LOAD_FACTOR,
        help="how far above the mean in-flight load a keyed pick lets one instance go "
        "before the key moves on (default %(default)s)",
    )
    r.add_argument(
        "--dynamic-registration",
        action="store_true",
        help=f"accept instances at run time on POST/DELETE /instances (vLLM's EPD-proxy "
        f"API; the admin key comes from ${ADMIN_KEY_ENV}, sent as X-API-Key)",
    )
    r.add_argument(
        "--probe-interval",
        type=float,
        default=DEFAULT_PROBE_INTERVAL,
        help="seconds between health probes; 0 turns probing off (default %(default)s)",
    )
    r.add_argument(
        "--probe-timeout",
        type=float,
        default=DEFAULT_PROBE_TIMEOUT,
        help="seconds a health probe may take (default %(default)s)",
    )
    r.add_argument(
        "--fail-threshold",
        type=int,
        default=DEFAULT_FAIL_THRESHOLD,
        help="failures in a row that take an instance out of rotation (default %(default)s)",
    )
    r.add_argument("--evicted-ttl", type=float, default=DEFAULT_EVICTED_TTL,
                   help="seconds a registered instance may stay out of rotation before it is "
                   "forgotten; 0 keeps probing it (default %(default)s)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    p.add_argument(
        "--encoder-timeout", type=float, default=120.0, help="seconds per encoder request"
    )
    add_transfer_trust_args(p, peers=False)
    d = ProxyConfig(encode_urls=(), decode_urls=("http://unused",))
    limits_group(p, "proxy limits", [
        ("--max-body-bytes", int, d.max_body_bytes,
         "largest accepted request body; larger ones get 413 (default %(default)s)"),
        ("--max-media-items", int, d.max_media_items,
         "media items per request (images, videos and their _embeds references); more get 400 "
         "before any encoder request (default %(default)s)"),
        ("--max-encoder-fanout", int, d.max_encoder_fanout,
         "encoder requests in flight per client request (default %(default)s)"),
    ])  # fmt: skip
    add_http_args(p)
    add_log_args(p, server=False)
    add_epd_proxy_flags(p)


class _LogRequests(argparse.Action):
    """vLLM's EPD proxy's ``--log-requests``: an access line per request, and the
    log level raised to debug."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        namespace.access_log = True
        namespace.log_level = "debug"


#: vLLM's EPD proxy's flags that this proxy does not implement -> why.
EPD_PROXY_REFUSED: dict[str, str] = {
    "--no-rewrite": "images go through the encode instances whenever there are any; "
    "start the proxy without --encode to send them to the decode instance unchanged",
    "--ec-consumer-zmq-addrs": "consumers pull encoder outputs through their own EC "
    "connector (--ec-transfer-config); the proxy names no consumer control address",
}
#: vLLM's EPD-proxy flags accepted with the values that describe this proxy: flag ->
#: (values, why no other).
EPD_PROXY_ONLY: dict[str, tuple[tuple[str, ...], str]] = {
    "--decode-retries": (
        ("0",),
        "vLLM's retry encodes again and resends after a decode 500; this proxy moves a "
        "request an instance failed (500/502/503/504, or unreachable) to the next instance "
        "of the role, and resends it with its images inline when an encoded item cannot "
        "be loaded",
    ),
    "--ec-consumer-dp-size": (
        ("1",),
        "one engine per instance (no data-parallel replicas); run more instances behind the proxy",
    ),
}


def add_epd_proxy_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's EPD-proxy flags that the ones above do not already spell: ``--log-requests``
    (implemented), :data:`EPD_PROXY_ONLY` (accepted with the values that describe this
    proxy) and :data:`EPD_PROXY_REFUSED` (one ``not supported`` line, exit 2)."""
    from ec_frontend.entrypoints.http.vllm_flags import OnlyValues, Refused

    p.add_argument(
        "--log-requests",
        action=_LogRequests,
        nargs=0,
        help="vLLM's EPD proxy spelling: the access line for every request and --log-level debug",
    )
    for flag, reason in EPD_PROXY_REFUSED.items():
        p.add_argument(flag, action=Refused, reason=reason, help=f"not supported: {reason}")
    for flag, (values, reason) in EPD_PROXY_ONLY.items():
        p.add_argument(flag, action=OnlyValues, allowed=values, reason=reason,
                       default=values[0], help=f"only {values[0]}: {reason}")  # fmt: skip


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from ec_frontend.entrypoints.proxy.app import ProxyConfig, build_proxy_app
    from ec_frontend.entrypoints.proxy.membership import MembershipConfig

    strip = lambda urls: tuple(u.rstrip("/") for u in urls)  # noqa: E731
    try:
        config = ProxyConfig(
            encode_urls=strip(args.encode),
            prefill_urls=strip(args.prefill),
            decode_urls=strip(args.decode),
            timeout_s=args.timeout,
            encoder_timeout_s=args.encoder_timeout,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout,
            max_media_items=args.max_media_items,
            max_encoder_fanout=args.max_encoder_fanout,
            transfer_secret=TransferTrust.from_options(
                args.transfer_secret, args.transfer_secret_file
            ).secret,
            encoder_routing=args.encoder_routing,
            routing=args.routing,
            load_factor=args.load_factor,
            membership=MembershipConfig(
                dynamic_registration=args.dynamic_registration,
                probe_interval=args.probe_interval,
                probe_timeout=args.probe_timeout,
                fail_threshold=args.fail_threshold,
                evicted_ttl=args.evicted_ttl,
            ),
            admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
        )
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    from ec_frontend import logs
    from ec_frontend.entrypoints.proxy import front

    api_key = (
        args.api_key or os.environ.get("EC_FRONTEND_API_KEY") or os.environ.get("VLLM_API_KEY")
    )
    app, proxy = build_proxy_app(config)
    level = args.uvicorn_log_level or args.log_level
    uv = uvicorn.Config(
        front.wrap(app, api_key, args.access_log),
        host=args.host,
        port=args.port,
        log_level=level,
        log_config=logs.uvicorn_log_config(level),
        access_log=False,
        lifespan="on",
        server_header=False,
        **uvicorn_http_settings(
            replace(http_limits(args), max_connections=connection_cap(args.max_connections)),
            proxy.metrics.refused,
        ),
    )
    server = uvicorn.Server(uv)
    log.info(
        "proxy on http://%s:%d: encode %s, prefill %s, decode %s; routing: encoders %s, "
        "prefill %s%s; API key %s, transfer secret %s, access log %s",
        args.host,
        args.port,
        list(config.encode_urls),
        list(config.prefill_urls),
        list(config.decode_urls),
        config.encoder_routing,
        config.routing,
        "; dynamic registration on /instances" if args.dynamic_registration else "",
        "on" if api_key else "off",
        "on" if config.transfer_secret else "off",
        "on" if args.access_log else "off",
    )
    try:
        server.run()
    finally:
        asyncio.run(proxy.close())
    return 0 if server.started else 1
