"""LLaVA-1.5-7B's real shape with ``--load-format dummy`` in bf16 on the CPU.

The config is the published ``config.json`` of ``llava-hf/llava-1.5-7b-hf`` (its
Llama text config leaves the 7B shape to ``LlamaConfig``'s defaults, checked
here). The checkpoint directory has that config, a tokenizer and ``LlavaProcessor``
built in code, and no weights. The real server starts with dummy weights (7.06 B
parameters, 14.1 GB in bf16), serves a short greedy completion and a chat with one
336x300 image (576 placeholder tokens through the CLIP tower and the decoder), and
its process never holds more than 1.3x the parameters' bytes, KV cache included:
the dummy load path keeps no second copy (no fp32 build, no random init before the
fill). About 75 s on 2 cores (measured peak 14.8 GiB for 13.2 GiB of parameters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ec_frontend.model import builtin
from tokenizers import AddedToken, Tokenizer
from transformers import (
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from ..helpers import processes
from ..helpers.processes import Proc
from .conftest import (
    LLAVA_TEMPLATE,
    data_url,
    image_bytes,
    llava_image_processor,
    llava_processor,
    save_processor,
)

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # 5-14 GiB resident: alone on the machine

#: ``llava-hf/llava-1.5-7b-hf``'s ``config.json`` as published.
LLAVA_1_5_7B: dict[str, Any] = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100,
    "image_seq_length": 576, "image_token_index": 32000, "model_type": "llava",
    "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5",
                    "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                    "model_type": "llama", "rms_norm_eps": 1e-05, "torch_dtype": "float16",
                    "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.36.0.dev0",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
                      "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}  # fmt: skip

IMAGE_TOKEN = 32000
IMAGE_SIZE = 336
TOKENS_PER_IMAGE = (IMAGE_SIZE // 14) ** 2


def llava_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in byte-level BPE tokenizer with its vocabulary padded to Llama's 32000
    entries, then ``<image>`` (32000) and ``<pad>`` (32001) as in the Hub checkpoint."""
    data = json.loads(builtin.build_tokenizer().to_str())
    vocab = data["model"]["vocab"]
    first_free = 1 + max([*vocab.values(), *(t["id"] for t in data["added_tokens"])])
    vocab.update({f"<unused{i}>": i for i in range(first_free, IMAGE_TOKEN)})
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<image>", "<pad>")]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
        chat_template=LLAVA_TEMPLATE,
    )  # fmt: skip


def write_checkpoint(directory: Path) -> Path:
    """The real config, the tokenizer and LLaVA-1.5's processor (CLIP at 336 px); no weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(LLAVA_1_5_7B), encoding="utf-8")
    tok = llava_tokenizer()
    assert tok.convert_tokens_to_ids(["<image>", "<pad>"]) == [IMAGE_TOKEN, 32001]
    processor = llava_processor(LlavaProcessor, llava_image_processor(IMAGE_SIZE), tok)
    save_processor(processor, directory, "LlavaProcessor")
    return directory


def peak_rss(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def parameter_count() -> int:
    """transformers' own count for the config (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(LlavaConfig(**LLAVA_1_5_7B))
    return sum(p.numel() for p in model.parameters())


def test_llava_1_5_7b_config_and_defaults() -> None:
    """The text config relies on ``LlamaConfig``'s defaults for the 7B shape."""
    config = LlavaConfig(**LLAVA_1_5_7B)
    text = config.text_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (4096, 11008, 32)
    assert (text.num_attention_heads, text.num_key_value_heads) == (32, 32)
    assert parameter_count() == 7_063_427_072  # the Hub checkpoint's published size


@pytest.mark.timeout(1200)
def test_server_starts_and_serves_text_and_an_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "STARTUP_TIMEOUT_S", 900.0)
    directory = write_checkpoint(tmp_path / "llava-1.5-7b")
    args = ["--model", str(directory), "--load-format", "dummy", "--dtype", "bfloat16",
            "--device", "cpu", "--engine-mode", "inprocess", "--max-model-len", "1024",
            "--max-num-batched-tokens", "1024", "--kv-cache-memory", str(640 * 2**20)]  # fmt: skip
    proc = Proc("serve", args, "llava-1.5-7b")
    try:
        proc.wait_ready()
        model = httpx.get(proc.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello there", "max_tokens": 2, "temperature": 0}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] in (1, 2)

        text_tokens = r.json()["usage"]["prompt_tokens"]
        content = [
            {"type": "image_url", "image_url": {"url": data_url(image_bytes(IMAGE_SIZE, 300))}},
            {"type": "text", "text": "hello there"},
        ]
        chat = {"model": model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": content}]}  # fmt: skip
        r = httpx.post(proc.url + "/v1/chat/completions", json=chat, timeout=900)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 1
        # The image expands to 576 placeholders (CLIP-L/14 at 336 px, CLS dropped).
        assert usage["prompt_tokens"] >= TOKENS_PER_IMAGE + text_tokens - 1, usage

        params = parameter_count()
        peak = peak_rss(proc.proc.pid)
        print(f"llava-1.5-7b dummy bf16: peak RSS {peak / 2**30:.2f} GiB, "
              f"parameters {2 * params / 2**30:.2f} GiB")  # fmt: skip
        assert 2 * params <= peak <= 1.3 * 2 * params, peak
    finally:
        proc.stop()
