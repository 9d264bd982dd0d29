"""Connector names -> classes, imported only when a connector is created.

Optional transports stay unimported (and their dependencies uninstalled) until a
configuration names them. ``register_*`` adds a name at run time, for plugins
and tests.

An engine gets both halves of a connector from :func:`create_ec_connectors` /
:func:`create_kv_connectors`: the connector's shared state (``create_shared``) is
created once and handed to both, so two engines in one process never share
anything, even when built from the same config object.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ec_frontend.connectors.base import ECConnectorBase, ECConnectorRole
from ec_frontend.connectors.halves import ConnectorHalf
from ec_frontend.connectors.kv_base import KVConnectorBase, KVConnectorRole
from ec_frontend.errors import ConfigError

if TYPE_CHECKING:
    from ec_frontend.config import ECTransferConfig, KVTransferConfig

_EC_CONNECTORS: dict[str, str] = {
    "ECSharedStorageConnector": "ec_frontend.connectors.shared_storage:ECSharedStorageConnector",
    "ECExampleConnector": "ec_frontend.connectors.example_storage:ECExampleConnector",
    "NoOpECConnector": "ec_frontend.connectors.noop:NoOpECConnector",
    "ECSideChannelConnector": "ec_frontend.connectors.ec_side_channel:ECSideChannelConnector",
    "MooncakeStoreECConnector": "ec_frontend.connectors.mooncake_store:MooncakeStoreECConnector",
}

_KV_CONNECTORS: dict[str, str] = {
    "NoOpKVConnector": "ec_frontend.connectors.noop:NoOpKVConnector",
    "KVSideChannelConnector": "ec_frontend.connectors.kv_side_channel:KVSideChannelConnector",
    "MooncakeConnector": "ec_frontend.connectors.mooncake_kv:MooncakeConnector",
}


def _register(registry: dict[str, str], kind: str, name: str, target: str) -> None:
    if name in registry:
        raise ValueError(f"{kind} connector {name!r} is already registered ({registry[name]})")
    module, _, cls = target.partition(":")
    if not module or not cls:
        raise ValueError(
            f"{kind} connector target must be 'package.module:ClassName', got {target!r}"
        )
    registry[name] = target


def register_ec_connector(name: str, target: str) -> None:
    """Map ``name`` to ``"package.module:ClassName"``; a name already registered is a
    ``ValueError`` (vLLM's rule: a plugin cannot replace a connector silently)."""
    _register(_EC_CONNECTORS, "EC", name, target)


def register_kv_connector(name: str, target: str) -> None:
    """As :func:`register_ec_connector`, for KV connectors."""
    _register(_KV_CONNECTORS, "KV", name, target)


def ec_connector_names() -> list[str]:
    return sorted(_EC_CONNECTORS)


def kv_connector_names() -> list[str]:
    return sorted(_KV_CONNECTORS)


def _load(registry: dict[str, str], name: str, kind: str, param: str) -> type:
    target = registry.get(name)
    if target is None:
        known = ", ".join(sorted(registry))
        raise ConfigError(f"unknown {kind} connector {name!r} (known: {known})", param)
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{kind} connector {name!r} cannot be imported: {exc}", param) from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ConfigError(f"{kind} connector {name!r}: {target} is not a class", param)
    return cls


def _ec_class(config: ECTransferConfig) -> type[ECConnectorBase]:
    cls = _load(_EC_CONNECTORS, config.ec_connector, "EC", "ec_connector")
    if not issubclass(cls, ECConnectorBase):
        raise ConfigError(f"{config.ec_connector} is not an EC connector", "ec_connector")
    return cls


def _kv_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    cls = _load(_KV_CONNECTORS, config.kv_connector, "KV", "kv_connector")
    if not issubclass(cls, KVConnectorBase):
        raise ConfigError(f"{config.kv_connector} is not a KV connector", "kv_connector")
    return cls


def create_ec_connector(config: ECTransferConfig, role: ECConnectorRole) -> ECConnectorBase:
    """One half on its own (with state of its own)."""
    return _ec_class(config)(config, role)


def create_kv_connector(config: KVTransferConfig, role: KVConnectorRole) -> KVConnectorBase:
    """One half on its own (with state of its own)."""
    return _kv_class(config)(config, role)


def _shared(
    cls: type[ConnectorHalf], config: ECTransferConfig | KVTransferConfig
) -> dict[str, Any]:
    """The keyword argument giving both halves one state object (none if the class has none)."""
    shared = cls.create_shared(config)
    return {} if shared is None else {"shared": shared}


def create_ec_connectors(config: ECTransferConfig) -> tuple[ECConnectorBase, ECConnectorBase]:
    """``(scheduler half, worker half)`` of one engine, sharing one state object."""
    cls = _ec_class(config)
    extra = _shared(cls, config)
    return (
        cls(config, ECConnectorRole.SCHEDULER, **extra),
        cls(config, ECConnectorRole.WORKER, **extra),
    )


def create_kv_connectors(config: KVTransferConfig) -> tuple[KVConnectorBase, KVConnectorBase]:
    """``(scheduler half, worker half)`` of one engine, sharing one state object."""
    cls = _kv_class(config)
    extra = _shared(cls, config)
    return (
        cls(config, KVConnectorRole.SCHEDULER, **extra),
        cls(config, KVConnectorRole.WORKER, **extra),
    )
