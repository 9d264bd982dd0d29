"""Settings every layer shares: frozen dataclasses, validated on construction.

The lowest floor of the package with :mod:`ec_frontend.errors`: the engine, the
connectors and the model read their settings here and import nothing above.

Transfer configs accept vLLM's JSON shapes (``--ec-transfer-config`` and
``--kv-transfer-config``), so a deployment script written for vLLM carries over.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from ec_frontend.errors import ConfigError

ECRole = Literal["ec_producer", "ec_consumer", "ec_both"]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]

_EC_ROLES: tuple[str, ...] = ("ec_producer", "ec_consumer", "ec_both")
_KV_ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")


def _frozen_mapping(value: Mapping[str, Any] | None, param: str) -> Mapping[str, Any]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{param} must be a JSON object", param)
    return MappingProxyType(dict(value))


def _load_json_object(value: str | Mapping[str, Any], what: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON: {exc.msg}", what) from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{what} must be a JSON object", what)
    return parsed


def _require_str(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string", key)
    return value


def _reject_unknown(data: Mapping[str, Any], known: set[str], what: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) in {what}: {', '.join(unknown)}", unknown[0])


#: Environment variable holding the deployment's transfer secret.
TRANSFER_SECRET_ENV = "EC_FRONTEND_TRANSFER_SECRET"
MIN_SECRET_BYTES = 16

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class PeerRule:
    """One allowlist entry: an IP network or an exact host name, and a port range."""

    network: _Network | None
    name: str | None
    low_port: int
    high_port: int

    def allows(
        self, host: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address | None, port: int
    ) -> bool:
        if not self.low_port <= port <= self.high_port:
            return False
        if self.network is not None:
            return (
                address is not None
                and address.version == self.network.version
                and (address in self.network)
            )
        return address is None and host.lower() == self.name


def _port_range(text: str, entry: str) -> tuple[int, int]:
    if text in ("", "*"):
        return 1, 65535
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high) if sep else int(low)
    except ValueError:
        lo, hi = 0, -1
    if not 0 < lo <= hi < 65536:
        raise ConfigError(f"transfer peer {entry!r}: bad port or port range", "transfer_peers")
    return lo, hi


def parse_transfer_peers(spec: str) -> tuple[PeerRule, ...]:
    """Rules from a comma-separated list of ``HOST[:PORTS]``.

    ``HOST`` is an IPv4 address or network (``10.0.0.0/8``), an IPv6 one in
    brackets (``[fd00::/8]``), or an exact host name (matched as written, never
    resolved). ``PORTS`` is ``N``, ``N-M`` or ``*`` (also when omitted: any).
    """
    rules: list[PeerRule] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry.startswith("["):
            host, sep, rest = entry[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ConfigError(f"transfer peer {entry!r}: unclosed [", "transfer_peers")
            ports = rest[1:]
        else:
            host, _, ports = entry.partition(":")
        low, high = _port_range(ports, entry)
        try:
            network: _Network | None = ipaddress.ip_network(host, strict=False)
        except ValueError:
            network = None
        name = None
        if network is None:
            if not host or any(c in host for c in "/[] ") or len(host) > 253:
                raise ConfigError(f"transfer peer {entry!r}: bad host", "transfer_peers")
            name = host.lower()
        rules.append(PeerRule(network, name, low, high))
    if not rules:
        raise ConfigError("--transfer-peers names no peer", "transfer_peers")
    return tuple(rules)


@dataclass(frozen=True)
class TransferTrust:
    """Which transfer params an instance acts on (DESIGN 4.3, ``docs/security.md``).

    ``secret``: the deployment's shared key; producers sign the params they
    emit, consumers act only on params with a valid, unexpired, unused
    signature, and side-channel connections authenticate with it. ``peers``:
    the peers the operator named (``--transfer-peers``); a consumer contacts
    only those. With neither, nothing is trusted: transfer params a consumer is
    given are ignored (DESIGN 4.3: a client never chooses the sockets an
    instance opens). ``max_entries`` bounds the entries of one request's params
    that are looked at.
    """

    secret: bytes | None = field(default=None, repr=False)
    peers: tuple[PeerRule, ...] | None = None
    max_entries: int = 64

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"the transfer secret must be at least {MIN_SECRET_BYTES} bytes", "transfer_secret"
            )
        _positive(self.max_entries, "max_entries")

    @property
    def trusts_nothing(self) -> bool:
        """Neither a secret nor named peers: every transfer param is ignored."""
        return self.secret is None and self.peers is None

    @property
    def allowlist(self) -> tuple[PeerRule, ...] | None:
        """The rules every peer must pass (``None``: no address rule applies, the
        signature decides; empty: no peer passes)."""
        if self.trusts_nothing:
            return ()
        return self.peers

    @classmethod
    def from_options(
        cls,
        secret: str | None = None,
        secret_file: str | None = None,
        peers: str | None = None,
    ) -> TransferTrust:
        """From the ``--transfer-secret`` / ``--transfer-secret-file`` / ``--transfer-peers``
        flags, the secret falling back to ``$EC_FRONTEND_TRANSFER_SECRET``."""
        if secret and secret_file:
            raise ConfigError(
                "give --transfer-secret or --transfer-secret-file, not both", "transfer_secret"
            )
        value: bytes | None = secret.encode() if secret else None
        if secret_file:
            try:
                with open(secret_file, "rb") as f:
                    value = f.read(4096).strip()
            except OSError as exc:
                raise ConfigError(
                    f"cannot read --transfer-secret-file: {exc.strerror}", "transfer_secret_file"
                ) from None
        if value is None and os.environ.get(TRANSFER_SECRET_ENV):
            value = os.environ[TRANSFER_SECRET_ENV].encode()
        rules = parse_transfer_peers(peers) if peers else None
        return cls(secret=value or None, peers=rules)


@dataclass(frozen=True)
class ECTransferConfig:
    """Where encoder outputs move to or from (``--ec-transfer-config``)."""

    ec_connector: str
    ec_role: ECRole
    ec_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    trust: TransferTrust = field(default_factory=TransferTrust)

    def __post_init__(self) -> None:
        if not isinstance(self.ec_connector, str) or not self.ec_connector:
            raise ConfigError("ec_connector must be a non-empty string", "ec_connector")
        if self.ec_role not in _EC_ROLES:
            raise ConfigError(f"ec_role must be one of {', '.join(_EC_ROLES)}", "ec_role")
        extra = _frozen_mapping(self.ec_connector_extra_config, "ec_connector_extra_config")
        object.__setattr__(self, "ec_connector_extra_config", extra)

    @classmethod
    def from_json(
        cls, value: str | Mapping[str, Any], trust: TransferTrust | None = None
    ) -> ECTransferConfig:
        data = _load_json_object(value, "ec_transfer_config")
        _reject_unknown(
            data, {"ec_connector", "ec_role", "ec_connector_extra_config"}, "ec_transfer_config"
        )
        return cls(
            ec_connector=_require_str(data, "ec_connector"),
            ec_role=_require_str(data, "ec_role"),  # type: ignore[arg-type]
            ec_connector_extra_config=data.get("ec_connector_extra_config") or {},
            trust=trust or TransferTrust(),
        )

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Where KV moves to or from (``--kv-transfer-config``)."""

    kv_connector: str
    kv_role: KVRole
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    engine_id: str | None = None
    trust: TransferTrust = field(default_factory=TransferTrust)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ConfigError("kv_connector must be a non-empty string", "kv_connector")
        if self.kv_role not in _KV_ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(_KV_ROLES)}", "kv_role")
        extra = _frozen_mapping(self.kv_connector_extra_config, "kv_connector_extra_config")
        object.__setattr__(self, "kv_connector_extra_config", extra)

    @classmethod
    def from_json(
        cls, value: str | Mapping[str, Any], trust: TransferTrust | None = None
    ) -> KVTransferConfig:
        data = _load_json_object(value, "kv_transfer_config")
        _reject_unknown(
            data,
            {"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id"},
            "kv_transfer_config",
        )
        engine_id = data.get("engine_id")
        if engine_id is not None and not isinstance(engine_id, str):
            raise ConfigError("engine_id must be a string", "engine_id")
        return cls(
            kv_connector=_require_str(data, "kv_connector"),
            kv_role=_require_str(data, "kv_role"),  # type: ignore[arg-type]
            kv_connector_extra_config=data.get("kv_connector_extra_config") or {},
            engine_id=engine_id,
            trust=trust or TransferTrust(),
        )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def _positive(value: int, param: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{param} must be a positive integer", param)


#: Seconds to validate or build one structured-output grammar
#: (``--structured-outputs-compile-timeout``).
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0
#: Bytes of one compiled structured-output grammar
#: (``--structured-outputs-max-grammar-bytes``): 1 MiB, about 45,000 short choices,
#: whose matcher builds in about 3 s.
DEFAULT_MAX_GRAMMAR_BYTES = 1 << 20


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of one engine step.

    ``encoder_compute_budget`` bounds the encoder output rows (placeholder tokens)
    computed per step; ``None`` means ``max_num_batched_tokens``. With
    ``enable_chunked_prefill`` a long prompt is computed over several steps.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    encoder_compute_budget: int | None = None
    #: Seconds a constrained request waits aside for its grammar's build before it
    #: fails (``--structured-outputs-compile-timeout``).
    grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.grammar_compile_timeout_s > 0:
            raise ConfigError(
                f"grammar_compile_timeout_s must be > 0, not {self.grammar_compile_timeout_s}",
                "grammar_compile_timeout_s",
            )
        _positive(self.max_num_seqs, "max_num_seqs")
        _positive(self.max_num_batched_tokens, "max_num_batched_tokens")
        _positive(self.max_model_len, "max_model_len")
        if self.encoder_compute_budget is not None:
            _positive(self.encoder_compute_budget, "encoder_compute_budget")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len",
                "max_num_batched_tokens",
            )

    @property
    def encoder_budget(self) -> int:
        return self.encoder_compute_budget or self.max_num_batched_tokens


#: KV cache bytes on the CPU when ``--kv-cache-memory`` is not given (raised to
#: one ``max_model_len`` sequence when that needs more).
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
#: Attention paths over the paged KV cache (``--attention-backend``; ``auto`` picks).
ATTENTION_BACKENDS = ("sdpa", "gather", "triton")
#: Why ``--attention-backend triton`` cannot run where it was asked for.
TRITON_BACKEND_NEEDS = (
    "--attention-backend triton needs Triton and a CUDA device "
    "(or Triton's interpreter: TRITON_INTERPRET=1)"
)
#: Block sizes the paged attention accepts (``--block-size``).
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class CacheConfig:
    """KV and encoder cache sizes.

    The KV block count is ``num_kv_blocks`` when given; else, when
    ``kv_cache_memory_bytes`` is given, that budget divided by the model's bytes
    per block; else, on CUDA, ``gpu_memory_utilization`` of the device's memory
    minus what the model and a profile run hold, and on the CPU
    :data:`DEFAULT_CPU_KV_CACHE_BYTES` (at least one ``max_model_len`` sequence).
    ``encoder_cache_size`` counts encoder output rows (placeholder tokens).
    On CUDA, decode-only steps replay CUDA graphs captured at startup for padded
    batch sizes up to ``max_num_seqs`` when the attention backend allows it
    (``triton``); ``enforce_eager`` turns that off.
    ``enable_prefix_caching`` shares full KV blocks between requests by content
    (``engine/kv_cache.py``).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    encoder_cache_size: int = 16384
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _positive(self.block_size, "block_size")
        if self.kv_cache_memory_bytes is not None:
            _positive(self.kv_cache_memory_bytes, "kv_cache_memory_bytes")
        if self.num_kv_blocks is not None:
            _positive(self.num_kv_blocks, "num_kv_blocks")
        _positive(self.encoder_cache_size, "encoder_cache_size")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {util!r}", "gpu_memory_utilization"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs to start.

    ``model`` is a local checkpoint directory (``None``: the built-in model).
    ``model_id`` names the model (it enters every ``mm_hash``, so instances of
    one deployment must agree); empty: the built-in model's id, or the
    checkpoint directory's name.
    ``device`` is ``None`` for CUDA when available, else CPU. ``load_vision``
    False skips the vision tower on a consumer that always loads encoder outputs
    (then an item that cannot be loaded fails its request).
    """

    model: str | None = None
    model_id: str = ""
    device: str | None = None
    dtype: str = "float32"
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    ec_transfer: ECTransferConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    load_vision: bool = True
    #: ``auto`` / ``safetensors``: the checkpoint's weights; ``dummy``: random weights.
    load_format: str = "auto"
    #: ``auto``, or one of :data:`ATTENTION_BACKENDS` (see ``model/paged_attention.py``).
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.is_encoder_only and not self.load_vision:
            raise ConfigError("an encoder-only instance needs the vision tower", "load_vision")
        if self.attention_backend not in ("auto", *ATTENTION_BACKENDS):
            raise ConfigError(
                f"attention_backend must be auto or one of {', '.join(ATTENTION_BACKENDS)}",
                "attention_backend",
            )
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError("dtype must be float32, float16 or bfloat16", "dtype")
        if self.cache.encoder_cache_size < self.scheduler.encoder_budget:
            # A single item the size of the budget must fit in the cache.
            raise ConfigError(
                "encoder_cache_size must be >= the encoder compute budget", "encoder_cache_size"
            )

    @property
    def is_encoder_only(self) -> bool:
        """An EC producer that is not a consumer: encodes media, never runs the LM."""
        ec = self.ec_transfer
        return ec is not None and ec.is_producer and not ec.is_consumer
