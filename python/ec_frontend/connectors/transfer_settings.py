"""Validated settings of the side-channel connectors (address, limits, timeouts)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ec_frontend.errors import ConfigError

_INT_KEYS = ("max_items", "max_bytes", "max_item_bytes")
_FLOAT_KEYS = ("ttl_s", "timeout_s")


@dataclass(frozen=True)
class Settings:
    """Where a side channel listens and how much it accepts.

    ``port`` 0 binds an ephemeral port. ``advertise_host`` is the address put in
    transfer params (``None``: ``host``). ``ttl_s`` bounds how long an item (or
    held KV) waits to be pulled; ``timeout_s`` bounds every socket operation.
    """

    host: str
    port: int
    advertise_host: str | None
    max_items: int
    max_bytes: int
    max_item_bytes: int
    ttl_s: float
    timeout_s: float

    @classmethod
    def from_extra(
        cls,
        extra: Mapping[str, Any],
        *,
        host: str,
        port: str | int,
        defaults: Mapping[str, float],
        prefix: str,
    ) -> Settings:
        """``extra`` (the connector's extra config) over the environment's host and port."""
        host_value = extra.get("host", host)
        if not isinstance(host_value, str) or not host_value:
            raise ConfigError(f"{prefix}.host must be a non-empty string", f"{prefix}.host")
        port_value = extra.get("port", port)
        try:
            port_int = int(port_value) if not isinstance(port_value, bool) else -1
        except (TypeError, ValueError):
            port_int = -1
        if not 0 <= port_int < 65536:
            raise ConfigError(f"{prefix}.port must be a port number (0: any)", f"{prefix}.port")
        advertise = extra.get("advertise_host")
        if advertise is not None and (not isinstance(advertise, str) or not advertise):
            raise ConfigError(
                f"{prefix}.advertise_host must be a non-empty string", f"{prefix}.advertise_host"
            )
        values: dict[str, Any] = {}
        for key in (*_INT_KEYS, *_FLOAT_KEYS):
            value = extra.get(key, defaults.get(key, 1))
            ok = not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0
            if key in _INT_KEYS:
                ok = ok and isinstance(value, int)
            if not ok:
                raise ConfigError(f"{prefix}.{key} must be a positive number", f"{prefix}.{key}")
            values[key] = value
        return cls(host=host_value, port=port_int, advertise_host=advertise, **values)
