"""What an engine ended up with after it started: for the startup summary in the logs.

:func:`engine_summary` reads a built core (the real one or the mock) into plain
values (they cross the engine process's pipe in its welcome message):
``device``, ``dtype``, ``weights_bytes``, ``kv_tokens``, ``kv_bytes``,
``encoder_cache_tokens``, ``ec`` and ``kv`` (``"role connector"`` or ``None``) and
``side_channels`` (the ``host:port`` each side channel listens on). A value the
core does not have is ``None``. :func:`summary_lines` words them for the log.
"""

from __future__ import annotations

import sys
from typing import Any


def _side_channels(core: Any) -> list[str]:
    if "ec_frontend.connectors.side_channel_wire" not in sys.modules:
        return []  # no connector loaded it: no side channel listens (and torch stays out)
    from ec_frontend.connectors.side_channel_wire import SideChannelServer

    found: list[str] = []
    holders = [getattr(core, "scheduler", None), getattr(core, "runner", None)]
    for holder in holders:
        for name in ("ec_connector", "kv_connector"):
            connector = getattr(holder, name, None)
            shared = getattr(connector, "shared", None)
            for server in (
                getattr(connector, "server", None),
                getattr(getattr(shared, "store", None), "server", None),
            ):
                if isinstance(server, SideChannelServer):
                    address = f"{server.host}:{server.port}"
                    if address not in found:
                        found.append(address)
    return found


def _weights_bytes(model: Any) -> int | None:
    """Bytes of the parameters of the model's modules (each tensor counted once); ``None``
    for a model that is no torch module (the mock engine's, which never loads torch)."""
    if "torch" not in sys.modules:
        return None
    from torch import nn

    modules = [model] if isinstance(model, nn.Module) else []
    modules += [v for v in vars(model).values() if isinstance(v, nn.Module)]
    if not modules:
        return None
    seen: dict[int, int] = {}
    for module in modules:
        for p in module.parameters():
            seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def engine_summary(core: Any) -> dict[str, Any]:
    """See the module docstring."""
    out: dict[str, Any] = dict.fromkeys(
        ("device", "dtype", "weights_bytes", "kv_tokens", "kv_bytes", "encoder_cache_tokens")
    )
    model = getattr(core, "model", None)
    if model is not None:
        device, dtype = getattr(model, "device", None), getattr(model, "dtype", None)
        out["device"] = None if device is None else str(device)
        out["dtype"] = None if dtype is None else str(dtype).removeprefix("torch.")
        out["weights_bytes"] = _weights_bytes(model)
    kv = getattr(core, "kv_cache", None)
    plan = getattr(core, "kv_plan", None)
    if kv is not None:
        out["kv_tokens"] = (kv.num_blocks - 1) * kv.block_size
    if plan is not None:
        out["kv_bytes"] = plan.memory_bytes
    config = getattr(core, "config", None)
    cache = getattr(config, "cache", None)
    if cache is not None:
        out["encoder_cache_tokens"] = cache.encoder_cache_size
    ec = getattr(config, "ec_transfer", None)
    kvt = getattr(config, "kv_transfer", None)
    out["ec"] = f"{ec.ec_role} {ec.ec_connector}" if ec is not None else None
    out["kv"] = f"{kvt.kv_role} {kvt.kv_connector}" if kvt is not None else None
    out["side_channels"] = _side_channels(core)
    return out


def _gib(value: Any) -> str:
    return "?" if value is None else f"{value / 2**30:.2f} GiB"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The engine's part of the startup summary, as log lines."""
    kv_tokens = summary.get("kv_tokens")
    kv = "none (encoder only)" if kv_tokens is None else f"{kv_tokens} tokens"
    if kv_tokens is not None and summary.get("kv_bytes") is not None:
        kv += f" ({_gib(summary['kv_bytes'])})"
    lines = [
        f"engine: device {summary.get('device') or '?'}, dtype {summary.get('dtype') or '?'}, "
        f"weights {_gib(summary.get('weights_bytes'))}, KV cache {kv}, encoder cache "
        f"{summary.get('encoder_cache_tokens') or '?'} tokens",
    ]
    channels = summary.get("side_channels") or []
    lines.append(
        f"transfer: EC {summary.get('ec') or 'off'}, KV {summary.get('kv') or 'off'}, "
        f"side channel {', '.join(channels) if channels else 'none'}"
    )
    return lines
