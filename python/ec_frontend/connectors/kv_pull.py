"""What the pull-based KV connectors share: prefill holds blocks, decode pulls them.

Both :class:`~ec_frontend.connectors.kv_side_channel.KVSideChannelConnector` and
:class:`~ec_frontend.connectors.mooncake_kv.MooncakeConnector` work the same way
above their transports, and that part lives here:

* prefill (``kv_producer`` / ``kv_both``): a request whose params say
  ``{"do_remote_decode": true}`` and that finished normally keeps its blocks
  (delayed free) under a :class:`Hold`; its ``kv_transfer_params`` carry NIXL's
  keys plus what decode checks (``remote_num_tokens``, ``first_token_id``,
  ``mrope_position_delta`` when not 0, ``prompt_hash``, the hold's ``token``) and
  whatever the transport adds; the blocks are freed once decode has them or after
  ``ttl_s``;
* decode (``kv_consumer`` / ``kv_both``): params that describe the request and
  pass the trust checks park it while a worker thread moves the KV; unusable
  params are logged and counted and the prompt is computed locally; a transfer
  that fails fails the request with a clear error. Params are used once. An
  instance with neither a transfer secret nor ``--transfer-peers`` trusts no
  params: it computes the prompt locally without reading them.

The transport is four methods: :meth:`KVPullConnector.check_params` (more checks
on decode's side), :meth:`~KVPullConnector.hold_params` (prefill: register a hold,
name where it is), :meth:`~KVPullConnector.transfer` (a worker thread: move one
request's KV) and :meth:`~KVPullConnector.land` (the engine thread: put what
``transfer`` returned into the cache).

Threads: the scheduler and worker halves run on the engine thread; transfers run
on the connector's pool (:class:`~ec_frontend.connectors.peer_pool.PeerPool`:
at most ``PULLS_PER_PEER`` of its ``PULL_WORKERS`` threads on one prefill
instance) and a transport's server threads read holds. Everything
they share is in :class:`PullState`, under its lock.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ec_frontend.connectors.kv_base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVLoadResult,
)
from ec_frontend.connectors.kv_transfer_params import (
    HOLD_CLIENT_KEY,
    RemotePrefill,
    parse_remote_prefill,
    prompt_hash,
)
from ec_frontend.connectors.peer_pool import PeerPool
from ec_frontend.connectors.transfer_trust import (
    TOKEN_KEY,
    UNTRUSTED,
    check_entry,
    loggable,
    new_token,
    signed,
)
from ec_frontend.errors import ConfigError
from ec_frontend.types import JSONDict, JSONObject

if TYPE_CHECKING:
    import torch

    from ec_frontend.config import KVTransferConfig
    from ec_frontend.engine.request import Request
    from ec_frontend.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

#: Transfer threads of one consumer, and how many of them one prefill instance may
#: hold: a slow peer keeps at most half, so transfers from other peers go on.
PULL_WORKERS = 8
PULLS_PER_PEER = 4
#: Default share of prefill's KV blocks that the holds of one client may keep.
CLIENT_HOLD_FRACTION = 0.25


@dataclass(slots=True)
class Hold:
    """Blocks prefill keeps for one finished request until decode has them."""

    block_ids: list[int]
    num_tokens: int
    expires: float
    token: str


@dataclass(slots=True)
class PullLoad:
    """One request's KV for decode to move in: its own blocks and prefill's params."""

    request_id: str
    block_ids: list[int]
    remote: RemotePrefill
    started: float = 0.0


@dataclass(slots=True)
class PullMetadata(KVConnectorMetadata):
    loads: list[Any] = field(default_factory=list)


#: A transport's hold (what prefill keeps per request until decode has read it).
HoldT = TypeVar("HoldT", bound=Hold)


class PullState(Generic[HoldT]):
    """What both halves of one engine share (one object, passed to each by the factory).

    Holds, finished sends and transfers in flight are read and written by the engine
    thread, the transfer pool and the transport's server threads: only under ``lock``.
    """

    def __init__(self, config: KVTransferConfig, *, ttl_s: float, timeout_s: float) -> None:
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.client_hold_fraction = _fraction(
            config.kv_connector_extra_config.get("max_client_hold_fraction", CLIENT_HOLD_FRACTION)
        )
        #: Blocks held per client, and each hold's client and block count.
        self.client_blocks: dict[str, int] = {}
        self.hold_clients: dict[str, tuple[str, int]] = {}
        self.holds_refused = 0
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.kv_caches: list[torch.Tensor] | None = None
        self.holds: dict[str, HoldT] = {}
        self.sent: set[str] = set()
        self.tokens_sent = 0
        self.inflight: dict[str, tuple[Future[Any], Any]] = {}
        self.results: dict[str, KVLoadResult] = {}
        self.cancelled: set[str] = set()

    def bind_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The runner's KV cache tensors (they never move once allocated)."""
        with self.lock:
            self.kv_caches = kv_caches

    def release(self) -> None:
        """Free holds past their TTL (a transport may also free those decode has read)."""
        now = time.monotonic()
        with self.lock:
            for rid in [r for r, h in self.holds.items() if h.expires <= now]:
                logger.warning("KV of %s not pulled in %.1fs: freed", rid, self.ttl_s)
                self.free_hold(rid, sent=False)

    def free_hold(self, rid: str, *, sent: bool) -> None:
        """Drop ``rid``'s hold (caller holds ``lock``); the scheduler then frees its blocks."""
        self.unreserve(rid)
        hold = self.holds.pop(rid, None)
        if hold is None:
            return
        if sent:
            self.tokens_sent += hold.num_tokens
        self.sent.add(rid)

    def reserve(self, rid: str, client: str, num_blocks: int) -> str | None:
        """Count ``num_blocks`` against ``client`` for the hold of ``rid``, or say why
        not: its holds would keep more than its share of the cache's blocks. A client
        holding nothing may always hold one request (a share smaller than one prompt
        would end P/D for everyone)."""
        caches = self.kv_caches
        total = int(caches[0].shape[1]) if caches else 0
        bound = max(1, int(total * self.client_hold_fraction))
        with self.lock:
            held = self.client_blocks.get(client, 0)
            if total and held and held + num_blocks > bound:
                self.holds_refused += 1
                return (
                    f"this client's held KV ({held} blocks) plus this request's "
                    f"({num_blocks}) would pass its bound of {bound} blocks "
                    f"(max_client_hold_fraction {self.client_hold_fraction:g} of {total}); "
                    "the KV is not held: decode computes the prompt"
                )
            self.client_blocks[client] = held + num_blocks
            self.hold_clients[rid] = (client, num_blocks)
        return None

    def unreserve(self, rid: str) -> None:
        """Give back what :meth:`reserve` counted for ``rid`` (caller holds ``lock``)."""
        entry = self.hold_clients.pop(rid, None)
        if entry is None:
            return
        client, num_blocks = entry
        left = self.client_blocks[client] - num_blocks
        if left > 0:
            self.client_blocks[client] = left
        else:
            del self.client_blocks[client]

    def close(self) -> None:
        """Release the transport (default: nothing)."""


def _fraction(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
    if not ok:
        raise ConfigError(
            "kv_connector_extra_config.max_client_hold_fraction must lie in (0, 1]",
            "kv_connector_extra_config.max_client_hold_fraction",
        )
    return float(value)


class KVPullConnector(KVConnectorBase):
    """Base of the KV connectors in which prefill holds blocks and decode pulls them."""

    hands_over_sampled_token = True
    #: Name prefix of the transfer threads.
    thread_name = "kv-pull"

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        shared: PullState[Any] | None = None,
    ) -> None:
        super().__init__(config, role)
        # Any: each transport's state holds its own kind of hold (subclasses narrow it).
        self.state: PullState[Any] = shared if shared is not None else self.create_shared(config)
        self._remote: dict[str, RemotePrefill] = {}
        self._extra: dict[str, Any] = {}
        self._loads: list[Any] = []
        self._pool: PeerPool | None = None
        self._recving: set[str] = set()
        self.local_prefill_fallbacks = 0
        self.params_rejected = 0

    # ---- what a transport provides --------------------------------------

    def check_params(self, params: JSONObject, remote: RemotePrefill) -> Any:
        """Decode: what else the transport needs from ``params`` (kept with the load),
        or a string saying why they cannot be used. Default: nothing more."""
        return None

    def make_load(self, rid: str, block_ids: list[int], remote: RemotePrefill, extra: Any) -> Any:
        return PullLoad(rid, block_ids, remote)

    def hold_params(self, request: Request, block_ids: list[int], token: str) -> JSONDict | None:
        """Prefill: hold ``block_ids`` for ``request`` (under ``token``) and return the
        transport's params (``remote_host``, ``remote_port``, ...), or ``None`` when it
        cannot hold them."""
        raise NotImplementedError

    def transfer(self, load: Any, kv_caches: list[torch.Tensor]) -> Any:
        """A pool thread: move ``load``'s KV; raises with the reason when it fails."""
        raise NotImplementedError

    def land(self, load: Any, data: Any, kv_caches: list[torch.Tensor]) -> None:
        """The engine thread: put what :meth:`transfer` returned into the cache."""

    def overran(self, load: Any, now: float) -> bool:
        """Whether a transfer still running counts as failed (its own deadline passed)."""
        return False

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
        if self.config.trust.trusts_nothing:
            # No issuer is trusted: the params are ignored before they are even read.
            self.params_rejected += 1
            self.local_prefill_fallbacks += 1
            logger.debug("request %s: %s", loggable(request.request_id), UNTRUSTED)
            return 0, False
        remote = parse_remote_prefill(params, request)
        extra: Any = None
        if not isinstance(remote, str):
            extra = self.check_params(params, remote)
            if isinstance(extra, str):
                remote = extra
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
        self._extra[request.request_id] = extra
        return remote.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        remote = self._remote.get(rid)
        if remote is None or num_external_tokens <= 0:
            return
        self._loads.append(self.make_load(rid, list(block_ids), remote, self._extra.get(rid)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PullMetadata(loads=self._loads)
        self._loads = []
        return meta

    def get_load_result(self, request: Request) -> KVLoadResult | None:
        remote = self._remote.pop(request.request_id, None)
        self._extra.pop(request.request_id, None)
        with self.state.lock:
            result = self.state.results.pop(request.request_id, None)
        if result is not None and remote is not None and result.error is None:
            result.first_token_id = remote.first_token_id
        return result

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, JSONObject | None]:
        rid = request.request_id
        state = self.state
        if self._remote.pop(rid, None) is not None:
            self._extra.pop(rid, None)
            with state.lock:
                state.cancelled.add(rid)
                state.results.pop(rid, None)
        params = request.kv_transfer_params
        if (
            not self.is_producer
            or params is None
            or params.get("do_remote_decode") is not True
            or request.status.finish_reason not in ("stop", "length")
            or not request.output_token_ids
            or request.num_computed_tokens < request.num_prompt_tokens
            or not block_ids
        ):
            return False, None
        # Named by the API server for every HTTP request; absent only for in-process
        # callers (the operator's own code), whose holds are not bounded.
        client = params.get(HOLD_CLIENT_KEY)
        refused = state.reserve(rid, client, len(block_ids)) if isinstance(client, str) else None
        if refused is not None:
            logger.warning(
                "request %s: KV hold refused for client %s: %s",
                loggable(rid), loggable(client), refused,
            )  # fmt: skip
            return False, {"do_remote_prefill": False, "do_remote_decode": False,
                           "hold_refused": refused}  # fmt: skip
        token = new_token()
        where = self.hold_params(request, list(block_ids), token)
        if where is None:
            with state.lock:
                state.unreserve(rid)
            return False, None
        # Only an M-RoPE prompt has a non-zero delta; decode reads an absent key as 0.
        delta = request.mrope_position_delta
        positions = {"mrope_position_delta": delta} if delta else {}
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": state.engine_id,
            "remote_request_id": rid,
            "remote_block_ids": list(block_ids),
            **where,
            "remote_num_tokens": request.num_prompt_tokens,
            "first_token_id": request.output_token_ids[0],
            **positions,
            "prompt_hash": prompt_hash(request.prompt_token_ids),
            TOKEN_KEY: token,
        }
        return True, signed(self.config.trust.secret, "kv", rid, params, state.ttl_s)

    # ---- worker side ----------------------------------------------------

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        state = self.state
        state.bind_caches(kv_caches)
        for load in getattr(self._metadata, "loads", ()):
            if self._pool is None:
                self._pool = PeerPool(PULL_WORKERS, PULLS_PER_PEER, self.thread_name)
            load.started = time.monotonic()
            peer = (load.remote.host, load.remote.port)
            future = self._pool.submit(peer, self.transfer, load, kv_caches)
            with state.lock:
                state.inflight[load.request_id] = (future, load)

    def wait_for_load(self) -> None:
        """Lands the transfers that ended (on the engine thread); requests whose
        transfer is still running stay parked."""
        state = self.state
        now = time.monotonic()
        with state.lock:
            caches = state.kv_caches
            done = [
                (rid, f, ld)
                for rid, (f, ld) in state.inflight.items()
                if f.done() or self.overran(ld, now)
            ]
            for rid, _, _ in done:
                del state.inflight[rid]
        for rid, future, load in done:
            with state.lock:
                if rid in state.cancelled:
                    state.cancelled.discard(rid)
                    continue
            if not future.done():
                future.cancel()  # still waiting for a thread: it never starts
                error: BaseException | None = TimeoutError(f"no answer in {state.timeout_s:g}s")
            else:
                error = future.exception()
            if error is None and caches is not None:
                self.land(load, future.result(), caches)
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
        self.state.bind_caches(kv_caches)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        state = self.state
        state.release()
        with state.lock:
            sent, state.sent = state.sent, set()
        recving, self._recving = self._recving, set()
        return (sent or None), (recving or None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.state.close()

    # ---- observability --------------------------------------------------

    @property
    def num_tokens_sent(self) -> int:
        with self.state.lock:
            return self.state.tokens_sent

    @property
    def num_holds_refused(self) -> int:
        with self.state.lock:
            return self.state.holds_refused

    @property
    def num_requests_held(self) -> int:
        with self.state.lock:
            return len(self.state.holds)
