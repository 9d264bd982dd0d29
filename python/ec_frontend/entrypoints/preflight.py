"""Checks ``ec-frontend serve`` runs before anything heavy is imported or loaded.

Each returns one error line, or ``None``; the command line prints the first
and exits 2 within a second of starting, before the engine process is spawned
or torch is imported:

* the port can be bound (:func:`port_problem`);
* the transfer settings hold: the secret, when given, is not empty and is long
  enough; the transfer configs parse; their connector names are registered
  (plugins from ``$EC_FRONTEND_PLUGINS`` included); and a side channel that
  listens on a non-loopback address has a secret to authenticate its peers
  (:func:`transfer_problem`);
* the checkpoint can be read: ``config.json`` parses, the tokenizer and the
  safetensors files are there and their headers read, and so does the image
  processor config (:func:`checkpoint_problem`);
* the engine's flags are in range: the cache and scheduler sizes, and
  ``--attention-backend triton`` only where it can run
  (``ec_frontend.engine.builder.flag_problem``).
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from ec_frontend.config import (
    TRANSFER_SECRET_ENV,
    ECTransferConfig,
    KVTransferConfig,
    TransferTrust,
)
from ec_frontend.errors import ConfigError
from ec_frontend.model.checkpoint_files import image_processor_problem, tokenizer_problem

#: Side-channel connectors -> the environment variables naming their listening host.
SIDE_CHANNEL_HOST_ENV = {
    "ECSideChannelConnector": ("EC_SIDE_CHANNEL_HOST", "VLLM_EC_SIDE_CHANNEL_HOST"),
    "KVSideChannelConnector": ("KV_SIDE_CHANNEL_HOST", "VLLM_KV_SIDE_CHANNEL_HOST"),
}


def port_problem(host: str, port: int) -> str | None:
    """Whether ``host:port`` can be bound now (as uvicorn binds it, SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host {host}: cannot resolve: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            hint = " (another server is running there?)" if exc.errno == errno.EADDRINUSE else ""
            return f"--port {port}: cannot bind {host}:{port}: {exc.strerror}{hint}"
    return None


def _secret_problem(secret: str | None, secret_file: str | None) -> str | None:
    if secret is not None and not secret:
        return "--transfer-secret is empty"
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                empty = not f.read(4096).strip()
        except OSError as exc:
            return f"--transfer-secret-file: cannot read {secret_file}: {exc.strerror}"
        if empty:
            return f"--transfer-secret-file {secret_file} is empty"
    return None


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _listen_host(connector: str, extra: Any) -> str | None:
    names = SIDE_CHANNEL_HOST_ENV.get(connector)
    if names is None:
        return None
    host = extra.get("host") if hasattr(extra, "get") else None
    if isinstance(host, str) and host:
        return host
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return "127.0.0.1"


def transfer_problem(
    ec_json: str | None,
    kv_json: str | None,
    secret: str | None,
    secret_file: str | None,
    peers: str | None,
) -> str | None:
    """The transfer flags' first problem (see the module docstring)."""
    problem = _secret_problem(secret, secret_file)
    if problem is not None:
        return problem
    try:
        trust = TransferTrust.from_options(secret, secret_file, peers)
        ec = ECTransferConfig.from_json(ec_json, trust) if ec_json else None
        kv = KVTransferConfig.from_json(kv_json, trust) if kv_json else None
    except ConfigError as exc:
        return str(exc)
    if ec is None and kv is None:
        return None
    from ec_frontend.connectors.factory import ec_connector_names, kv_connector_names
    from ec_frontend.engine.builder import load_plugins

    try:
        load_plugins()
    except ImportError as exc:
        return f"cannot import a connector plugin: {exc}"
    checks: list[tuple[str, str, list[str], bool, Any]] = []
    if ec is not None:
        checks.append(
            (
                "ec",
                ec.ec_connector,
                ec_connector_names(),
                ec.is_producer,
                ec.ec_connector_extra_config,
            )
        )
    if kv is not None:
        checks.append(
            (
                "kv",
                kv.kv_connector,
                kv_connector_names(),
                kv.is_producer,
                kv.kv_connector_extra_config,
            )
        )
    for kind, name, known, producer, extra in checks:
        if name not in known:
            return (
                f"--{kind}-transfer-config: unknown {kind.upper()} connector {name!r} "
                f"(known: {', '.join(known)})"
            )
        host = _listen_host(name, extra) if producer else None
        if host is not None and not _loopback(host) and trust.secret is None:
            return (
                f"--{kind}-transfer-config: {name} listens on {host}, beyond this host: it "
                f"needs a transfer secret (--transfer-secret-file or ${TRANSFER_SECRET_ENV})"
            )
    return None


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    """The local cache's snapshot of the Hugging Face id ``model``, if it has one."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        return Path(
            snapshot_download(model, revision=revision, local_files_only=True, allow_patterns=[])
        )
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def _safetensors_problem(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is not a safetensors file (too short)"
            (length,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if length > size - 8:
                return f"{path} is not a safetensors file (header of {length} bytes)"
            json.loads(f.read(min(length, 100_000_000)))
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror}"
    except ValueError:
        return f"{path} is not a safetensors file (its header is not JSON)"
    return None


def checkpoint_problem(model: str | None, load_format: str, revision: str | None) -> str | None:
    """Whether the checkpoint ``--model`` names can be read (``None``: the built-in
    model, written on first use). A Hugging Face id not yet in the local cache is
    left to the download."""
    if model is None:
        return None
    directory = Path(model)
    if not directory.exists():
        parts = model.split("/")
        if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
            return f"--model {model!r} is neither a checkpoint directory nor a Hugging Face id"
        snapshot = _hub_snapshot(model, revision)
        if snapshot is None:
            return None
        directory = snapshot
    elif revision is not None:
        return f"--revision {revision!r} applies to a Hugging Face id, not a directory"
    if not directory.is_dir():
        return f"--model {model}: not a directory"
    config = directory / "config.json"
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except OSError as exc:
        return f"--model {model}: cannot read {config}: {exc.strerror}"
    except (ValueError, UnicodeDecodeError):
        return f"--model {model}: {config} cannot be read: not JSON"
    if not isinstance(parsed, dict):
        return f"--model {model}: {config} is not a JSON object"
    problem = tokenizer_problem(directory)
    if problem is None and load_format != "dummy":
        problem = _weights_problem(directory)
    problem = problem or image_processor_problem(directory)
    return None if problem is None else f"--model {model}: {problem}"


def _weights_problem(directory: Path) -> str | None:
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        return "no *.safetensors weights (--load-format dummy for random ones)"
    for path in weights:
        problem = _safetensors_problem(path)
        if problem is not None:
            return problem
    return None
