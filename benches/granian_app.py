"""``ec-frontend serve``'s app under granian, for ``benches/bench_http_servers.py``.

``app()`` is granian's factory target (``granian --interface asgi --factory
granian_app:app``): it parses ``EC_BENCH_SERVE_ARGS`` (``serve``'s flags, one
string) as ``ec-frontend serve`` does and builds the same engine and app
(``launcher.build_server_app``). What uvicorn's side adds around the app (the
drain on SIGTERM, connection caps, the stats log line) is not carried over: this
is a measurement of the HTTP server under the app, not a way to serve.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from ec_frontend.entrypoints.cli import build_parser, serve_options
from ec_frontend.entrypoints.launcher import build_server_app


def app() -> Any:
    argv = ["serve", *shlex.split(os.environ.get("EC_BENCH_SERVE_ARGS", ""))]
    options = serve_options(build_parser("serve").parse_args(argv))
    if isinstance(options, str):
        raise SystemExit(options)
    return _lifespan_ok(build_server_app(options).app)


def _lifespan_ok(inner: Any) -> Any:
    """The app, answering ASGI lifespan events (uvicorn runs it with lifespan off)."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await inner(scope, receive, send)
            return
        while True:
            message = await receive()
            kind = message["type"].rsplit(".", 1)[-1]
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return

    return asgi
