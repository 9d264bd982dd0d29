"""Engine configuration: frozen dataclasses, validated on construction.

Transfer configs accept vLLM's JSON shapes (``--ec-transfer-config`` and
``--kv-transfer-config``), so a deployment script written for vLLM carries over.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

ECRole = Literal["ec_producer", "ec_consumer", "ec_both"]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]

_EC_ROLES: tuple[str, ...] = ("ec_producer", "ec_consumer", "ec_both")
_KV_ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")


class ConfigError(ValueError):
    """An engine configuration that cannot work; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


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


@dataclass(frozen=True)
class ECTransferConfig:
    """Where encoder outputs move to or from (``--ec-transfer-config``)."""

    ec_connector: str
    ec_role: ECRole
    ec_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.ec_connector, str) or not self.ec_connector:
            raise ConfigError("ec_connector must be a non-empty string", "ec_connector")
        if self.ec_role not in _EC_ROLES:
            raise ConfigError(f"ec_role must be one of {', '.join(_EC_ROLES)}", "ec_role")
        extra = _frozen_mapping(self.ec_connector_extra_config, "ec_connector_extra_config")
        object.__setattr__(self, "ec_connector_extra_config", extra)

    @classmethod
    def from_json(cls, value: str | Mapping[str, Any]) -> ECTransferConfig:
        data = _load_json_object(value, "ec_transfer_config")
        _reject_unknown(
            data, {"ec_connector", "ec_role", "ec_connector_extra_config"}, "ec_transfer_config"
        )
        return cls(
            ec_connector=_require_str(data, "ec_connector"),
            ec_role=_require_str(data, "ec_role"),  # type: ignore[arg-type]
            ec_connector_extra_config=data.get("ec_connector_extra_config") or {},
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

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ConfigError("kv_connector must be a non-empty string", "kv_connector")
        if self.kv_role not in _KV_ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(_KV_ROLES)}", "kv_role")
        extra = _frozen_mapping(self.kv_connector_extra_config, "kv_connector_extra_config")
        object.__setattr__(self, "kv_connector_extra_config", extra)

    @classmethod
    def from_json(cls, value: str | Mapping[str, Any]) -> KVTransferConfig:
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

    def __post_init__(self) -> None:
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


@dataclass(frozen=True)
class CacheConfig:
    """KV and encoder cache sizes.

    The KV block count is ``num_kv_blocks`` when given, else the memory budget
    ``kv_cache_memory_bytes`` divided by the model's bytes per block.
    ``encoder_cache_size`` counts encoder output rows (placeholder tokens).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    num_kv_blocks: int | None = None
    encoder_cache_size: int = 16384

    def __post_init__(self) -> None:
        _positive(self.block_size, "block_size")
        _positive(self.kv_cache_memory_bytes, "kv_cache_memory_bytes")
        if self.num_kv_blocks is not None:
            _positive(self.num_kv_blocks, "num_kv_blocks")
        _positive(self.encoder_cache_size, "encoder_cache_size")


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

    def __post_init__(self) -> None:
        if self.is_encoder_only and not self.load_vision:
            raise ConfigError("an encoder-only instance needs the vision tower", "load_vision")
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
