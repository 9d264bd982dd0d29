"""The connector factory's registry: plugins add names, never replace them (vLLM's rule)."""

from __future__ import annotations

import pytest
from ec_frontend.connectors import factory
from ec_frontend.connectors.factory import (
    ec_connector_names,
    kv_connector_names,
    register_ec_connector,
    register_kv_connector,
)


@pytest.fixture
def registries():
    ec, kv = dict(factory._EC_CONNECTORS), dict(factory._KV_CONNECTORS)
    yield
    factory._EC_CONNECTORS.clear()
    factory._EC_CONNECTORS.update(ec)
    factory._KV_CONNECTORS.clear()
    factory._KV_CONNECTORS.update(kv)


@pytest.mark.parametrize(
    ("register", "names", "taken"),
    [
        (register_ec_connector, ec_connector_names, "ECSharedStorageConnector"),
        (register_ec_connector, ec_connector_names, "ECExampleConnector"),
        (register_kv_connector, kv_connector_names, "KVSideChannelConnector"),
        (register_kv_connector, kv_connector_names, "MooncakeConnector"),
    ],
)
def test_a_registered_name_cannot_be_replaced(registries, register, names, taken):
    before = names()
    with pytest.raises(ValueError, match=f"'{taken}' is already registered"):
        register(taken, "plugin.module:Other")
    assert names() == before


@pytest.mark.parametrize(
    ("register", "names"),
    [(register_ec_connector, ec_connector_names), (register_kv_connector, kv_connector_names)],
)
def test_a_new_name_registers_once(registries, register, names):
    register("PluginConnector", "plugin.module:PluginConnector")
    assert "PluginConnector" in names()
    with pytest.raises(ValueError, match="already registered"):
        register("PluginConnector", "plugin.module:PluginConnector")


@pytest.mark.parametrize("target", ["plugin.module", ":Cls", "plugin.module:", ""])
def test_a_target_must_name_module_and_class(registries, target):
    with pytest.raises(ValueError, match=r"package\.module:ClassName"):
        register_ec_connector("Bad", target)
    assert "Bad" not in ec_connector_names()
