"""Loading at real sizes and from real places: peak host memory while streaming a
~1 GB bf16 checkpoint, Hugging Face ids through the local cache, and the startup
errors of checkpoints the server cannot serve (no traceback, a clear line)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ec_frontend.model.loader import ModelLoadError, load_model, resolve_model_path
from safetensors.torch import save_file

from ..helpers.processes import Proc, free_port

#: A Qwen2-VL shape whose bf16 weights take ~0.97 GB, in 11 decoder layers of ~80 MB
#: and a small vision tower (the largest single tensor is ~23 MB).
SCALE_TEXT = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 11,
              "num_attention_heads": 16, "num_key_value_heads": 2}  # fmt: skip


def write_scaled_checkpoint(builtin_dir: Path, directory: Path) -> int:
    """The built-in checkpoint's files with a bigger language model, random bf16 weights
    in two shards; returns the weights' bytes."""
    shutil.copytree(builtin_dir, directory)
    (directory / "model.safetensors").unlink()
    config = json.loads((directory / "config.json").read_text())
    config.update(SCALE_TEXT, tie_word_embeddings=False, torch_dtype="bfloat16")
    config["vision_config"]["hidden_size"] = SCALE_TEXT["hidden_size"]
    config["rope_scaling"]["mrope_section"] = [16, 24, 24]
    (directory / "config.json").write_text(json.dumps(config))
    model = load_model(directory, device="cpu", dtype="bfloat16", load_format="dummy")
    assert model.vision is not None and model.language is not None
    tensors = {f"visual.{k}": v for k, v in model.vision.state_dict().items()}
    tensors |= {
        ("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v
        for k, v in model.language.state_dict().items()
    }
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(directory / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(t.numel() * t.element_size() for t in tensors.values())


MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch
    from ec_frontend.model.loader import load_model

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    before = status("VmRSS:")
    model = load_model(sys.argv[1], device="cpu", dtype="bfloat16")
    params = [p for part in (model.vision, model.language) for p in part.parameters()]
    # Read every weight, so those still mapped from the files are resident too.
    checksum = sum(float(p.detach().sum()) for p in params)
    rss, peak = status("VmRSS:"), status("VmHWM:")
    held = sum(p.numel() * p.element_size() for p in params)
    print(json.dumps({"before": before, "rss": rss, "peak": peak, "held": held,
                      "finite": checksum == checksum}))
    """
)


@pytest.mark.slow
def test_peak_rss_while_loading_a_1gb_bf16_checkpoint(builtin_model_dir, tmp_path):
    """Loading (in a fresh process, after its imports) and reading every weight raises
    peak RSS by at most 1.3x the checkpoint's bytes: no all-shards dict, no fp32 copy,
    no init."""
    size = write_scaled_checkpoint(builtin_model_dir, tmp_path / "ckpt")
    assert 0.9e9 < size < 1.1e9
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["held"] == size
    assert figures["finite"]
    # The weights are resident once read: a load that kept them only mapped would not
    # show its memory, one that copied them would show it twice.
    assert figures["rss"] - figures["before"] >= 0.9 * size, figures
    growth = figures["peak"] - figures["before"]
    assert growth <= 1.3 * size, figures


def make_hub_cache(builtin_dir: Path, root: Path, repo: str) -> Path:
    """``root`` laid out as a Hugging Face hub cache holding ``repo`` at one revision."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(builtin_dir, repo_dir / "snapshots" / revision)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    return repo_dir / "snapshots" / revision


def test_hugging_face_id_resolves_through_the_local_cache(builtin_model_dir, tmp_path, monkeypatch):
    snapshot = make_hub_cache(builtin_model_dir, tmp_path / "hub", "acme/tiny-vl")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("acme/tiny-vl") == snapshot
    assert resolve_model_path(str(builtin_model_dir)) == builtin_model_dir
    with pytest.raises(ModelLoadError, match=r"not in the local Hugging Face cache.*hf download"):
        resolve_model_path("acme/absent")
    for bad in ("a/b/c", "../x", "no-such-dir"):
        with pytest.raises(ModelLoadError, match="neither a checkpoint directory"):
            resolve_model_path(bad)


@pytest.mark.slow
def test_server_serves_a_hugging_face_id_offline(builtin_model_dir, tmp_path):
    make_hub_cache(builtin_model_dir, tmp_path / "hub", "acme/tiny-vl")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = Proc("serve", ["--model", "acme/tiny-vl", "--device", "cpu"], "hub", env=env)
    try:
        proc.wait_ready()
        import httpx

        models = httpx.get(proc.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["acme/tiny-vl"]
        body = {"model": "acme/tiny-vl", "prompt": "hello", "max_tokens": 3, "temperature": 0}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.stop()


def _edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (
            lambda d: _edit_config(d, model_type="gemma3", architectures=["Gemma3ForCausalLM"]),
            "unsupported model_type 'gemma3' (architectures ['Gemma3ForCausalLM']); "
            "supported: qwen2_vl (Qwen2-VL), qwen2_5_vl (Qwen2.5-VL), llava (LLaVA-1.5), "
            "qwen3_vl (Qwen3-VL), llava_next (LLaVA-NeXT), llava_onevision (LLaVA-OneVision)",
        ),
        (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer"),
        (lambda d: (d / "preprocessor_config.json").unlink(), "has no image processor config"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json cannot be read"),
    ],
    ids=["unsupported-family", "no-tokenizer", "no-preprocessor-config", "bad-config"],
)
def test_startup_error_is_one_clear_line(builtin_model_dir, tmp_path, breakage, expected):
    directory = tmp_path / "ckpt"
    shutil.copytree(builtin_model_dir, directory)
    breakage(directory)
    cmd = [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--model",
           str(directory), "--device", "cpu", "--port", str(free_port())]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert expected in text
    assert "Traceback" not in text


def test_unsupported_family_is_refused_before_any_weight_is_read(builtin_model_dir, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(builtin_model_dir, directory)
    _edit_config(
        directory, model_type="idefics3", architectures=["Idefics3ForConditionalGeneration"]
    )
    (directory / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="unsupported model_type 'idefics3'"):
        load_model(directory, device="cpu")


def test_bf16_checkpoint_loads_without_a_copy_and_fp32_casts_per_tensor(
    builtin_model_dir, tmp_path
):
    """Weights land in the parameters in the asked dtype, whatever the file's dtype."""
    directory = tmp_path / "bf16"
    shutil.copytree(builtin_model_dir, directory)
    from safetensors.torch import load_file

    weights = load_file(directory / "model.safetensors")
    save_file({k: v.bfloat16() for k, v in weights.items()}, str(directory / "model.safetensors"))
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(directory, device="cpu", dtype=dtype)
        assert model.language is not None and model.vision is not None
        params = [*model.language.parameters(), *model.vision.parameters()]
        assert {p.dtype for p in params} == {dtype}
        assert not any(p.requires_grad or p.device.type == "meta" for p in params)
        embed = model.language.embed_tokens.weight
        torch.testing.assert_close(
            embed, weights["model.embed_tokens.weight"].bfloat16().to(dtype), atol=0, rtol=0
        )
        inv_freq = [b for n, b in model.vision.named_buffers() if n.endswith("inv_freq")]
        assert inv_freq and all(b.dtype == torch.float32 for b in inv_freq)
