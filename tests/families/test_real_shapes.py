"""Real model shapes with ``--load-format dummy`` in bf16 on the CPU.

The configs are the published ``config.json`` values of Qwen2-VL-2B-Instruct,
Qwen2.5-VL-3B-Instruct and Qwen3-VL-2B-Instruct. With random weights from the
config alone, the server starts and serves a short greedy request, and one forward
(text and an image) gives the logits of ``transformers``' model holding the same
tensors, within bf16 tolerance. The tokenizer and image processor are the built-in model's (their
vocabulary fits in the real one); the prompts are built from the config's own
special-token ids.
"""

from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ec_frontend.model.builtin import ensure_builtin_checkpoint
from ec_frontend.model.interface import AttentionMetadata
from ec_frontend.model.loader import load_model, parameters_on_meta
from ec_frontend.model.mrope import mrope_positions
from transformers import (
    AutoConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from ..helpers import processes
from ..helpers.processes import Proc

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # 5-14 GiB resident: alone on the machine

QWEN_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
             "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
             "video_token_id": 151656}  # fmt: skip

QWEN2_VL_2B: dict[str, Any] = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
    **QWEN_IDS, "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 1536,
    "initializer_range": 0.02, "intermediate_size": 8960, "max_position_embeddings": 32768,
    "max_window_layers": 28, "num_attention_heads": 12, "num_hidden_layers": 28,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                      "in_chans": 3, "hidden_size": 1536, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
}  # fmt: skip

QWEN2_5_VL_3B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    **QWEN_IDS, "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                      "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                      "temporal_patch_size": 2},
}  # fmt: skip

QWEN3_VL_2B: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": True,
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 5000000,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                         "rope_type": "default"},
        "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936},
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02,
        "intermediate_size": 4096, "model_type": "qwen3_vl", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2},
}  # fmt: skip

MODELS = {
    "Qwen2-VL-2B": (QWEN2_VL_2B, Qwen2VLForConditionalGeneration),
    "Qwen2.5-VL-3B": (QWEN2_5_VL_3B, Qwen2_5_VLForConditionalGeneration),
    "Qwen3-VL-2B": (QWEN3_VL_2B, Qwen3VLForConditionalGeneration),
}


def checkpoint(root: Path, name: str) -> Path:
    """A directory with the real ``config.json`` and no weights (made once)."""
    directory = root / name
    if directory.exists():
        return directory
    shutil.copytree(ensure_builtin_checkpoint(root / "builtin"), directory)
    (directory / "model.safetensors").unlink()
    (directory / "config.json").write_text(json.dumps(MODELS[name][0]))
    return directory


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("real-shapes")


@pytest.mark.parametrize("name", MODELS)
def test_server_starts_and_serves_a_greedy_request(
    root: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Filling billions of dummy weights on a shared 2-core host can outlast the
    # default wait for /health.
    monkeypatch.setattr(processes, "STARTUP_TIMEOUT_S", 600.0)
    directory = checkpoint(root, name)
    args = ["--model", str(directory), "--load-format", "dummy", "--dtype", "bfloat16",
            "--device", "cpu", "--max-model-len", "256", "--max-num-batched-tokens", "256",
            "--kv-cache-memory", str(64 * 2**20)]  # fmt: skip
    proc = Proc("serve", args, name)
    try:
        proc.wait_ready()
        body = {"model": proc_model(proc), "prompt": "hello there", "max_tokens": 3,
                "temperature": 0}  # fmt: skip
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert (
            out["usage"]["completion_tokens"] == 3 or out["choices"][0]["finish_reason"] == "stop"
        )
    finally:
        proc.stop()


def proc_model(proc: Proc) -> str:
    return httpx.get(proc.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def transformers_twin(config_dir: Path, cls: type, ours: Any) -> Any:
    """``cls`` built on the meta device, then holding our model's very tensors."""
    config = AutoConfig.from_pretrained(config_dir)
    with parameters_on_meta():
        hf = cls._from_config(config, dtype=torch.bfloat16)
    state = {f"model.visual.{k}": v for k, v in ours.vision.state_dict().items()}
    state |= {f"model.language_model.{k}": v for k, v in ours.language.state_dict().items()}
    state["lm_head.weight"] = ours.language.embed_tokens.weight
    hf.load_state_dict(state, strict=False, assign=True)
    leftover = [n for n, p in hf.named_parameters() if p.device.type == "meta"]
    assert not leftover, leftover
    return hf.eval()


def prefill_logits(model: Any, ids: list[int], pixels: torch.Tensor, grid: list[int]) -> Any:
    image = QWEN_IDS["image_token_id"]
    offset = ids.index(image)
    length = ids.count(image)
    embeds = model.embed_tokens(torch.tensor(ids))
    (encoded,) = model.encode_images(pixels, torch.tensor([grid]))
    embeds[offset : offset + length] = encoded
    positions, _ = mrope_positions(len(ids), [(offset, length, tuple(grid))], 2)
    spec = model.kv_cache_spec()
    block = 16
    blocks = (len(ids) + block - 1) // block
    kv = [torch.zeros(2, blocks, block, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype)
          for _ in range(spec.num_layers)]  # fmt: skip
    n = len(ids)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        query_lens=torch.tensor([n]),
        block_tables=torch.arange(blocks)[None],
        slot_mapping=torch.arange(n),
        block_size=block,
        seq_lens_cpu=[n],
        query_lens_cpu=[n],
    )
    return model.compute_logits(model.forward(embeds, positions, kv, meta))


@pytest.mark.parametrize("name", MODELS)
def test_forward_logits_equal_transformers_on_the_same_dummy_weights(root: Path, name: str):
    directory = checkpoint(root, name)
    ours = load_model(directory, device="cpu", dtype="bfloat16", load_format="dummy")
    hf = transformers_twin(directory, MODELS[name][1], ours)
    grid = [1, 4, 6]  # 24 patches -> 6 image tokens
    gen = torch.Generator().manual_seed(0)
    patch = MODELS[name][0]["vision_config"]["patch_size"]
    pixels = torch.randn(24, 3 * 2 * patch * patch, generator=gen)
    ids = [QWEN_IDS["bos_token_id"], 300, 301, QWEN_IDS["vision_start_token_id"]]
    ids += [QWEN_IDS["image_token_id"]] * 6 + [QWEN_IDS["vision_end_token_id"]]
    ids += [400, 17, 250, 99, 5, 123]
    mine = prefill_logits(ours, ids, pixels, grid)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        ref = (
            hf(
                input_ids=input_ids,
                pixel_values=pixels.to(torch.bfloat16),
                image_grid_thw=torch.tensor([grid]),
                mm_token_type_ids=(input_ids == QWEN_IDS["image_token_id"]).int(),
            )
            .logits[0]
            .float()
        )
    assert len(set(ref.argmax(-1).tolist())) > 1 and float(ref.std()) > 0.1
    scale = float(ref.abs().max())
    err = float((mine - ref).abs().max())
    print(f"{name}: max |logit diff| {err:.4f}, max |logit| {scale:.3f}")
    assert err <= 0.05 * scale, (err, scale)
    agree = (mine.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.9, agree
    del ours, hf
    gc.collect()
