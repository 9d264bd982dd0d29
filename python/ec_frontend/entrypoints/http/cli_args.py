"""Flags of the HTTP front that ``serve`` and ``proxy`` share, under vLLM's names.

Logging (``--log-level``, ``--uvicorn-log-level``, ``--access-log``,
``--disable-log-stats``, ``--enable-log-requests``, ``--max-log-len``), CORS
(``--allowed-origins`` ...), ``--root-path`` and TLS (``--ssl-keyfile`` ...), read
into one :class:`FrontendSettings`: what uvicorn is given and how the app is wrapped.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_HUMAN_INT = re.compile(r"(-?\d+(?:\.\d+)?)([kmgtKMGT]?)")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def human_int(text: str) -> int | None:
    """vLLM's readable integers: ``1000``, ``1k`` (10^3), ``1K`` (2^10), ``2.5M``;
    ``auto`` and ``-1`` give ``None`` (the model's own value)."""
    if text.strip().lower() == "auto":
        return None
    match = _HUMAN_INT.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
    number, suffix = match.groups()
    if suffix.isupper():
        scale = 1024 ** "KMGT".index(suffix) * 1024 if suffix else 1
    else:
        scale = _SCALE[suffix]
    value = float(number) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return None if value == -1 else int(value)


def human_bytes(text: str) -> int | None:
    """A byte count in :func:`human_int`'s forms, where ``-1`` is a negative size (refused
    by the flag's own check) rather than "the model's own value"; ``auto`` is unset."""
    if text.strip() == "-1":
        return -1
    return human_int(text)


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def json_strings(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError('must be a JSON list of strings, e.g. ["*"]')
    return value


def _level(text: str) -> str:
    return text.lower()


def add_log_args(p: argparse.ArgumentParser, *, server: bool = True) -> None:
    """Log levels and the access line; with ``server``, the stats line and request
    bodies too (the proxy has neither)."""
    from ec_frontend.entrypoints.http.vllm_flags import OnlyValues

    g = p.add_argument_group("logging")
    g.add_argument(
        "--log-level",
        type=_level,
        default="info",
        action=OnlyValues,
        allowed=LOG_LEVELS,
        reason="log levels are these (any case)",
        help="this server's log level (default info)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        type=_level,
        default=None,
        action=OnlyValues,
        allowed=(*LOG_LEVELS, "trace"),
        reason="uvicorn's levels are these",
        help="uvicorn's own log level (default: --log-level)",
    )
    g.add_argument(
        "--access-log",
        "--enable-uvicorn-access-log",
        dest="access_log",
        action="store_true",
        default=True,
        help="one line per HTTP request: method, path, status, time and, for errors, the "
        "error's code and param (default on)",
    )
    g.add_argument(
        "--no-access-log",
        "--disable-uvicorn-access-log",
        dest="access_log",
        action="store_false",
        help="no access lines",
    )
    if not server:
        return
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (throughput, running and waiting requests, caches)",
    )
    g.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=False,
        help="log each request's body (up to --max-log-len characters) at info",
    )
    g.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="do not log request bodies (the default)",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="characters of a request body logged by --enable-log-requests (default: all)",
    )


@dataclass(frozen=True, slots=True)
class FrontendSettings:
    """CORS, root path and TLS of one HTTP server (``None`` / empty: off)."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    ssl_ciphers: str | None = None
    uvicorn_log_level: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FrontendSettings:
        return cls(
            allowed_origins=tuple(args.allowed_origins),
            allowed_methods=tuple(args.allowed_methods),
            allowed_headers=tuple(args.allowed_headers),
            allow_credentials=args.allow_credentials,
            root_path=args.root_path or "",
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers,
            uvicorn_log_level=args.uvicorn_log_level,
        )

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def problem(self) -> str | None:
        """Why these settings cannot serve (unreadable TLS files), or ``None``."""
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            return "--ssl-keyfile and --ssl-certfile go together"
        for flag, path in (
            ("--ssl-keyfile", self.ssl_keyfile),
            ("--ssl-certfile", self.ssl_certfile),
            ("--ssl-ca-certs", self.ssl_ca_certs),
        ):
            if path is not None:
                try:
                    with open(path, "rb") as f:
                        f.read(1)
                except OSError as exc:
                    return f"{flag}: cannot read {path}: {exc.strerror}"
        return None

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """What uvicorn's ``Config`` takes of these settings."""
        out: dict[str, Any] = {"root_path": self.root_path}
        if self.ssl_certfile:
            out.update(
                ssl_keyfile=self.ssl_keyfile,
                ssl_certfile=self.ssl_certfile,
                ssl_ca_certs=self.ssl_ca_certs,
                ssl_cert_reqs=self.ssl_cert_reqs,
            )
            if self.ssl_ciphers:
                out["ssl_ciphers"] = self.ssl_ciphers
        return out

    def wrap(self, app: Any) -> Any:
        """The app behind Starlette's CORS middleware when origins are allowed."""
        if not self.allowed_origins:
            return app
        from starlette.middleware.cors import CORSMiddleware

        return CORSMiddleware(
            app,
            allow_origins=list(self.allowed_origins),
            allow_methods=list(self.allowed_methods),
            allow_headers=list(self.allowed_headers),
            allow_credentials=self.allow_credentials,
        )


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    """CORS, ``--root-path`` and TLS, as vLLM names them."""
    g = p.add_argument_group("CORS, root path and TLS")
    for flag, default, what in (
        ("--allowed-origins", [], 'origins allowed, a JSON list such as \'["*"]\' (default: no '
         "CORS headers)"),
        ("--allowed-methods", ["*"], 'methods allowed (default ["*"])'),
        ("--allowed-headers", ["*"], 'request headers allowed (default ["*"])'),
    ):  # fmt: skip
        g.add_argument(
            flag, type=json_strings, default=default, metavar="JSON", help=f"CORS: {what}"
        )
    g.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CORS: allow credentials (default off)",
    )
    g.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a reverse proxy strips before forwarding (ASGI root_path)",
    )
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate file (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients")
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="client certificates: 0 none, 1 optional, 2 required (ssl.CERT_*; default 0)",
    )
    g.add_argument("--ssl-ciphers", default=None, help="TLS ciphers (OpenSSL cipher list)")
