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
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ec_frontend.connectors.kv_base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVLoadResult,
)
from ec_frontend.connectors.kv_transfer_params import (
    RemotePrefill,
    parse_remote_prefill,
    prompt_hash,
)
from ec_frontend.connectors.side_channel_wire import (
    SideChannelServer,
    WireError,
    dtype_name,
    env_setting,
    request_tensor,
    tensor_payload,
)
from ec_frontend.connectors.transfer_settings import Settings
from ec_frontend.connectors.transfer_trust import (
    TOKEN_KEY,
    check_entry,
    loggable,
    new_token,
    signed,
    valid_token,
)
from ec_frontend.engine.config import ConfigError

if TYPE_CHECKING:
    from ec_frontend.engine.config import KVTransferConfig
    from ec_frontend.engine.request import Request
    from ec_frontend.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

_HOST_ENV = ("KV_SIDE_CHANNEL_HOST", "VLLM_KV_SIDE_CHANNEL_HOST")
_PORT_ENV = ("KV_SIDE_CHANNEL_PORT", "VLLM_KV_SIDE_CHANNEL_PORT")


@dataclass(slots=True)
class _Load:
    request_id: str
    block_ids: list[int]
    remote: RemotePrefill


@dataclass(slots=True)
class KVSideChannelMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


@dataclass(slots=True)
class _Hold:
    block_ids: list[int]
    num_tokens: int
    expires: float
    token: str


class _State:
    """What both halves of one engine share: held KV, pulls in flight, the server."""

    def __init__(self, config: KVTransferConfig, settings: Settings) -> None:
        self.settings = settings
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.lock = threading.Lock()
        self.kv_caches: list[torch.Tensor] | None = None
        self.holds: dict[str, _Hold] = {}
        self.sent: set[str] = set()
        self.tokens_sent = 0
        self.inflight: dict[str, tuple[Future[torch.Tensor], _Load]] = {}
        self.results: dict[str, KVLoadResult] = {}
        self.cancelled: set[str] = set()
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

    def expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            for rid in [r for r, h in self.holds.items() if h.expires <= now]:
                logger.warning("KV of %s not pulled in %.1fs: freed", rid, self.settings.ttl_s)
                del self.holds[rid]
                self.sent.add(rid)

    def _handle(self, request: dict[str, Any]) -> tuple[dict[str, Any], bytes, Any]:
        rid, token = request.get("remote_request_id"), request.get(TOKEN_KEY)
        if request.get("op") != "get_kv" or not isinstance(rid, str) or not valid_token(token):
            raise ValueError("expected {'op': 'get_kv', 'remote_request_id': ..., 'token': ...}")
        if request.get("remote_engine_id") != self.engine_id:
            raise KeyError("remote_engine_id names another engine")
        self.expire()
        with self.lock:
            hold = self.holds.get(rid)
            caches = self.kv_caches
        if hold is None or caches is None or not hmac.compare_digest(hold.token, token):
            raise KeyError("no KV held for that request (never prefilled here, pulled, "
                           "expired, or wrong token)")  # fmt: skip
        index = torch.tensor(hold.block_ids, dtype=torch.int64, device=caches[0].device)
        data = torch.stack([kv.index_select(1, index) for kv in caches])
        header, payload = tensor_payload(data)

        def on_sent() -> None:
            with self.lock:
                if self.holds.pop(rid, None) is not None:
                    self.sent.add(rid)
                    self.tokens_sent += hold.num_tokens

        return {"ok": True, "num_tokens": hold.num_tokens, **header}, payload, on_sent


_STATES: dict[int, tuple[KVTransferConfig, _State]] = {}
_STATES_LOCK = threading.Lock()


def _state_for(config: KVTransferConfig) -> _State:
    with _STATES_LOCK:
        entry = _STATES.get(id(config))
        if entry is None or entry[0] is not config:
            settings = Settings.from_extra(
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
            entry = (config, _State(config, settings))
            _STATES[id(config)] = entry
        return entry[1]


class KVSideChannelConnector(KVConnectorBase):
    """Prefill serves held KV blocks over TCP; decode pulls them instead of prefilling."""

    hands_over_sampled_token = True

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.state = _state_for(config)
        self._remote: dict[str, RemotePrefill] = {}
        self._loads: list[_Load] = []
        self._pool: ThreadPoolExecutor | None = None
        self._recving: set[str] = set()
        self.local_prefill_fallbacks = 0
        self.params_rejected = 0

    # ---- scheduler side -------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        known = self._remote.get(request.request_id)
        if known is not None:
            # Parsed before, but its blocks could not be allocated then: still pending.
            return known.num_tokens - num_computed_tokens, True
        params = request.kv_transfer_params
        if not self.is_consumer or params is None or params.get("do_remote_prefill") is not True:
            return 0, False
        request.kv_transfer_params = None
        remote = parse_remote_prefill(params, request)
        if not isinstance(remote, str):
            reason = check_entry(
                self.config.trust, "kv", remote.request_id, params, remote.host, remote.port
            )
            if reason is not None:
                self.params_rejected += 1
                remote = f"refused: {reason} ({loggable(remote.host)}:{remote.port})"
        if isinstance(remote, str):
            self.local_prefill_fallbacks += 1
            logger.warning(
                "request %s: kv_transfer_params unusable (%s); computing the prompt locally",
                request.request_id,
                remote,
            )
            return 0, False
        self._remote[request.request_id] = remote
        return remote.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        remote = self._remote.get(request.request_id)
        if remote is None or num_external_tokens <= 0:
            return
        self._loads.append(_Load(request.request_id, list(block_ids), remote))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVSideChannelMetadata(loads=self._loads)
        self._loads = []
        return meta

    def get_load_result(self, request: Request) -> KVLoadResult | None:
        remote = self._remote.pop(request.request_id, None)
        with self.state.lock:
            result = self.state.results.pop(request.request_id, None)
        if result is not None and remote is not None and result.error is None:
            result.first_token_id = remote.first_token_id
        return result

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        state = self.state
        if self._remote.pop(rid, None) is not None:
            with state.lock:
                state.cancelled.add(rid)
                state.results.pop(rid, None)
        params = request.kv_transfer_params
        if (
            not self.is_producer
            or state.server is None
            or params is None
            or params.get("do_remote_decode") is not True
            or request.status.finish_reason not in ("stop", "length")
            or not request.output_token_ids
            or request.num_computed_tokens < request.num_prompt_tokens
            or not block_ids
        ):
            return False, None
        token = new_token()
        expires = time.monotonic() + state.settings.ttl_s
        with state.lock:
            state.holds[rid] = _Hold(list(block_ids), request.num_prompt_tokens, expires, token)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": state.engine_id,
            "remote_request_id": rid,
            "remote_block_ids": list(block_ids),
            "remote_host": state.settings.advertise_host or state.settings.host,
            "remote_port": state.server.port,
            "remote_num_tokens": request.num_prompt_tokens,
            "first_token_id": request.output_token_ids[0],
            "mrope_position_delta": request.mrope_position_delta,
            "prompt_hash": prompt_hash(request.prompt_token_ids),
            TOKEN_KEY: token,
        }
        return True, signed(self.config.trust.secret, "kv", rid, params, state.settings.ttl_s)

    # ---- worker side ----------------------------------------------------

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        state = self.state
        state.kv_caches = kv_caches
        meta = self._metadata
        for load in getattr(meta, "loads", ()):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-pull")
            future = self._pool.submit(self._pull, load, kv_caches)
            with state.lock:
                state.inflight[load.request_id] = (future, load)

    def _pull(self, load: _Load, kv_caches: list[torch.Tensor]) -> torch.Tensor:
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

    def wait_for_load(self) -> None:
        """Copies the pulls that have landed into the cache (on the engine thread).

        Loads are asynchronous: requests still pulling stay parked.
        """
        state = self.state
        caches = state.kv_caches
        with state.lock:
            done = [(rid, f, ld) for rid, (f, ld) in state.inflight.items() if f.done()]
            for rid, _, _ in done:
                del state.inflight[rid]
        for rid, future, load in done:
            with state.lock:
                if rid in state.cancelled:
                    state.cancelled.discard(rid)
                    continue
            error = future.exception()
            if error is None and caches is not None:
                data = future.result()
                index = torch.tensor(load.block_ids, dtype=torch.int64, device=caches[0].device)
                for layer, kv in enumerate(caches):
                    kv.index_copy_(1, index, data[layer].to(device=kv.device, dtype=kv.dtype))
                result = KVLoadResult()
            else:
                remote = load.remote
                # Without a secret, the params may have come from a client: its own input
                # failed (400). Signed params came from a trusted prefill that failed (502).
                origin = "signed" if self.config.trust.secret else "unverified"
                result = KVLoadResult(
                    error=f"KV transfer from the prefill instance {remote.host}:{remote.port} "
                    f"({origin} kv_transfer_params) failed: {error}"
                )
                logger.warning("request %s: %s", rid, result.error)
            with state.lock:
                state.results[rid] = result
                self._recving.add(rid)

    def save_kv(self, kv_caches: list[torch.Tensor]) -> None:
        self.state.kv_caches = kv_caches

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        state = self.state
        state.expire()
        with state.lock:
            sent, state.sent = state.sent, set()
            recving, self._recving = self._recving, set()
        return (sent or None), (recving or None)

    # ---- observability --------------------------------------------------

    @property
    def num_tokens_sent(self) -> int:
        return self.state.tokens_sent

    @property
    def num_requests_held(self) -> int:
        with self.state.lock:
            return len(self.state.holds)
