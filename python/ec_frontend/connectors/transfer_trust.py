"""Transfer params a consumer may act on: signatures, replay refusal, the peer allowlist.

Producers sign each entry they emit (an EC item keyed by its ``mm_hash``, a
KV hand-over) when the deployment has a secret::

    entry["signature"] = "v1.<expires, unix s>.<nonce, 32 hex>.<HMAC-SHA256, 64 hex>"

The MAC covers ``["v1", kind, key, expires, nonce, entry]`` as JSON with
sorted keys (the entry without its signature), so no field (peer address,
sizes, the item's token, the KV's prompt hash) can change, the entry cannot
move to another item (``key`` is the ``mm_hash``), and it stops working at
``expires``. A consumer claims the nonce when it accepts an entry: the same
signed entry is refused the second time (per consumer process).

Every entry also carries a ``token`` (random, per item or per held KV) that
the producer asks for before it sends or releases anything: knowing an
``mm_hash`` or a request id is not enough to read or free another request's
data, with or without a secret.

:func:`check_entry` is the one gate a consumer calls before it opens a
connection: the peer must be one the operator named (``--transfer-peers``,
when given), and with a secret the signature must be valid, unexpired and
unused. With neither a secret nor named peers nothing passes: params are
ignored whatever they name, before any connection (:data:`UNTRUSTED`). Host
names are compared as written and never resolved.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import threading
import time
from typing import TYPE_CHECKING, TypeGuard

import orjson

from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    from ec_frontend.config import TransferTrust

SIGNATURE_KEY = "signature"
TOKEN_KEY = "token"
_VERSION = "v1"
#: How far in the future an expiry may lie (a producer's clock ahead of ours, or a
#: long TTL); anything later is refused as not issued by a sane producer.
MAX_LIFETIME_S = 3600
#: Entries expired by less than this are still accepted (clocks of two hosts differ).
CLOCK_SKEW_S = 5
_SIGNATURE = re.compile(r"v1\.([0-9]{1,12})\.([0-9a-f]{32})\.([0-9a-f]{64})")
_TOKEN = re.compile(r"[0-9a-f]{32}")
#: Why params are ignored by an instance that trusts no issuer (the same for every peer).
UNTRUSTED = "no transfer secret and no --transfer-peers: transfer params are not trusted"


def new_token() -> str:
    """A fresh credential for one item or one held KV."""
    return secrets.token_hex(16)


def valid_token(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _TOKEN.fullmatch(value) is not None


def _canonical(kind: str, key: str, entry: JSONObject, expires: int, nonce: str) -> bytes:
    body = {k: v for k, v in entry.items() if k != SIGNATURE_KEY}
    return orjson.dumps([_VERSION, kind, key, expires, nonce, body], option=orjson.OPT_SORT_KEYS)


def _mac(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, kind: str, key: str, entry: JSONObject, ttl_s: float) -> str:
    """The signature of ``entry`` (``kind`` "ec" or "kv", ``key`` its ``mm_hash``),
    valid for ``ttl_s`` seconds."""
    expires = int(time.time() + ttl_s) + 1
    nonce = secrets.token_hex(16)
    mac = _mac(secret, _canonical(kind, key, entry, expires, nonce))
    return f"{_VERSION}.{expires}.{nonce}.{mac}"


def signed(
    secret: bytes | None, kind: str, key: str, entry: JSONObject, ttl_s: float
) -> JSONObject:
    """``entry`` with its signature added (unchanged without a secret)."""
    if secret is None:
        return entry
    return {**entry, SIGNATURE_KEY: sign(secret, kind, key, entry, ttl_s)}


class _Nonces:
    """Nonces of accepted entries until they expire: a replay is refused.

    Expired nonces are dropped every ``PURGE_S`` (or when ``LIMIT`` is reached);
    at the limit with nothing expired, new entries are refused.
    """

    LIMIT = 1 << 20
    PURGE_S = 30.0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: dict[str, int] = {}
        self.next_purge = time.monotonic() + self.PURGE_S

    def claim(self, nonce: str, expires: int) -> bool:
        with self.lock:
            if nonce in self.seen:
                return False
            if len(self.seen) >= self.LIMIT or time.monotonic() >= self.next_purge:
                cutoff = time.time() - CLOCK_SKEW_S
                self.seen = {n: e for n, e in self.seen.items() if e >= cutoff}
                self.next_purge = time.monotonic() + self.PURGE_S
                if len(self.seen) >= self.LIMIT:
                    return False
            self.seen[nonce] = expires
            return True


_SEEN = _Nonces()


def check_signature(
    secret: bytes, kind: str, key: str, entry: JSONObject, *, consume: bool = True
) -> str | None:
    """Why ``entry`` must not be acted on (``None``: it may). With ``consume`` its
    nonce is claimed, so the next check of the same entry is a replay."""
    value = entry.get(SIGNATURE_KEY)
    if value is None:
        return "unsigned"
    match = _SIGNATURE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return "malformed signature"
    expires, nonce, mac = int(match[1]), match[2], match[3]
    try:
        message = _canonical(kind, key, entry, expires, nonce)
    except (orjson.JSONEncodeError, TypeError):
        return "entry cannot be signed (non-JSON values)"
    if not hmac.compare_digest(_mac(secret, message), mac):
        return "bad signature"
    now = time.time()
    if expires < now - CLOCK_SKEW_S:
        return f"signature expired {now - expires:.0f} s ago"
    if expires > now + MAX_LIFETIME_S:
        return "signature expires too far in the future"
    if consume and not _SEEN.claim(nonce, expires):
        return "signature already used (replay)"
    return None


def check_peer(trust: TransferTrust, host: str, port: int) -> str | None:
    """Why ``host:port`` must not be contacted (``None``: it may)."""
    if trust.trusts_nothing:
        return UNTRUSTED
    rules = trust.allowlist
    if rules is None:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if any(rule.allows(host, address, port) for rule in rules):
        return None
    return "peer not in the transfer-peers allowlist"


def check_entry(
    trust: TransferTrust, kind: str, key: str, entry: JSONObject, host: str, port: int
) -> str | None:
    """The consumer's gate before any connection: the allowlist, then (with a secret)
    the signature, whose nonce is claimed only when everything passed."""
    reason = check_peer(trust, host, port)
    if reason is None and trust.secret is not None:
        reason = check_signature(trust.secret, kind, key, entry)
    return reason


def loggable(value: object, limit: int = 64) -> str:
    """A client-supplied value for a log line: printable ASCII, cut to ``limit``."""
    text = value if isinstance(value, str) else repr(value)
    text = "".join(c if " " <= c <= "~" else "?" for c in text[: limit + 1])
    return text if len(text) <= limit else text[:limit] + "..."
