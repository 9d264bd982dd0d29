"""Connectors for the server tests, registered through the connector factory.

The server process imports this module through ``EC_FRONTEND_PLUGINS``. Each
connector moves nothing (it behaves like the no-op one) but its
``request_finished`` returns what the engine's ``Request`` read from
``sampling_params.extra_args``, so a test can see, over HTTP, that
``kv_transfer_params`` / ``ec_transfer_params`` reached the engine and that a
connector's params come back in the response.
"""

from __future__ import annotations

from typing import Any

from ec_frontend.connectors.factory import register_ec_connector, register_kv_connector
from ec_frontend.connectors.noop import NoOpECConnector, NoOpKVConnector
from ec_frontend.engine.request import Request


class EchoKVConnector(NoOpKVConnector):
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        extra = request.sampling_params.extra_args or {}
        return False, {
            "connector": "EchoKVConnector",
            "received": request.kv_transfer_params,
            "extra_args_keys": sorted(extra),
            "num_blocks": len(block_ids),
        }


class EchoECConnector(NoOpECConnector):
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return False, {"connector": "EchoECConnector", "received": request.ec_transfer_params}


register_kv_connector("EchoKVConnector", f"{__name__}:EchoKVConnector")
register_ec_connector("EchoECConnector", f"{__name__}:EchoECConnector")
