"""KV cache sizing: ``--kv-cache-memory`` on the CPU, the CUDA path (profile run, then
``torch.cuda.mem_get_info``) with the device queries replaced, startup errors that
name the flag, and a server whose cache holds exactly one ``max_model_len`` sequence."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from ec_frontend.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
)
from ec_frontend.engine import kv_cache
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.kv_cache import cdiv, plan_kv_cache
from ec_frontend.model.interface import VisionLanguageModel

from ..helpers.processes import Proc

GIB = 2**30


def _config(max_len: int = 1024, batched: int = 256, **cache: Any) -> EngineConfig:
    return EngineConfig(
        device="cpu",
        scheduler=SchedulerConfig(max_model_len=max_len, max_num_batched_tokens=batched),
        cache=CacheConfig(**cache),
    )


def _per_block(vlm: VisionLanguageModel, block_size: int) -> int:
    return vlm.kv_cache_spec().bytes_per_block(block_size)


@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_cache_memory_gives_the_computed_blocks(
    vlm: VisionLanguageModel, block_size: int
) -> None:
    per_block = _per_block(vlm, block_size)
    budget = 300 * per_block + per_block // 2
    core = EngineCore(_config(block_size=block_size, kv_cache_memory_bytes=budget), vlm)
    assert core.kv_cache is not None and core.kv_cache.num_blocks == 300
    assert core.kv_cache.block_size == block_size
    for layer in core.runner.kv_caches:
        assert tuple(layer.shape[:3]) == (2, 300, block_size)


def test_cpu_default_is_256_mib_or_one_sequence(vlm: VisionLanguageModel) -> None:
    per_block = _per_block(vlm, 16)
    plan = plan_kv_cache(vlm, _config(max_len=1024))
    assert plan.num_blocks == DEFAULT_CPU_KV_CACHE_BYTES // per_block
    assert plan.flag == "--kv-cache-memory"


def test_too_small_a_cache_names_the_flag(vlm: VisionLanguageModel) -> None:
    per_block = _per_block(vlm, 16)
    needed = cdiv(1024, 16) + 1
    plan_kv_cache(vlm, _config(kv_cache_memory_bytes=needed * per_block))
    with pytest.raises(ConfigError, match="--kv-cache-memory") as info:
        plan_kv_cache(vlm, _config(kv_cache_memory_bytes=needed * per_block - 1))
    assert info.value.param == "kv_cache_memory"
    assert f"needs at least {needed}" in str(info.value)


class _FakeCuda:
    """Stands in for the CUDA memory queries: ``used`` bytes are taken when the
    profile is done (what the weights and the profile's activations hold)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, total: int, used: int) -> None:
        self.total, self.used = total, used
        self.queried: list[Any] = []
        monkeypatch.setattr(kv_cache, "on_cuda", lambda device: True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: used)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: used)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self.queried.append(device)
        return self.total - self.used, self.total


class _Recording:
    """Wraps a model and records the token counts of its forwards and the encoder rows."""

    def __init__(self, model: VisionLanguageModel) -> None:
        self._model = model
        self.forward_tokens: list[int] = []
        self.encoder_rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, embeds: torch.Tensor, *args: Any) -> torch.Tensor:
        self.forward_tokens.append(embeds.shape[0])
        return self._model.forward(embeds, *args)

    def encode_images(self, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        out = self._model.encode_images(pixels, grid)
        self.encoder_rows.append(sum(o.shape[0] for o in out))
        return out


def test_cuda_path_profiles_then_sizes_from_mem_get_info(
    vlm: VisionLanguageModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    total, used = 4 * GIB, GIB + 12345
    fake = _FakeCuda(monkeypatch, total, used)
    model = _Recording(vlm)
    config = _config(batched=512, gpu_memory_utilization=0.5)
    plan = plan_kv_cache(model, config)  # type: ignore[arg-type]
    assert model.forward_tokens == [512], "one profile forward at max_num_batched_tokens"
    assert len(model.encoder_rows) == 1 and 0 < model.encoder_rows[0] <= 512
    assert fake.queried == [vlm.device]
    expected = (int(0.5 * total) - used) // _per_block(vlm, 16)
    assert plan.num_blocks == expected and plan.flag == "--gpu-memory-utilization"


def test_cuda_path_too_little_memory_names_the_flag(
    vlm: VisionLanguageModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    _FakeCuda(monkeypatch, total=4 * GIB, used=int(3.5 * GIB))
    with pytest.raises(ConfigError, match="--gpu-memory-utilization") as info:
        plan_kv_cache(vlm, _config(gpu_memory_utilization=0.8))
    assert info.value.param == "gpu_memory_utilization"


def test_explicit_kv_cache_memory_wins_on_cuda(
    vlm: VisionLanguageModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeCuda(monkeypatch, total=4 * GIB, used=GIB)
    per_block = _per_block(vlm, 16)
    plan = plan_kv_cache(vlm, _config(kv_cache_memory_bytes=100 * per_block))
    assert plan.num_blocks == 100 and fake.queried == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--block-size", "7"], "--block-size must be one of 8, 16, 32"),
        (["--kv-cache-memory", "100000"], "raise --kv-cache-memory or lower --max-model-len"),
        (["--kv-cache-memory", "-1"], "--kv-cache-memory must be > 0"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be > 0"),
        (["--max-model-len", "999999"], "exceeds the model's"),
        (["--attention-backend", "triton"], "--attention-backend triton needs Triton and a CUDA"),
    ],
)
def test_bad_sizing_flags_exit_cleanly(
    builtin_model_dir: Path, flags: list[str], message: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--device", "cpu",
         "--model", str(builtin_model_dir), "--port", "1", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_server_with_a_cache_of_one_sequence(builtin_model_dir: Path, vlm: Any) -> None:
    """The cache holds exactly one ``max_model_len`` sequence: a request of that whole
    length is served, one token more is a 400 naming ``max_tokens``."""
    max_len, per_block = 256, _per_block(vlm, 16)
    blocks = cdiv(max_len, 16) + 1
    server = Proc(
        "serve",
        ["--model", str(builtin_model_dir), "--device", "cpu", "--max-model-len", str(max_len),
         "--kv-cache-memory", str(blocks * per_block + per_block - 1), "--log-level", "info"],
        "server",
    )  # fmt: skip
    try:
        server.wait_ready()
        logged = re.search(r"KV cache: (\d+) blocks of 16 tokens", server.output())
        assert logged is not None and int(logged.group(1)) == blocks
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        prompt = list(range(10, 210))
        r = client.completions.create(
            model=str(builtin_model_dir),
            prompt=prompt,
            max_tokens=max_len - len(prompt),
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None and r.usage.completion_tokens == max_len - len(prompt)
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model=str(builtin_model_dir), prompt=prompt, max_tokens=max_len - len(prompt) + 1
            )
        assert "max_tokens" in str(info.value)
        assert info.value.body is not None and info.value.body.get("param") == "max_tokens"
        client.close()
    finally:
        assert server.stop() == 0
