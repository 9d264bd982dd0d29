"""Engine configs: vLLM-style transfer JSON, frozen dataclasses, clear errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from ec_frontend.config import (
    CacheConfig,
    ConfigError,
    ECTransferConfig,
    EngineConfig,
    KVTransferConfig,
    SchedulerConfig,
)


@pytest.mark.parametrize(
    ("role", "producer", "consumer", "encoder_only"),
    [
        ("ec_producer", True, False, True),
        ("ec_consumer", False, True, False),
        ("ec_both", True, True, False),
    ],
)
def test_ec_roles(role: str, producer: bool, consumer: bool, encoder_only: bool) -> None:
    text = (
        '{"ec_connector": "ECExampleConnector", "ec_role": "ROLE",'
        ' "ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}}'
    )
    cfg = ECTransferConfig.from_json(text.replace("ROLE", role))
    assert (cfg.is_producer, cfg.is_consumer) == (producer, consumer)
    assert cfg.ec_connector_extra_config["shared_storage_path"] == "/tmp/ec"
    assert EngineConfig(ec_transfer=cfg).is_encoder_only == encoder_only
    with pytest.raises(TypeError):
        cfg.ec_connector_extra_config["x"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ec_role = "ec_both"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ("{", "ec_transfer_config"),
        ("[]", "ec_transfer_config"),
        ('{"ec_role": "ec_producer"}', "ec_connector"),
        ('{"ec_connector": "X", "ec_role": "producer"}', "ec_role"),
        ('{"ec_connector": "X", "ec_role": "ec_both", "ec_connector_extra_config": 3}',
         "ec_connector_extra_config"),
        ('{"ec_connector": "X", "ec_role": "ec_both", "typo": 1}', "typo"),
    ],
)  # fmt: skip
def test_ec_config_errors(text: str, param: str) -> None:
    with pytest.raises(ConfigError) as info:
        ECTransferConfig.from_json(text)
    assert info.value.param == param


def test_kv_config() -> None:
    cfg = KVTransferConfig.from_json(
        {"kv_connector": "NoOpKVConnector", "kv_role": "kv_consumer", "engine_id": "e1"}
    )
    assert cfg.is_consumer and not cfg.is_producer and cfg.engine_id == "e1"
    with pytest.raises(ConfigError, match="kv_role"):
        KVTransferConfig.from_json({"kv_connector": "X", "kv_role": "ec_producer"})


@pytest.mark.parametrize(
    ("build", "param"),
    [
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=8,
                                 max_model_len=16), "max_num_batched_tokens"),
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: EngineConfig(dtype="int8"), "dtype"),
        (lambda: EngineConfig(cache=CacheConfig(encoder_cache_size=10)), "encoder_cache_size"),
        (lambda: EngineConfig(load_vision=False, ec_transfer=ECTransferConfig("X", "ec_producer")),
         "load_vision"),
    ],
)  # fmt: skip
def test_config_errors(build: Any, param: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.param == param
