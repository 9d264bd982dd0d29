"""``ec-frontend proxy``: one OpenAI endpoint in front of Encode, Prefill and Decode instances.

For each request on ``/v1/chat/completions``, ``/v1/completions`` or
``/inference/v1/generate``:

1. every distinct media item goes to an encoder (chosen by ``--encoder-routing``,
   ``routing.py``; the instances are ``membership.py``'s live ones; all items in
   parallel, one request per item carrying that item only and ``max_tokens:
   1``; an item of a chat with several images goes as two copies of itself, so the
   encoder sees that context: LLaVA-OneVision encodes such an image differently);
   their ``ec_transfer_params`` are merged. A failing encoder (transport
   error or 5xx) is retried on the next one; when every encoder fails for an
   item the request goes on without its params (the next stage encodes locally
   when it can), the response says so in ``X-EC-Fallback`` and
   ``ec_frontend_proxy_encoder_fallbacks_total`` counts it. As vLLM's EPD proxy
   does, each item goes to the encoder named by a ``uuid`` (the client's, else
   the SHA-256 of its URL; a video with the request's ``media_io_kwargs``, which
   enter its key), and the later stages get every encoded image as a metadata-only
   ``image_embeds`` reference with that ``uuid`` and the metadata the encoder
   reported (``image_grid_thw``), every encoded video as a ``video_embeds``
   reference with its metadata (``video_grid_thw``, and Qwen2.5-VL's
   ``second_per_grid_ts``): no media bytes, no decoding, no preprocessing there;
2. with prefill instances: the request goes to one (chosen by ``--routing`` on the
   prompt's prefix key; an unreachable one gives way to the next) with
   ``max_tokens: 1``, ``kv_transfer_params: {"do_remote_decode": true}`` and the ec
   params, not streamed; its ``kv_transfer_params`` are what decode needs (when
   prefill refused to hold the KV, ``hold_refused``, decode computes the prompt and
   the response carries ``X-KV-Fallback: local-prefill``);
3. the request goes to a decode instance with prefill's ``kv_transfer_params``
   (or, with no prefill stage, the ec params) and decode's answer, streamed or
   not, is passed back unchanged.

Transfer params are the instances' business: the proxy drops every
``ec_transfer_params`` / ``kv_transfer_params`` a client sends (top-level, in
``vllm_xargs`` or in ``sampling_params.extra_args``), so what reaches an
instance is only what another instance issued. With a transfer secret it also
checks the signatures of what the encoders and prefill issued: an encoder
entry that does not verify is dropped (the item is then encoded downstream, as
when the encoder fails), prefill params that do not verify give 502.

Limits (each a flag): the body is read up to ``max_body_bytes`` (413 beyond,
408 when it does not arrive within ``body_timeout_s``), a chat request carries
at most ``max_media_items`` media parts (400; ``image_embeds`` references and a
generate body's ``features.mm_hashes`` count too, checked before any encoder
request), and one request has at most
``max_encoder_fanout`` encoder requests in flight at once.

One ``X-Request-Id`` (the client's, or a fresh one) travels to every stage
(each instance makes its own engine ids unique) and comes back. An error from
an instance is passed back with its status (a client error from an encoder stops
the request there); an instance that cannot be reached gives 502.
``/health`` answers 503 while a role the proxy routes through has no healthy
instance, and unknown routes get OpenAI-shaped 404 / 405 (``proxy/front.py``);
``/metrics`` describes the proxy; ``/v1/responses``, ``/tokenize``,
``/detokenize`` and ``/inference/v1/abort_requests`` are forwarded unsplit
(``proxy/passthrough.py``); ``GET /instances`` lists the instances of each
role, live or evicted, and with ``--dynamic-registration`` ``POST`` / ``DELETE
/instances`` change them (vLLM's EPD-proxy API, behind the admin key).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ec_frontend.connectors.ec_item_params import PATCHES
from ec_frontend.connectors.transfer_trust import SIGNATURE_KEY, check_signature, loggable
from ec_frontend.entrypoints.http.errors import error_body
from ec_frontend.entrypoints.proxy.front import RoleHealth, http_error
from ec_frontend.entrypoints.proxy.membership import (
    BadRecord,
    Instance,
    Membership,
    MembershipConfig,
    MembershipConflict,
    Role,
    parse_registration,
    parse_url,
)
from ec_frontend.entrypoints.proxy.metrics import ProxyMetrics
from ec_frontend.entrypoints.proxy.routing import (
    DEFAULT_LOAD_FACTOR,
    ENCODER_POLICIES,
    PREFILL_POLICIES,
    Router,
    prefix_key,
    rendezvous_order,
)

log = logging.getLogger("ec_frontend.proxy")

ROUTES: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/inference/v1/generate": "generate",
}
FALLBACK_HEADER = "x-ec-fallback"
#: Set to ``local-prefill`` when prefill refused to hold the KV (its client bound).
KV_FALLBACK_HEADER = "x-kv-fallback"
#: The error code of an instance that could not load an item the request only
#: references (``entrypoints/http/errors.py``): the proxy then sends the image itself.
REFERENCE_FAILED = "ec_item_unavailable"
#: How much of a stream the proxy reads ahead for that error before its first token.
PEEK_LIMIT = 64 * 1024
TRANSFER_KEYS = ("ec_transfer_params", "kv_transfer_params")


@dataclass(frozen=True)
class ProxyConfig:
    """The instances behind the proxy and its limits."""

    encode_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_urls: tuple[str, ...] = ()
    timeout_s: float = 600.0
    encoder_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    max_connections: int = 512
    max_body_bytes: int = 64 * 1024 * 1024
    body_timeout_s: float = 60.0
    max_media_items: int = 32
    max_encoder_fanout: int = 8
    transfer_secret: bytes | None = field(default=None, repr=False)
    encoder_routing: str = "affinity"
    routing: str = "cache-aware"
    load_factor: float = DEFAULT_LOAD_FACTOR
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    #: The ``X-API-Key`` that ``POST`` / ``DELETE /instances`` need (``$ADMIN_API_KEY``).
    admin_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.decode_urls and not self.membership.dynamic_registration:
            raise ValueError("the proxy needs at least one --decode URL")
        if self.membership.dynamic_registration and not self.admin_key:
            raise ValueError("--dynamic-registration needs an admin key ($ADMIN_API_KEY)")
        if self.encoder_routing not in ENCODER_POLICIES:
            raise ValueError(f"--encoder-routing must be one of {', '.join(ENCODER_POLICIES)}")
        if self.routing not in PREFILL_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(PREFILL_POLICIES)}")
        if self.load_factor < 1.0:
            raise ValueError("--load-factor must be at least 1")
        for url in (*self.encode_urls, *self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"not an http(s) URL: {url!r}")


#: An instance's own failures (not the client's): the request may go to another
#: instance of the role, and they count toward the instance's eviction.
SERVER_FAILURES = frozenset({500, 502, 503, 504})


class UpstreamError(Exception):
    """An instance answered with an error (passed back) or could not be reached (502,
    ``unreachable``). ``failed``: unreachable, or it answered one of
    :data:`SERVER_FAILURES`: the request may go to another instance of the role."""

    def __init__(self, status: int, body: bytes, unreachable: bool = False) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.unreachable = unreachable

    @property
    def failed(self) -> bool:
        return self.unreachable or self.status in SERVER_FAILURES


def check_body(endpoint: str, body: dict[str, Any], disaggregated: bool) -> tuple[str, str] | None:
    """``(message, param)`` when the proxy cannot route ``body``; the instances
    validate everything else."""
    for key in ("ec_transfer_params", "kv_transfer_params"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            return f"{key} must be a JSON object or null", key
    sampling = body.get("sampling_params") if endpoint == "generate" else body
    if endpoint == "generate" and sampling is not None and not isinstance(sampling, dict):
        return "sampling_params must be a JSON object", "sampling_params"
    n = (sampling or {}).get("n")
    if disaggregated and n is not None and n != 1:
        param = "sampling_params.n" if endpoint == "generate" else "n"
        return "n must be 1 when prefill and decode run on separate instances", param
    return None


def strip_transfer_params(endpoint: str, body: dict[str, Any]) -> list[str]:
    """Removes client-supplied transfer params from ``body``; the paths it removed."""
    removed = [k for k in TRANSFER_KEYS if body.pop(k, None) is not None]
    holders = [("vllm_xargs", body.get("vllm_xargs"))]
    if endpoint == "generate" and isinstance(body.get("sampling_params"), dict):
        holders.append(("sampling_params.extra_args", body["sampling_params"].get("extra_args")))
    for path, holder in holders:
        if isinstance(holder, dict) and any(k in holder for k in TRANSFER_KEYS):
            kept = {k: v for k, v in holder.items() if k not in TRANSFER_KEYS}
            removed += [f"{path}.{k}" for k in TRANSFER_KEYS if k in holder]
            if path == "vllm_xargs":
                body["vllm_xargs"] = kept
            else:
                body["sampling_params"] = {**body["sampling_params"], "extra_args": kept}
    return removed


#: Content part types that carry no media; every other part counts as a media item.
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})


def count_media_parts(body: dict[str, Any]) -> int:
    """Media items of a body, duplicates included, as an instance counts them against
    its own ``--max-media-items``: every chat content part that is not text
    (``image_url`` to encode, ``image_embeds`` references, and any other kind, which
    an instance refuses anyway), and a generate body's ``features.mm_hashes``."""
    count = 0
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            count += not (isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES)
    features = body.get("features")
    hashes = features.get("mm_hashes") if isinstance(features, dict) else None
    if isinstance(hashes, list):
        count += len(hashes)
    return count


class ClientError(Exception):
    """A request the proxy refuses itself (its status and OpenAI error body)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(status, message, param, code)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, bounded in size (413) and arrival time (408)."""
    too_large = ClientError(
        413, f"request body exceeds the limit of {limit} bytes", "request_too_large"
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        message = f"the request body did not arrive within {timeout_s:g} s"
        raise ClientError(408, message, "body_timeout") from None
    except ClientDisconnect:
        raise ClientError(499, "client disconnected", "client_disconnected") from None
    return b"".join(chunks)


def _unreachable(url: str, exc: Exception, code: str) -> UpstreamError:
    if not isinstance(exc, httpx.HTTPError):
        # A failure of the exchange that httpx did not map to its own errors (a socket
        # torn down under it, say): the upstream is as unusable, and the trace is kept.
        log.warning("request to %s failed outside httpx's errors", url, exc_info=exc)
    return UpstreamError(502, error_body(502, f"{url}: {exc!r}", None, code), unreachable=True)


def request_id(value: str | None) -> str:
    if value and len(value) <= 256 and value.isascii() and value.isprintable() and " " not in value:
        return value
    return uuid.uuid4().hex


def stage_headers(request: Request) -> tuple[dict[str, str], dict[str, str]]:
    """(headers to every stage, headers back to the client): one ``X-Request-Id`` (the
    client's, or a fresh one) in both, and the client's ``Authorization`` to the stages."""
    rid = request_id(request.headers.get("x-request-id"))
    headers = {"x-request-id": rid, "content-type": "application/json"}
    auth = request.headers.get("authorization")
    if auth:
        headers["authorization"] = auth
    return headers, {"x-request-id": rid}


#: The reference each encoded part type becomes for the next stage (vLLM's EPD proxy's
#: ``EMBEDS_TYPES``): the part type, and the metadata key that carries its grid (an
#: encoder that reports no grid for an item leaves it to be sent as it is).
REFERENCES = {
    "image_url": ("image_embeds", "image_grid_thw"),
    "video_url": ("video_embeds", "video_grid_thw"),
}


def _image_parts(
    body: dict[str, Any], kinds: tuple[str, ...] = ("image_url",)
) -> Iterator[tuple[list[Any], int, dict[str, Any]]]:
    """``(content, index, part)`` for every part of ``kinds`` (``image_url``) of a chat
    body."""
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in kinds:
                yield content, i, part


def part_key(part: dict[str, Any]) -> bytes:
    return orjson.dumps(part, option=orjson.OPT_SORT_KEYS)


def media_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The distinct ``image_url`` and ``video_url`` content parts of a chat body, in
    order."""
    parts: dict[bytes, dict[str, Any]] = {}
    for _, _, part in _image_parts(body, tuple(REFERENCES)):
        parts.setdefault(part_key(part), part)
    return list(parts.values())


def at_client_part(exc: UpstreamError, body: dict[str, Any], part: dict[str, Any]) -> UpstreamError:
    """An encoder's 4xx about the one item it was sent (an image it could not fetch or
    decode), its ``param`` moved to where the client's body has that item."""
    try:
        data = orjson.loads(exc.body)
    except orjson.JSONDecodeError:
        return exc
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return exc
    param = err.get("param")
    if not isinstance(param, str) or not param.startswith("messages[0].content["):
        return exc
    key = part_key(part)
    messages = body.get("messages")
    for m, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for i, other in enumerate(content if isinstance(content, list) else ()):
            if isinstance(other, dict) and part_key(other) == key:
                err["param"] = f"messages[{m}].content[{i}]" + param.split("]", 2)[2]
                return UpstreamError(exc.status, orjson.dumps(data))
    return exc


def item_uuid(part: dict[str, Any]) -> str:
    """The name an image or video goes by on every stage: the client's ``uuid``, else
    (as vLLM's EPD proxy names it) the SHA-256 of its URL."""
    uid = part.get("uuid")
    if isinstance(uid, str) and uid:
        return uid
    media = part.get("video_url" if part.get("type") == "video_url" else "image_url")
    url = media.get("url") if isinstance(media, dict) else media
    return hashlib.sha256(str(url).encode()).hexdigest()


def _metadata(params: dict[str, Any], part: dict[str, Any]) -> dict[str, Any] | None:
    """The ``metadata`` of a one-item encoder answer for ``part``, every key the encoder
    reported (as vLLM's EPD proxy copies them: the grid, ``image_grid_thw`` or
    ``video_grid_thw``, and what else places the item, a Qwen2.5-VL video's
    ``second_per_grid_ts``); ``None`` when it has no grid."""
    entries = list(params.values())
    entry = entries[0] if len(entries) == 1 else None
    metadata = entry.get("metadata") if isinstance(entry, dict) else None
    _, key = REFERENCES[part.get("type", "image_url")]
    if not isinstance(metadata, dict) or metadata.get(key) is None:
        return None
    return metadata


def as_references(body: dict[str, Any], reported: dict[bytes, dict[str, Any]]) -> dict[str, Any]:
    """``body`` with each encoded image or video (``reported``: part key -> the metadata
    its encoder reported) as a metadata-only ``image_embeds`` / ``video_embeds``
    reference, so the next stage gets no media bytes; items the encoders failed stay as
    they are (encoded there)."""
    out = copy.deepcopy(body)
    for content, i, part in list(_image_parts(out, tuple(REFERENCES))):
        metadata = reported.get(part_key(part))
        if metadata is not None:
            kind, _ = REFERENCES[part["type"]]
            content[i] = {"type": kind, kind: dict(metadata), "uuid": item_uuid(part)}
    return out


def prefill_body(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` for the prefill stage: one token, not streamed, KV held for decode."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    if endpoint == "generate":
        sampling = dict(body.get("sampling_params") or {})
        sampling.update(max_tokens=1, n=1)
        sampling.pop("min_tokens", None)
        out["sampling_params"] = sampling
    else:
        out.update(max_tokens=1, n=1)
        out.pop("min_tokens", None)
    return out


class Proxy:
    """Routes requests through the stages; holds one pooled HTTP client."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        limits = httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_connections,
        )
        timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout)
        self.members = Membership(config.membership, on_eject=self._ejected)
        self.members.add_static(Role.ENCODE, config.encode_urls)
        self.members.add_static(Role.PREFILL, config.prefill_urls)
        pd = Role.DECODE if config.prefill_urls else Role.PREFILL_DECODE
        self.members.add_static(pd, config.decode_urls)
        split_decode = "round-robin" if config.routing == "round-robin" else "least-loaded"
        self.routers = {
            Role.ENCODE: Router(config.encoder_routing, config.load_factor),
            Role.PREFILL: Router(config.routing, config.load_factor),
            Role.PREFILL_DECODE: Router(config.routing, config.load_factor),
            Role.DECODE: Router(split_decode, config.load_factor),
        }

    def _ejected(self, instance: Instance) -> None:
        self.metrics.ejections.inc((instance.role.value, instance.url))

    def _decode_role(self) -> Role:
        """``decode`` in an E+P+D deployment, ``prefill_decode`` in an E+PD one."""
        return Role.DECODE if self._split() else Role.PREFILL_DECODE

    def _split(self) -> bool:
        return bool(self.members.roles() & {Role.PREFILL, Role.DECODE})

    def _order(self, role: Role, key: bytes) -> list[str]:
        """The live instances of ``role`` for ``key``: the policy's pick, then its fallbacks
        (with none live, those out of rotation, except encoders: without one, the
        consumer encodes; see ``membership.py``)."""
        candidates = self._candidates(role)
        if not candidates:
            message = f"no {role.value} instance is in rotation"
            raise UpstreamError(503, error_body(503, message, None, "no_instance"))
        loads = {url: self.metrics.in_flight.get((role.value, url), 0) for url in candidates}
        return self.routers[role].order(key, candidates, loads)

    def _candidates(self, role: Role) -> list[str]:
        """The instances in rotation; with none, those out of it (a last resort, for
        every role but encoders)."""
        live = self.members.live(role)
        return live if live or role is Role.ENCODE else self.members.evicted(role)

    def _routed(self, role: Role, url: str, key: bytes, attempt: int) -> None:
        labels = (role.value, url, self.routers[role].policy)
        self.metrics.routed.inc(labels)
        if attempt:
            self.metrics.reroutes.inc((role.value,))
        elif url == rendezvous_order(key, self._candidates(role))[0]:
            self.metrics.affinity_hits.inc(labels)

    def _load(self, role: Role, url: str) -> Callable[[], None]:
        """Counts a request in flight to ``url``; the returned function ends it (once)."""
        key = (role.value, url)
        self.metrics.in_flight[key] = self.metrics.in_flight.get(key, 0) + 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.metrics.in_flight[key] -= 1

        return release

    def _outcome(self, url: str, exc: UpstreamError | None) -> None:
        """Health news from a request: an instance that could not be reached or failed
        the request itself (:data:`SERVER_FAILURES`) counts toward its eviction, any
        other answer resets that count."""
        if exc is not None and exc.failed:
            self.members.report_failure(url)
        else:
            self.members.report_success(url)

    @contextlib.asynccontextmanager
    async def _to(self, role: Role, url: str) -> AsyncIterator[None]:
        """One request to ``url`` while it lasts: its load, and what it says of health."""
        release = self._load(role, url)
        try:
            yield
        except UpstreamError as exc:
            self._outcome(url, exc)
            raise
        else:
            self._outcome(url, None)
        finally:
            release()

    async def close(self) -> None:
        await self.members.stop()
        await self.client.aclose()

    # ---- stages -------------------------------------------------------------

    async def _post_json(
        self, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
    ) -> dict[str, Any]:
        try:
            resp = await self.client.post(
                url, content=orjson.dumps(body), headers=headers, timeout=timeout
            )
        except Exception as exc:
            raise _unreachable(url, exc, "upstream_unreachable") from None
        if resp.status_code != 200:
            raise UpstreamError(resp.status_code, resp.content)
        try:
            data = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            raise UpstreamError(
                502, error_body(502, f"{url}: not a JSON object", None, "bad_upstream")
            )
        return data

    async def _encode_one(
        self, body: dict[str, Any], part: dict[str, Any], headers: dict[str, str]
    ) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """The item's ``ec_transfer_params`` from the first encoder that gives them (the
        item named by :func:`item_uuid`, so a reference can name it downstream), less
        entries that fail verification, and the metadata the encoder reported (its
        ``image_grid_thw`` or ``video_grid_thw`` and what else places the item, from an
        encoder this proxy chose; the item itself is found by its key, through the
        params or the consumer's connector)."""
        key = item_uuid(part).encode()
        try:
            urls = self._order(Role.ENCODE, key)
        except UpstreamError:
            urls = []  # every encoder is out of rotation: the item is encoded downstream
        # An item of a prompt with several images goes in a chat of several image parts
        # (itself twice: one item, encoded once), so that a family whose encoding depends
        # on that (LLaVA-OneVision) encodes it as prefill and decode will use it.
        several = part.get("type") == "image_url" and sum(1 for _ in _image_parts(body)) > 1
        copies = 2 if several else 1
        item_body: dict[str, Any] = {
            "model": body.get("model"),
            "messages": [{"role": "user", "content": [{**part, "uuid": item_uuid(part)}] * copies}],
            "max_tokens": 1,
            "stream": False,
        }
        for scope in ("mm_processor_kwargs", "cache_salt", "media_io_kwargs"):
            if scope in body:
                item_body[scope] = body[scope]
        for attempt, url in enumerate(urls):
            if attempt:
                self.metrics.encoder_retries.inc()
            self._routed(Role.ENCODE, url, key, attempt)
            try:
                async with self._to(Role.ENCODE, url):
                    data = await self._post_json(
                        url + "/v1/chat/completions",
                        item_body,
                        headers,
                        self.config.encoder_timeout_s,
                    )
            except UpstreamError as exc:
                if 400 <= exc.status < 500 and exc.status not in (408, 429):
                    self.metrics.encoder_requests.inc(("client_error",))
                    raise at_client_part(exc, body, part) from None
                self.metrics.encoder_requests.inc(("failed",))
                log.warning("encoder %s failed (%d); trying the next", url, exc.status)
                continue
            raw = data.get("ec_transfer_params")
            params = self._verified_ec(url, raw)
            if isinstance(raw, dict) and raw:
                if not params and any(_signed(e) for e in raw.values()):
                    # Signed entries that fail verification here fail at the consumer
                    # too, so a reference could not be loaded: the image goes downstream
                    # as it came. (Unsigned entries come from connectors that find the
                    # item by its key; the reference stands.)
                    self.metrics.encoder_requests.inc(("unverified",))
                    return None
                self.metrics.encoder_requests.inc(("ok",))
                return (params if isinstance(params, dict) else {}), _metadata(raw, part)
            self.metrics.encoder_requests.inc(("no_params",))
        return None

    def _verified_ec(self, url: str, params: Any) -> Any:
        """An encoder's params, less the entries whose signature does not verify (with a
        secret; the consumer would refuse them). A whole video's entry stands when
        every patch entry under it verifies (it carries no signature of its own: its
        patches' are what a consumer checks)."""
        secret = self.config.transfer_secret
        if secret is None or not isinstance(params, dict):
            return params
        kept = {}
        for mm_hash, entry in params.items():
            if not isinstance(entry, dict):
                reason: str | None = "not an object"
            elif isinstance(entry.get(PATCHES), dict):
                reason = next(
                    (
                        r
                        for key, patch in entry[PATCHES].items()
                        if (r := _entry_problem(secret, key, patch)) is not None
                    ),
                    None,
                )
            else:
                reason = _entry_problem(secret, mm_hash, entry)
            if reason is None:
                kept[mm_hash] = entry
            else:
                log.warning("encoder %s issued ec_transfer_params that fail: %s", url, reason)
        return kept

    async def _encode(
        self, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[dict[str, Any], dict[bytes, dict[str, Any]], bool]:
        """``(ec_transfer_params, reported, fell_back)`` for the body's media items;
        ``reported`` maps each encoded part to the metadata its encoder reported."""
        parts = media_parts(body)
        if not parts or Role.ENCODE not in self.members.roles():
            return {}, {}, False
        started = time.perf_counter()
        fanout = asyncio.Semaphore(self.config.max_encoder_fanout)

        async def encode_one(
            part: dict[str, Any],
        ) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
            async with fanout:
                return await self._encode_one(body, part, headers)

        results = await asyncio.gather(*(encode_one(p) for p in parts))
        merged: dict[str, Any] = {}
        reported: dict[bytes, dict[str, Any]] = {}
        for part, result in zip(parts, results, strict=True):
            if result is None:
                continue
            params, metadata = result
            merged.update(params)
            if metadata is not None:
                reported[part_key(part)] = metadata
        self.metrics.encode_seconds.observe(time.perf_counter() - started)
        fell_back = any(p is None for p in results)
        if fell_back:
            self.metrics.encoder_fallbacks.inc()
        return merged, reported, fell_back

    def _refuse(self, endpoint: str, exc: ClientError, headers: dict[str, str]) -> Response:
        self.metrics.requests.inc((endpoint, str(exc.status)))
        return Response(exc.body, exc.status, headers, "application/json")

    async def json_body(
        self, endpoint: str, request: Request, out_headers: dict[str, str]
    ) -> dict[str, Any] | Response:
        """The request's body as a JSON object, or the proxy's refusal (size, read
        timeout, not a JSON object), counted under ``endpoint``."""
        try:
            raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)
            body = orjson.loads(raw)
        except ClientError as exc:
            return self._refuse(endpoint, exc, {**out_headers, "connection": "close"})
        except orjson.JSONDecodeError as exc:
            body, problem = None, f"the body is not valid JSON: {exc}"
        else:
            problem = "the body must be a JSON object"
        if not isinstance(body, dict):
            self.metrics.requests.inc((endpoint, "400"))
            content = error_body(400, problem, None, "invalid_json")
            return Response(content, 400, out_headers, "application/json")
        return body

    async def handle(self, endpoint: str, path: str, request: Request) -> Response:
        headers, out_headers = stage_headers(request)
        body = await self.json_body(endpoint, request, out_headers)
        if isinstance(body, Response):
            return body
        problem_param = check_body(endpoint, body, self._split())
        if problem_param is not None:
            self.metrics.requests.inc((endpoint, "400"))
            message, param = problem_param
            content = error_body(400, message, param, "invalid_value")
            return Response(content, 400, out_headers, "application/json")
        items = count_media_parts(body)
        if items > self.config.max_media_items:
            message = (
                f"the request has {items} media items (images and videos to encode and "
                f"_embeds references together); at most {self.config.max_media_items} are allowed "
                "(--max-media-items)"
            )
            param = "features.mm_hashes" if endpoint == "generate" else "messages"
            refusal = ClientError(400, message, "too_many_media_items", param)
            return self._refuse(endpoint, refusal, out_headers)
        removed = strip_transfer_params(endpoint, body)
        if removed:
            rid = headers["x-request-id"]
            log.info("request %s: dropped client-supplied %s", rid, ", ".join(removed))
        try:
            response = await self._route(endpoint, path, body, headers, out_headers)
        except UpstreamError as exc:
            response = Response(exc.body, exc.status, out_headers, "application/json")
        self.metrics.requests.inc((endpoint, str(response.status_code)))
        return response

    async def _route(
        self,
        endpoint: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        out_headers: dict[str, str],
    ) -> Response:
        ec_params: dict[str, Any] = {}
        reported: dict[bytes, dict[str, Any]] = {}
        decode_body = dict(body)
        if endpoint == "chat":
            encoded, reported, fell_back = await self._encode(body, headers)
            ec_params.update(encoded)
            if fell_back:
                out_headers[FALLBACK_HEADER] = "local-encode"
            if reported:
                decode_body = as_references(body, reported)
        if ec_params:
            decode_body["ec_transfer_params"] = ec_params
        # Where the next stage cannot load an encoded item (its encoder died or the
        # store evicted it since), the request goes again as the client sent it.
        retry_inline = body if reported or ec_params else None
        route_key = prefix_key(body)
        if self._split():
            started = time.perf_counter()
            url, data = await self._prefill(route_key, path, endpoint, decode_body, retry_inline,
                                            headers, out_headers)  # fmt: skip
            self.metrics.prefill_seconds.observe(time.perf_counter() - started)
            kv = data.get("kv_transfer_params")
            refused = kv.get("hold_refused") if isinstance(kv, dict) else None
            if isinstance(refused, str):
                # Prefill's bound on the KV this proxy holds there: decode prefills.
                log.warning("%s held no KV: %s", url, loggable(refused, 300))
                out_headers[KV_FALLBACK_HEADER] = "local-prefill"
            else:
                decode_body["kv_transfer_params"] = self._checked_kv(url, kv)
                decode_body.pop("ec_transfer_params", None)
                retry_inline = None
            self.metrics.prefills.inc()
        return await self.to_decode(
            route_key, path, decode_body, (headers, out_headers), retry_inline
        )

    async def to_decode(
        self,
        route_key: bytes,
        path: str,
        decode_body: dict[str, Any],
        stage: tuple[dict[str, str], dict[str, str]],
        retry_inline: dict[str, Any] | None = None,
    ) -> Response:
        """``decode_body`` to ``path`` on the decode (or prefill+decode) instance the
        policy picks for ``route_key``, the next one when it fails (unreachable or a 5xx); its
        answer passed back. ``stage``: the headers to the instance and back to the
        client (:func:`stage_headers`); ``retry_inline``: see :meth:`_forward`."""
        headers, out_headers = stage
        role = self._decode_role()
        urls = self._order(role, route_key)
        for attempt, base in enumerate(urls):
            self._routed(role, base, route_key, attempt)
            url = base + path
            try:
                response = await self._forward(
                    url, decode_body, headers, out_headers, retry_inline, self._load(role, base)
                )
                if response is None:
                    assert retry_inline is not None
                    self._note_reference_retry(url, out_headers)
                    response = await self._forward(
                        url, retry_inline, headers, out_headers, None, self._load(role, base)
                    )
            except UpstreamError as exc:
                self._outcome(base, exc)
                if not exc.failed or attempt == len(urls) - 1:
                    raise
                log.warning("%s instance %s failed (%d); trying the next", role.value, base,
                            exc.status)  # fmt: skip
                continue
            self._outcome(base, None)
            assert response is not None
            return response
        raise AssertionError("unreachable: _order returns at least one instance")

    async def _prefill(
        self,
        key: bytes,
        path: str,
        endpoint: str,
        body: dict[str, Any],
        retry_inline: dict[str, Any] | None,
        headers: dict[str, str],
        out_headers: dict[str, str],
    ) -> tuple[str, dict[str, Any]]:
        """``(instance, answer)`` of the prefill stage: the routed instance, or the next
        one in the policy's order when it cannot be reached."""
        urls = self._order(Role.PREFILL, key)
        for attempt, url in enumerate(urls):
            self._routed(Role.PREFILL, url, key, attempt)
            try:
                async with self._to(Role.PREFILL, url):
                    try:
                        data = await self._post_json(
                            url + path, prefill_body(endpoint, body), headers,
                            self.config.timeout_s,
                        )  # fmt: skip
                    except UpstreamError as exc:
                        if retry_inline is None or _error_code(exc.body) != REFERENCE_FAILED:
                            raise
                        self._note_reference_retry(url, out_headers)
                        data = await self._post_json(
                            url + path, prefill_body(endpoint, retry_inline), headers,
                            self.config.timeout_s,
                        )  # fmt: skip
            except UpstreamError as exc:
                if not exc.failed or attempt == len(urls) - 1:
                    raise
                log.warning("prefill instance %s failed (%d); trying the next", url, exc.status)
                continue
            return url, data
        raise AssertionError("unreachable: _order returns at least one instance")

    def _checked_kv(self, url: str, kv: Any) -> dict[str, Any]:
        """Prefill's ``kv_transfer_params`` for decode; 502 when there are none or (with a
        secret) they do not verify."""
        if not isinstance(kv, dict) or kv.get("do_remote_prefill") is not True:
            raise UpstreamError(
                502,
                error_body(502, f"{url} returned no usable kv_transfer_params", None, "no_kv"),
            )
        secret = self.config.transfer_secret
        if secret is not None:
            rid = kv.get("remote_request_id")
            key = rid if isinstance(rid, str) else ""
            reason = check_signature(secret, "kv", key, kv, consume=False)
            if reason is not None:
                message = f"{url} returned kv_transfer_params that fail verification: {reason}"
                raise UpstreamError(502, error_body(502, message, None, "untrusted_kv"))
        return kv

    def _note_reference_retry(self, url: str, out_headers: dict[str, str]) -> None:
        log.warning("%s could not load an encoded item; sending the images inline", url)
        self.metrics.reference_retries.inc()
        out_headers[FALLBACK_HEADER] = "local-encode"

    async def _forward(
        self,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str],
        out_headers: dict[str, str],
        retry_inline: dict[str, Any] | None = None,
        release: Callable[[], None] = lambda: None,
    ) -> Response | None:
        """Decode's answer, passed back; ``None`` instead when ``retry_inline`` is given
        and the answer is an error (or a stream that opens with one) saying that an
        encoded item could not be loaded, before any token. ``release`` is called once
        the answer has been passed back (the end of a stream)."""
        req = self.client.build_request("POST", url, content=orjson.dumps(body), headers=headers)
        started = time.perf_counter()
        try:
            resp = await self.client.send(req, stream=True)
        except BaseException as exc:
            release()
            if isinstance(exc, Exception):
                raise _unreachable(url, exc, "upstream_unreachable") from None
            raise
        self.metrics.decode_first_byte_seconds.observe(time.perf_counter() - started)
        media_type = resp.headers.get("content-type", "application/json")
        if resp.status_code != 200 or not media_type.startswith("text/event-stream"):
            try:
                content = await resp.aread()
            except Exception as exc:
                raise _unreachable(url, exc, "upstream_broken") from None
            finally:
                await resp.aclose()
                release()
            if retry_inline is not None and _error_code(content) == REFERENCE_FAILED:
                return None
            if resp.status_code in SERVER_FAILURES:
                raise UpstreamError(resp.status_code, content)
            return Response(content, resp.status_code, out_headers, media_type)
        chunks = resp.aiter_raw()
        head = b""
        if retry_inline is not None:
            try:
                head, code = await _read_opening(chunks)
            except BaseException as exc:
                await resp.aclose()
                release()
                if isinstance(exc, Exception):
                    raise _unreachable(url, exc, "upstream_broken") from None
                raise
            if code == REFERENCE_FAILED:
                await resp.aclose()
                release()
                return None

        async def relay() -> AsyncIterator[bytes]:
            try:
                if head:
                    yield head
                async for chunk in chunks:
                    yield chunk
            except Exception as exc:
                if not isinstance(exc, httpx.HTTPError):
                    log.warning("decode stream from %s failed", url, exc_info=exc)
                message = f"decode stream broke: {exc!r}"
                yield b"data: " + error_body(502, message, None, "upstream_broken") + b"\n\n"
            finally:
                await resp.aclose()
                release()

        return StreamingResponse(relay(), 200, out_headers, media_type)

    async def models(self) -> Response:
        try:
            role = self._decode_role()
            url = self._order(role, b"")[0] + "/v1/models"
        except UpstreamError as exc:
            return Response(exc.body, exc.status, media_type="application/json")
        try:
            resp = await self.client.get(url, timeout=self.config.connect_timeout_s * 2)
        except httpx.HTTPError as exc:
            return Response(error_body(502, f"{url}: {exc!r}", None, "upstream_unreachable"), 502)
        return Response(resp.content, resp.status_code, media_type="application/json")


def _entry_problem(secret: bytes, mm_hash: str, entry: Any) -> str | None:
    """Why one item's signed entry fails verification (``None``: it verifies)."""
    if not isinstance(entry, dict):
        return "not an object"
    return check_signature(secret, "ec", mm_hash, entry, consume=False)


def _signed(entry: Any) -> bool:
    """Whether an ``ec_transfer_params`` entry, or a patch entry under a whole video's,
    carries a signature."""
    if not isinstance(entry, dict):
        return False
    patches = entry.get(PATCHES)
    if isinstance(patches, dict):
        return any(isinstance(p, dict) and SIGNATURE_KEY in p for p in patches.values())
    return SIGNATURE_KEY in entry


def _error_code(content: bytes) -> Any:
    """The ``error.code`` of an OpenAI-style error body (``None`` if it is not one)."""
    try:
        error = orjson.loads(content).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def _opens_with_output(event: Any) -> bool:
    """Whether a stream chunk carries output (text, a tool call, a finish) rather than
    only the role a chat stream opens with."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if (
            choice.get("finish_reason")
            or choice.get("text")
            or any(v for k, v in delta.items() if k != "role")
        ):
            return True
    return False


async def _read_opening(chunks: AsyncIterator[bytes]) -> tuple[bytes, Any]:
    """The opening of an SSE stream, read up to its first output, its end or
    :data:`PEEK_LIMIT` bytes, and the code of an error event met before any output."""
    head = b""
    seen = 0
    async for chunk in chunks:
        head += chunk
        events = head.split(b"\n\n")
        for event in events[seen:-1]:
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                return head, None
            try:
                parsed = orjson.loads(data)
            except orjson.JSONDecodeError:
                return head, None
            if not isinstance(parsed, dict):
                return head, None
            if "error" in parsed:
                return head, _error_code(data)
            if _opens_with_output(parsed):
                return head, None
        seen = len(events) - 1
        if len(head) >= PEEK_LIMIT:
            break
    return head, None


async def _proxy_error(request: Request, exc: Exception) -> Response:
    """A failure of the proxy's own: an OpenAI-style 500, logged with its trace."""
    log.error("proxy error on %s", request.url.path, exc_info=exc)
    return Response(error_body(500, f"proxy error: {exc!r}", None, "proxy_error"), 500,
                    media_type="application/json")  # fmt: skip


def _admin_refusal(config: ProxyConfig, request: Request) -> Response | None:
    """403 unless the request carries the admin key in ``X-API-Key`` (vLLM's check)."""
    given = request.headers.get("x-api-key", "")
    expected = config.admin_key or ""
    if expected and hmac.compare_digest(given.encode(), expected.encode()):
        return None
    body = error_body(403, "invalid admin API key (X-API-Key)", None, "invalid_admin_key")
    return Response(body, 403, media_type="application/json")


def _list_instances(proxy: Proxy) -> Callable[[], Any]:
    async def list_instances() -> Response:
        return JSONResponse(proxy.members.status())

    return list_instances


def _registration_routes(app: FastAPI, proxy: Proxy) -> None:
    """``GET`` / ``POST`` / ``DELETE /instances``: vLLM's EPD-proxy registration API."""
    members = proxy.members

    async def register(request: Request) -> Response:
        refusal = _admin_refusal(proxy.config, request)
        if refusal is not None:
            return refusal
        try:
            instance = parse_registration(orjson.loads(await request.body()))
            created = members.register(instance)
        except orjson.JSONDecodeError as exc:
            body = error_body(400, f"the body is not valid JSON: {exc}", None, "invalid_json")
            return Response(body, 400, media_type="application/json")
        except BadRecord as exc:
            body = error_body(400, str(exc), exc.param, "invalid_value")
            return Response(body, 400, media_type="application/json")
        except MembershipConflict as exc:
            body = error_body(409, str(exc), "role", "conflict")
            return Response(body, 409, media_type="application/json")
        return JSONResponse({"registered": created})

    async def unregister(request: Request) -> Response:
        refusal = _admin_refusal(proxy.config, request)
        if refusal is not None:
            return refusal
        try:
            url = parse_url(request.query_params.get("url"))
        except BadRecord as exc:
            body = error_body(400, str(exc), exc.param, "invalid_value")
            return Response(body, 400, media_type="application/json")
        return JSONResponse({"removed": members.unregister(url)})

    app.add_api_route("/instances", _list_instances(proxy), methods=["GET"])
    app.add_api_route("/instances", register, methods=["POST"])
    app.add_api_route("/instances", unregister, methods=["DELETE"])


def build_proxy_app(config: ProxyConfig) -> tuple[FastAPI, Proxy]:
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        proxy.members.start(proxy.client)
        try:
            yield
        finally:
            await proxy.members.stop()

    app = FastAPI(
        title="ec-frontend proxy",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        exception_handlers={Exception: _proxy_error, HTTPException: http_error},
        lifespan=lifespan,
    )

    def route(path: str, endpoint: str) -> Any:
        async def handler(request: Request) -> Response:
            return await proxy.handle(endpoint, path, request)

        return handler

    for path, endpoint in ROUTES.items():
        app.add_api_route(path, route(path, endpoint), methods=["POST"])

    def health_roles() -> dict[str, tuple[str, ...]]:
        status = proxy.members.status()

        def urls(*roles: str) -> tuple[str, ...]:
            return tuple(u for r in roles for key in ("live", "evicted") for u in status[r][key])

        return {
            "decode": urls("decode", "prefill_decode"),
            "prefill": urls("prefill"),
            "encode": urls("encode"),
        }

    health = RoleHealth(
        proxy.client, health_roles, config.connect_timeout_s, report=proxy.members.report
    )
    proxy.members.on_return = health.forget

    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type="text/plain; version=0.0.4")

    async def health_route() -> Response:
        return await health()

    app.add_api_route("/health", health_route, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    # The forwarded routes' module builds on this one.
    from ec_frontend.entrypoints.proxy import passthrough

    passthrough.register(app, proxy)
    if config.membership.dynamic_registration:
        _registration_routes(app, proxy)
    else:
        app.add_api_route("/instances", _list_instances(proxy), methods=["GET"])
    return app, proxy
