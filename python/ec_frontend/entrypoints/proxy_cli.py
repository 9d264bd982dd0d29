"""``ec-frontend proxy`` on the command line: flags, then uvicorn until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging

from ec_frontend.entrypoints.proxy import ProxyConfig, build_proxy_app

log = logging.getLogger("ec_frontend.proxy")


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encode", nargs="*", default=[], metavar="URL", help="encoder instances")
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill instances")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    p.add_argument(
        "--encoder-timeout", type=float, default=120.0, help="seconds per encoder request"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
    )


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    strip = lambda urls: tuple(u.rstrip("/") for u in urls)  # noqa: E731
    try:
        config = ProxyConfig(
            encode_urls=strip(args.encode),
            prefill_urls=strip(args.prefill),
            decode_urls=strip(args.decode),
            timeout_s=args.timeout,
            encoder_timeout_s=args.encoder_timeout,
        )
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    app, proxy = build_proxy_app(config)
    uv = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        lifespan="off",
        timeout_keep_alive=30,
        server_header=False,
    )
    server = uvicorn.Server(uv)
    log.info(
        "proxy on http://%s:%d: encode %s, prefill %s, decode %s",
        args.host,
        args.port,
        list(config.encode_urls),
        list(config.prefill_urls),
        list(config.decode_urls),
    )
    try:
        server.run()
    finally:
        asyncio.run(proxy.close())
    return 0 if server.started else 1
