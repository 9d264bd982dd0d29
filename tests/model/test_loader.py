"""load_model / load_processor: parts, devices, dtypes, layouts and load errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ec_frontend.model.loader import (
    ModelLoadError,
    load_model,
    load_processor,
    resolve_device,
    resolve_dtype,
)
from ec_frontend.model.processor import InputProcessor
from ec_frontend.model.qwen2_vl import ComponentNotLoadedError
from safetensors.torch import load_file, save_file
from transformers import Qwen2VLForConditionalGeneration

PROMPT = [505, 82, 386, 198, 56, 339, 431, 258, 220, 263, 75, 79]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def text_logits(model, driver) -> torch.Tensor:
    n = len(PROMPT)
    positions = torch.arange(n).expand(3, n)
    (logits,) = driver(model, block_size=4, num_blocks=16).step(
        [("r", model.embed_tokens(torch.tensor(PROMPT)), positions)]
    )
    return logits


def test_encoder_only_instance(builtin_model_dir, model):
    enc = load_model(builtin_model_dir, device="cpu", load_language=False)
    assert enc.has_vision and not enc.has_language
    pixels, grid = torch.randn(16, 1176), torch.tensor([[1, 4, 4]])
    torch.testing.assert_close(enc.encode_images(pixels, grid), model.encode_images(pixels, grid))
    for call in (
        lambda: enc.embed_tokens(torch.tensor([1])),
        lambda: enc.forward(torch.zeros(1, 64), torch.zeros(3, 1), [], None),
        lambda: enc.compute_logits(torch.zeros(1, 64)),
    ):
        with pytest.raises(ComponentNotLoadedError, match="load_language=False"):
            call()


def test_language_only_instance(builtin_model_dir, model, driver):
    pd = load_model(builtin_model_dir, device="cpu", load_vision=False)
    assert pd.has_language and not pd.has_vision
    with pytest.raises(ComponentNotLoadedError, match="without the vision tower"):
        pd.encode_images(torch.randn(16, 1176), torch.tensor([[1, 4, 4]]))
    torch.testing.assert_close(text_logits(pd, driver), text_logits(model, driver))


def test_model_attributes(model, processor):
    assert model.image_token_id == processor.image_token_id == 516
    assert (model.vocab_size, model.hidden_size) == (576, 64)
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.float32)


def test_bfloat16_on_cpu_tracks_float32(builtin_model_dir, model, driver):
    bf16 = load_model(builtin_model_dir, device="cpu", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.kv_cache_spec().dtype == torch.bfloat16
    assert bf16.language.rotary.inv_freq.dtype == torch.float32
    assert bf16.vision.rotary_pos_emb.inv_freq.dtype == torch.float32
    assert bf16.vision.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    spec = bf16.kv_cache_spec()
    paged = driver(bf16, block_size=4, num_blocks=16)
    paged.kv_caches = [t.to(torch.bfloat16) for t in paged.kv_caches]
    n = len(PROMPT)
    (low,) = paged.step(
        [("r", bf16.embed_tokens(torch.tensor(PROMPT)), torch.arange(n).expand(3, n))]
    )
    high = text_logits(model, driver)
    assert low.dtype == torch.float32 and spec.num_layers == 2
    assert torch.corrcoef(torch.stack([low.flatten(), high.flatten()]))[0, 1] > 0.99


@pytest.mark.parametrize(
    ("value", "device", "expected"),
    [
        (None, "cpu", torch.float32),
        ("auto", "cpu", torch.float32),
        (None, "cuda", torch.bfloat16),
        ("float16", "cpu", torch.float16),
        ("BF16", "cpu", torch.bfloat16),
        (torch.float32, "cuda", torch.float32),
    ],
)
def test_resolve_dtype(value, device, expected):
    assert resolve_dtype(value, torch.device(device)) == expected


@pytest.mark.parametrize("value", ["int8", "float64", torch.float64, "nonsense"])
def test_resolve_dtype_rejects(value):
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        resolve_dtype(value, torch.device("cpu"))


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    default = resolve_device(None)
    assert default.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
    else:
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ModelLoadError, match="invalid device"):
        resolve_device("warp-drive")


def drop_weight(directory: Path) -> None:
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, directory / "model.safetensors")


def wrong_shape(directory: Path) -> None:
    weights = load_file(directory / "model.safetensors")
    weights["visual.blocks.0.attn.qkv.bias"] = torch.zeros(5)
    save_file(weights, directory / "model.safetensors")


@pytest.mark.parametrize(
    ("breakage", "kwargs", "match"),
    [
        (lambda d: (d / "config.json").unlink(), {}, "no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), {}, r"no \*\.safetensors"),
        (lambda d: edit_config(d, model_type="llama"), {}, "unsupported model_type"),
        (lambda d: edit_config(d, hidden_act="gelu"), {}, "unsupported hidden_act"),
        (drop_weight, {}, r"missing \['layers.1.mlp.up_proj.weight'\]"),
        (wrong_shape, {}, "has shape"),
        (lambda d: None, {"dtype": "int4"}, "unsupported dtype"),
    ],
)
def test_load_errors(builtin_model_dir, tmp_path, breakage, kwargs, match):
    directory = copy_checkpoint(builtin_model_dir, tmp_path / "ckpt")
    breakage(directory)
    with pytest.raises(ModelLoadError, match=match):
        load_model(directory, device="cpu", **kwargs)


def test_partial_loads_ignore_the_other_part(builtin_model_dir, tmp_path):
    directory = copy_checkpoint(builtin_model_dir, tmp_path / "ckpt")
    weights = load_file(directory / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if not k.startswith("visual.")},
        directory / "model.safetensors",
    )
    assert not load_model(directory, device="cpu", load_vision=False).has_vision
    with pytest.raises(ModelLoadError, match="vision tower"):
        load_model(directory, device="cpu")


def test_sharded_untied_transformers_v5_layout(builtin_model_dir, tmp_path, driver):
    """A checkpoint in transformers 5 naming, split in two shards, with its own
    lm_head, loads and matches transformers' forward."""
    directory = copy_checkpoint(builtin_model_dir, tmp_path / "v5")
    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    renamed = {}
    for key, tensor in weights.items():
        if key.startswith("visual."):
            renamed["model." + key] = tensor
        else:
            renamed["model.language_model." + key.removeprefix("model.")] = tensor
    gen = torch.Generator().manual_seed(3)
    renamed["lm_head.weight"] = torch.randn(576, 64, generator=gen) * 0.3
    names = sorted(renamed)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: renamed[k] for k in keys}, directory / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    edit_config(directory, tie_word_embeddings=False)

    mine = load_model(directory, device="cpu")
    assert mine.language is not None and mine.language.lm_head is not None
    hf = Qwen2VLForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    assert torch.equal(hf.lm_head.weight, renamed["lm_head.weight"])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(text_logits(mine, driver), ref, atol=1e-4, rtol=0)


def test_load_processor(builtin_model_dir):
    proc = load_processor(builtin_model_dir, model_id="tiny")
    assert isinstance(proc, InputProcessor)
    assert proc.model_id == "tiny"
    assert proc.eos_token_id == proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert proc.max_model_len == 4096
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_processor(builtin_model_dir.parent / "missing")


def test_dummy_load_format_needs_no_weights_and_is_reproducible(
    builtin_model_dir, tmp_path, model, driver
):
    directory = copy_checkpoint(builtin_model_dir, tmp_path / "dummy")
    (directory / "model.safetensors").unlink()
    first = load_model(directory, device="cpu", load_format="dummy")
    second = load_model(directory, device="cpu", load_format="dummy")
    state = torch.get_rng_state()
    logits = text_logits(first, driver)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, text_logits(second, driver), atol=0, rtol=0)
    assert not torch.allclose(logits, text_logits(model, driver), atol=1e-2)
    pixels, grid = torch.randn(16, 1176), torch.tensor([[1, 4, 4]])
    (a,), (b,) = first.encode_images(pixels, grid), second.encode_images(pixels, grid)
    assert torch.isfinite(a).all() and torch.equal(a, b)
    with pytest.raises(ModelLoadError, match="unsupported load_format"):
        load_model(directory, device="cpu", load_format="gguf")
