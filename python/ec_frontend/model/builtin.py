"""The built-in default model: a tiny Qwen2-VL checkpoint made from a fixed seed.

:func:`ensure_builtin_checkpoint` writes a complete Hugging Face checkpoint
directory (config, safetensors weights, tokenizer, chat template, image
and video processor configs) once, then returns its path; it is loaded through the same
code path as any local Qwen2-VL checkpoint. Every file is a pure function of the
code (and the pinned torch / tokenizers versions), so every instance of a
deployment loads byte-identical weights. The weights are random: the text the
model produces is meaningless, its shapes, caches and transfers are real.

The weights use the Hub layout of Qwen2-VL checkpoints (``visual.*``,
``model.layers.*``, ``model.embed_tokens.weight``), which ``transformers``
converts on load, so the built-in model exercises the same name mapping as a
downloaded checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

#: Bumped whenever any byte of the checkpoint would change.
BUILTIN_VERSION = "v3"
BUILTIN_NAME = f"qwen2-vl-tiny-{BUILTIN_VERSION}"
#: The model id a server reports for the built-in model.
BUILTIN_MODEL_ID = "ec-frontend/qwen2-vl-tiny"
SEED = 20240917

# Language model.
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
MROPE_SECTION = (2, 3, 3)  # sums to HEAD_DIM // 2
ROPE_THETA = 1_000_000.0
MAX_POSITION_EMBEDDINGS = 4096
RMS_NORM_EPS = 1e-6
# Vision tower.
VISION_EMBED_DIM = 32
VISION_DEPTH = 2
VISION_HEADS = 2
VISION_MLP_RATIO = 2
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
SPATIAL_MERGE_SIZE = 2
# Image processor: 56x56 -> 4 placeholder tokens, 112x112 -> 16, at most 64.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 224 * 224

BPE_VOCAB_SIZE = 512
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2's pre-tokenization pattern (digits split one by one, letters in runs).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A Qwen2-VL style chat template: a default system turn, image parts rendered as
# <|vision_start|><|image_pad|><|vision_end|>, text parts verbatim.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS_TEXT = (
    "the a an of to and in is it that for on with as was at by this be are from or have not "
    "image picture photo cat dog red green blue white black small large left right top bottom "
    "what describe show tell me you assistant user system hello world there here one two three "
    "color shape square circle line text number model answer question please thank yes no "
    "encode prefill decode cache block token request server client stream"
)


def default_cache_dir() -> Path:
    """``$EC_FRONTEND_CACHE``, else ``~/.cache/ec-frontend``."""
    env = os.environ.get("EC_FRONTEND_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "ec-frontend"


def ensure_builtin_checkpoint(cache_dir: Path | None = None) -> Path:
    """Return the built-in checkpoint directory, creating it on first use.

    The directory is ``<cache_dir>/<BUILTIN_NAME>``. It is written into a
    temporary sibling and renamed into place, so a reader never sees a partial
    checkpoint and concurrent creators (threads or processes) are safe: the first
    rename wins and the others discard their copy.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / BUILTIN_NAME
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_NAME}.", dir=root))
    try:
        write_builtin_checkpoint(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_builtin_checkpoint(directory: Path) -> None:
    """Write every file of the built-in checkpoint into ``directory`` (which must exist)."""
    tokenizer = build_tokenizer()
    vocab_size = _round_up(tokenizer.get_vocab_size(with_added_tokens=True), 64)
    ids: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(tok)
        if token_id is None:
            raise RuntimeError(f"the built-in tokenizer has no {tok!r}")
        ids[tok] = token_id
    config = _model_config(vocab_size, ids)
    _write_json(directory / "config.json", config)
    _write_json(
        directory / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
        },
    )
    save_file(build_weights(vocab_size), str(directory / "model.safetensors"), {"format": "pt"})
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", _tokenizer_config(ids))
    _write_json(directory / "preprocessor_config.json", _preprocessor_config())
    _write_json(directory / "video_preprocessor_config.json", _video_preprocessor_config())


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer with Qwen2's pre-tokenizer and special tokens.

    The merges are learned from a fixed in-code corpus; the special tokens take
    the ids after the learned vocabulary, as in Qwen2 tokenizers.
    """
    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS]
    )
    return tokenizer


def build_weights(vocab_size: int) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights in the Hub layout of Qwen2-VL.

    Tensors are drawn in a fixed order from one seeded generator. Linear
    weights have standard deviation ``1/sqrt(fan_in)`` so activations and logits
    stay of order one; norms are near one; biases small.
    """
    gen = torch.Generator().manual_seed(SEED)
    out: dict[str, torch.Tensor] = {}

    def normal(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def linear(name: str, fan_out: int, fan_in: int, bias: bool) -> None:
        normal(f"{name}.weight", (fan_out, fan_in), fan_in**-0.5)
        if bias:
            normal(f"{name}.bias", (fan_out,), 0.02)

    def layer_norm(name: str, dim: int) -> None:
        normal(f"{name}.weight", (dim,), 0.05, 1.0)
        normal(f"{name}.bias", (dim,), 0.02)

    e, h = VISION_EMBED_DIM, HIDDEN_SIZE
    patch_in = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE
    normal(
        "visual.patch_embed.proj.weight",
        (e, 3, TEMPORAL_PATCH_SIZE, PATCH_SIZE, PATCH_SIZE),
        patch_in**-0.5,
    )
    for i in range(VISION_DEPTH):
        p = f"visual.blocks.{i}"
        layer_norm(f"{p}.norm1", e)
        layer_norm(f"{p}.norm2", e)
        linear(f"{p}.attn.qkv", 3 * e, e, bias=True)
        linear(f"{p}.attn.proj", e, e, bias=True)
        linear(f"{p}.mlp.fc1", e * VISION_MLP_RATIO, e, bias=True)
        linear(f"{p}.mlp.fc2", e, e * VISION_MLP_RATIO, bias=True)
    merged = e * SPATIAL_MERGE_SIZE**2
    layer_norm("visual.merger.ln_q", e)
    linear("visual.merger.mlp.0", merged, merged, bias=True)
    linear("visual.merger.mlp.2", h, merged, bias=True)

    normal("model.embed_tokens.weight", (vocab_size, h), 0.5)
    kv = NUM_KV_HEADS * HEAD_DIM
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        normal(f"{p}.input_layernorm.weight", (h,), 0.05, 1.0)
        normal(f"{p}.post_attention_layernorm.weight", (h,), 0.05, 1.0)
        linear(f"{p}.self_attn.q_proj", h, h, bias=True)
        linear(f"{p}.self_attn.k_proj", kv, h, bias=True)
        linear(f"{p}.self_attn.v_proj", kv, h, bias=True)
        linear(f"{p}.self_attn.o_proj", h, h, bias=False)
        linear(f"{p}.mlp.gate_proj", INTERMEDIATE_SIZE, h, bias=False)
        linear(f"{p}.mlp.up_proj", INTERMEDIATE_SIZE, h, bias=False)
        linear(f"{p}.mlp.down_proj", h, INTERMEDIATE_SIZE, bias=False)
    normal("model.norm.weight", (h,), 0.05, 1.0)
    return out


def _model_config(vocab_size: int, ids: dict[str, int]) -> dict[str, object]:
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": {"type": "mrope", "mrope_section": list(MROPE_SECTION)},
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "vision_config": {
            "depth": VISION_DEPTH,
            "embed_dim": VISION_EMBED_DIM,
            "hidden_size": HIDDEN_SIZE,
            "hidden_act": "quick_gelu",
            "mlp_ratio": VISION_MLP_RATIO,
            "num_heads": VISION_HEADS,
            "in_channels": 3,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": SPATIAL_MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
    }


def _tokenizer_config(ids: dict[str, int]) -> dict[str, object]:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "added_tokens_decoder": {
            str(ids[tok]): {
                "content": tok,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for tok in SPECIAL_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }


def _preprocessor_config() -> dict[str, object]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": SPATIAL_MERGE_SIZE,
    }


def _video_preprocessor_config() -> dict[str, object]:
    """transformers' ``Qwen2VLVideoProcessor`` config: the image values, and a frame
    pixel range as small as the image one (56x56 frames -> 4 tokens per 2 frames)."""
    config = _preprocessor_config()
    del config["image_processor_type"]
    config.update(
        video_processor_type="Qwen2VLVideoProcessor",
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    return config


def _corpus() -> list[str]:
    words = _CORPUS_TEXT.split()
    lines = []
    for i in range(len(words)):
        a, b, c = words[i], words[(i * 7 + 3) % len(words)], words[(i * 13 + 5) % len(words)]
        lines.append(f"{a} {b} {c}. {c.capitalize()} {a}, {b}? {i} {i * 37 % 1000}")
    return lines


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
