"""Mooncake is optional: without it, naming a Mooncake connector is a startup error
that names the extra to install; the other connectors never import it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.factory import create_ec_connector, create_kv_connector
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.engine.config import ConfigError, ECTransferConfig, KVTransferConfig

EC = {"ec_connector": "MooncakeStoreECConnector", "ec_role": "ec_consumer",
      "ec_connector_extra_config": {"master_server_address": "127.0.0.1:1"}}  # fmt: skip
KV = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("mooncake", "mooncake.store", "mooncake.engine"):  # even if imported before
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"ec-frontend\[mooncake\]"):
        create_ec_connector(ECTransferConfig.from_json(EC), ECConnectorRole.SCHEDULER)
    with pytest.raises(ConfigError, match=r"ec-frontend\[mooncake\]"):
        create_kv_connector(KVTransferConfig.from_json(KV), KVConnectorRole.SCHEDULER)


def test_side_channels_do_not_import_mooncake() -> None:
    code = (
        "import sys\n"
        "from ec_frontend.connectors.factory import create_kv_connector\n"
        "from ec_frontend.connectors.kv_base import KVConnectorRole\n"
        "from ec_frontend.engine.config import KVTransferConfig\n"
        "c = KVTransferConfig.from_json({'kv_connector': 'KVSideChannelConnector',"
        " 'kv_role': 'kv_consumer'})\n"
        "create_kv_connector(c, KVConnectorRole.SCHEDULER)\n"
        "print(any(m == 'mooncake' or m.startswith('mooncake.') for m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


@pytest.mark.slow
def test_serve_without_mooncake_stops_with_the_extra_named() -> None:
    code = (
        "import sys\n"
        "sys.modules['mooncake'] = None\n"
        "from ec_frontend.entrypoints.cli import main\n"
        f"sys.argv = ['ec-frontend', 'serve', '--port', '1', '--device', 'cpu',"
        f" '--ec-transfer-config', {json.dumps(json.dumps(EC))}]\n"
        "sys.exit(main())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "cannot start" in run.stderr and "ec-frontend[mooncake]" in run.stderr
