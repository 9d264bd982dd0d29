"""KV connector over TCP with NIXL-compatible ``kv_transfer_params`` (DESIGN 4.4).

Prefill (``kv_producer`` / ``kv_both``), for a request whose params say
``{"do_remote_decode": true}``: when the request finishes, its KV blocks stay
allocated (delayed free) and are served at ``host:port``; the response carries::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id", "remote_request_id", "remote_block_ids",
     "remote_host", "remote_port",
     "remote_num_tokens", "first_token_id", "mrope_position_delta", "prompt_hash",
     "token", "signature"}

The blocks are freed once decode pulled them, or after ``ttl_s``. They are
sent only to a pull that carries the hold's ``token``; with a transfer secret
the params are signed (for ``ttl_s``) and each connection is authenticated.

Decode (``kv_consumer`` / ``kv_both``), given those params: the scheduler
allocates blocks for the whole prompt and parks the request; a worker thread
pulls the KV (one exchange, bounded by ``timeout_s`` and ``max_item_bytes``);
the engine thread copies it into the cache and the request continues with
prefill's sampled token, computing no prompt token. The params are used once.
Params that do not describe this request (another prompt, other positions,
missing or mistyped keys) or that fail the trust checks (a peer outside the
allowlist; with a secret, a missing, forged, expired or replayed signature)
are logged and counted and the prompt is computed locally: no connection is
opened for them. A pull that fails (including a tensor of another shape or
dtype, or with NaN/Inf) fails the request with a clear error.

Settings: ``kv_connector_extra_config`` keys ``host``, ``port``,
``advertise_host``, ``ttl_s`` (default 30), ``timeout_s`` (default 10),
``max_item_bytes`` (default 4 GiB), over ``KV_SIDE_CHANNEL_HOST`` /
``KV_SIDE_CHANNEL_PORT`` (also ``VLLM_KV_SIDE_CHANNEL_*``; default
``127.0.0.1:5600``; port 0 picks a free one).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from ec_frontend.connectors.kv_pull import Hold, KVPullConnector, PullLoad, PullState
from ec_frontend.connectors.kv_transfer_params import RemotePrefill
from ec_frontend.connectors.side_channel_wire import (
    SideChannelServer,
    WireError,
    dtype_name,
    env_setting,
    request_tensor,
    tensor_payload,
)
from ec_frontend.connectors.transfer_settings import Settings
from ec_frontend.connectors.transfer_trust import TOKEN_KEY, valid_token
from ec_frontend.errors import ConfigError
from ec_frontend.types import JSONDict, JSONObject

if TYPE_CHECKING:
    from ec_frontend.config import KVTransferConfig
    from ec_frontend.engine.request import Request

logger = logging.getLogger(__name__)

_HOST_ENV = ("KV_SIDE_CHANNEL_HOST", "VLLM_KV_SIDE_CHANNEL_HOST")
_PORT_ENV = ("KV_SIDE_CHANNEL_PORT", "VLLM_KV_SIDE_CHANNEL_PORT")


_Load = PullLoad


class _State(PullState[Hold]):
    """Both halves' shared state, and the server that sends held KV (prefill)."""

    def __init__(self, config: KVTransferConfig, settings: Settings) -> None:
        super().__init__(config, ttl_s=settings.ttl_s, timeout_s=settings.timeout_s)
        self.settings = settings
        self.server: SideChannelServer | None = None
        if config.is_producer:
            try:
                self.server = SideChannelServer(
                    settings.host,
                    settings.port,
                    self._handle,
                    timeout_s=settings.timeout_s,
                    secret=config.trust.secret,
                )
            except OSError as exc:
                raise ConfigError(
                    f"KV side channel cannot listen on {settings.host}:{settings.port}: {exc}",
                    "kv_connector_extra_config.port",
                ) from None

    def _handle(self, request: JSONObject) -> tuple[JSONObject, bytes, Any]:
        """A server thread: send a held request's KV to the pull that has its token."""
        rid, token = request.get("remote_request_id"), request.get(TOKEN_KEY)
        if request.get("op") != "get_kv" or not isinstance(rid, str) or not valid_token(token):
            raise ValueError("expected {'op': 'get_kv', 'remote_request_id': ..., 'token': ...}")
        if request.get("remote_engine_id") != self.engine_id:
            raise KeyError("remote_engine_id names another engine")
        self.release()
        with self.lock:
            hold = self.holds.get(rid)
            caches = self.kv_caches
        if hold is None or caches is None or not hmac.compare_digest(hold.token, token):
            raise KeyError("no KV held for that request (never prefilled here, pulled, "
                           "expired, or wrong token)")  # fmt: skip
        # The held blocks are not written while held: reading them here races nothing.
        index = torch.tensor(hold.block_ids, dtype=torch.int64, device=caches[0].device)
        data = torch.stack([kv.index_select(1, index) for kv in caches])
        header, payload = tensor_payload(data)

        def on_sent() -> None:
            with self.lock:
                if self.holds.get(rid) is hold:
                    self.free_hold(rid, sent=True)

        return {"ok": True, "num_tokens": hold.num_tokens, **header}, payload, on_sent

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _settings(config: KVTransferConfig) -> Settings:
    return Settings.from_extra(
        config.kv_connector_extra_config,
        host=env_setting(_HOST_ENV, "127.0.0.1"),
        port=env_setting(_PORT_ENV, "5600"),
        defaults={
            "max_items": 1,
            "max_bytes": 1,
            "ttl_s": 30.0,
            "timeout_s": 10.0,
            "max_item_bytes": 4 << 30,
        },
        prefix="kv_connector_extra_config",
    )


class KVSideChannelConnector(KVPullConnector):
    """Prefill serves held KV blocks over TCP; decode pulls them instead of prefilling."""

    state: _State

    @classmethod
    def create_shared(cls, config: KVTransferConfig) -> _State:
        return _State(config, _settings(config))

    def make_load(self, rid: str, block_ids: list[int], remote: RemotePrefill, extra: Any) -> _Load:
        return _Load(rid, block_ids, remote)

    def hold_params(self, request: Request, block_ids: list[int], token: str) -> JSONDict | None:
        state = self.state
        if state.server is None:
            return None
        expires = time.monotonic() + state.ttl_s
        with state.lock:
            state.holds[request.request_id] = Hold(
                block_ids, request.num_prompt_tokens, expires, token
            )
        return {
            "remote_host": state.settings.advertise_host or state.settings.host,
            "remote_port": state.server.port,
        }

    def transfer(self, load: _Load, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        remote = load.remote
        first = kv_caches[0]
        expected = [len(kv_caches), 2, len(load.block_ids), *first.shape[2:]]
        nbytes = first.element_size()
        for d in expected:
            nbytes *= d
        header, data = request_tensor(
            remote.host,
            remote.port,
            {
                "op": "get_kv",
                "remote_request_id": remote.request_id,
                "remote_engine_id": remote.engine_id,
                TOKEN_KEY: remote.token,
            },
            timeout_s=self.state.settings.timeout_s,
            max_bytes=min(nbytes, self.state.settings.max_item_bytes),
            secret=self.config.trust.secret,
            shape=expected,
            dtype=dtype_name(first.dtype),
        )
        if header.get("num_tokens") != remote.num_tokens:
            raise WireError(
                f"the prefill instance's KV is not for the {remote.num_tokens} tokens "
                "the params announced"
            )
        return data

    #: The name tests and the benchmark use for :meth:`transfer`.
    _pull = transfer

    def land(self, load: _Load, data: torch.Tensor, kv_caches: list[torch.Tensor]) -> None:
        index = torch.tensor(load.block_ids, dtype=torch.int64, device=kv_caches[0].device)
        for layer, kv in enumerate(kv_caches):
            kv.index_copy_(1, index, data[layer].to(device=kv.device, dtype=kv.dtype))
