"""What the EC and KV connector interfaces share: config, role, and the halves' state.

An engine has a scheduler half and a worker half of each connector. They share
state only through the object :meth:`ConnectorHalf.create_shared` returns: the
factory (:mod:`ec_frontend.connectors.factory`) creates it once per engine and
passes it to both halves; a half created alone gets its own.
"""

from __future__ import annotations

from typing import Any


class ConnectorHalf:
    """A connector half: its transfer config (``None`` for a no-op) and its role."""

    config: Any

    @classmethod
    def create_shared(cls, config: Any) -> Any:
        """What the scheduler and worker halves of one engine share (a server, a store
        client, held KV, transfers in flight), or ``None``. Called once per engine; the
        object guards the fields that threads share with its own lock."""
        return None

    def close(self) -> None:
        """Release sockets, threads and native clients (idempotent; default: nothing)."""
        return None

    @property
    def is_producer(self) -> bool:
        return self.config is not None and self.config.is_producer

    @property
    def is_consumer(self) -> bool:
        return self.config is not None and self.config.is_consumer
