"""Connectors that move nothing: the runner's code path is the same without one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_frontend.connectors.base import ECConnectorBase, ECConnectorMetadata
from ec_frontend.connectors.kv_base import KVConnectorBase, KVConnectorMetadata
from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    import torch

    from ec_frontend.engine.request import Request
    from ec_frontend.engine.scheduler_output import SchedulerOutput


class NoOpECConnector(ECConnectorBase):
    """Has nothing, loads nothing, saves nothing."""

    def has_cache_item(self, mm_hash: str, request: Request | None = None) -> bool:
        return False

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        raise RuntimeError("NoOpECConnector has no items to load")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        return ECConnectorMetadata()

    def request_finished(self, request: Request) -> tuple[bool, JSONObject | None]:
        return False, None

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        return None

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        return None


class NoOpKVConnector(KVConnectorBase):
    """Matches no tokens and moves no KV."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, JSONObject | None]:
        return False, None

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        return None

    def wait_for_load(self) -> None:
        return None

    def save_kv(self, kv_caches: list[torch.Tensor]) -> None:
        return None
