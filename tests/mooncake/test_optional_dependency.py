"""Mooncake is optional: without it, naming a Mooncake connector is a startup error
that names the extra to install; the other connectors never import it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ec_frontend.config import ConfigError, ECTransferConfig, KVTransferConfig
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.factory import create_ec_connector, create_kv_connector
from ec_frontend.connectors.kv_base import KVConnectorRole

from ..helpers.processes import free_port

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
        "from ec_frontend.config import KVTransferConfig\n"
        "c = KVTransferConfig.from_json({'kv_connector': 'KVSideChannelConnector',"
        " 'kv_role': 'kv_consumer'})\n"
        "create_kv_connector(c, KVConnectorRole.SCHEDULER)\n"
        "print(any(m == 'mooncake' or m.startswith('mooncake.') for m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


@pytest.mark.slow
def test_serve_without_mooncake_stops_with_the_extra_named(tmp_path: Path) -> None:
    # A package that fails to import shadows the installed one in every process the
    # server starts (the engine runs in its own process).
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--port", str(free_port()),
           "--device", "cpu", "--ec-transfer-config", json.dumps(EC)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "cannot start" in run.stderr and "ec-frontend[mooncake]" in run.stderr
