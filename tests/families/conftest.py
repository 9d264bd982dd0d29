"""Tiny random checkpoints of each family, written with ``transformers``' own classes.

Each builder makes the model class of the family from a small config under a
fixed seed and saves it with ``save_pretrained``; the tokenizer is the built-in
model's (made in code) wrapped in ``transformers``' fast tokenizer, and the
processor is the family's own processor class saved with ``save_pretrained``, so
the checkpoint directory has the files of a Hub checkpoint.
"""

from __future__ import annotations

import base64
import functools
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ec_frontend.model import builtin
from PIL import Image
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    SiglipVisionConfig,
)

SEED = 1234
#: Large enough that greedy argmax margins dwarf float32 reordering noise.
INITIALIZER_RANGE = 0.2


def tokenizer() -> PreTrainedTokenizerFast:
    tok = builtin.build_tokenizer()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=builtin.CHAT_TEMPLATE,
    )


def special_ids(tok: PreTrainedTokenizerFast) -> dict[str, int]:
    return {t: tok.convert_tokens_to_ids(t) for t in builtin.SPECIAL_TOKENS}


def qwen_image_processor() -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor(
        min_pixels=builtin.MIN_PIXELS,
        max_pixels=builtin.MAX_PIXELS,
        patch_size=builtin.PATCH_SIZE,
        temporal_patch_size=builtin.TEMPORAL_PATCH_SIZE,
        merge_size=builtin.SPATIAL_MERGE_SIZE,
    )


#: The tiny shapes of the test checkpoints (benches pass mid-size ones).
TINY_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
TINY_QWEN2_5_VISION = {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "window_size": 56, "fullatt_block_indexes": [1, 3]}  # fmt: skip
TINY_QWEN2_VISION = {"depth": 2, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 2}
#: Qwen3-VL's tower: 16-pixel patches, a learned 8x8 position grid, DeepStack features
#: from blocks 1 and 2 (added after decoder layers 0 and 1 of 3).
TINY_QWEN3_VISION = {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                     "patch_size": 16, "num_position_embeddings": 64,
                     "deepstack_visual_indexes": [1, 2]}  # fmt: skip
#: Qwen3's decoder has its own head_dim (here twice hidden_size / heads).
TINY_QWEN3_TEXT = {**TINY_TEXT, "num_hidden_layers": 3, "head_dim": 32}
TINY_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
             "num_attention_heads": 2}  # fmt: skip


def mrope_section(text: dict[str, Any]) -> list[int]:
    """Qwen's split of the rotary half-dimension into temporal / height / width
    (``[16, 24, 24]`` at head_dim 128)."""
    half = (text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]) // 2
    temporal = half // 4
    side = (half - temporal) // 2
    return [half - 2 * side, side, side]


def qwen_vl_config(
    config_class: type,
    ids: dict[str, int],
    vocab_size: int,
    *,
    text: dict[str, Any],
    vision: dict[str, Any],
) -> Any:
    """A Qwen-VL config with the given text / vision shapes and the tokenizer's ids."""
    return config_class(
        text_config={
            "vocab_size": vocab_size,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0,
                                "mrope_section": mrope_section(text)},
            "tie_word_embeddings": False,
            "initializer_range": INITIALIZER_RANGE,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            **text,
        },
        vision_config={
            "in_channels": 3,
            "patch_size": builtin.PATCH_SIZE,
            "spatial_merge_size": builtin.SPATIAL_MERGE_SIZE,
            "temporal_patch_size": builtin.TEMPORAL_PATCH_SIZE,
            "initializer_range": INITIALIZER_RANGE,
            **vision,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        initializer_range=INITIALIZER_RANGE,
    )  # fmt: skip


def write_qwen2_5_vl(
    directory: Path,
    text: dict[str, Any] = TINY_TEXT,
    vision: dict[str, Any] = TINY_QWEN2_5_VISION,
) -> Path:
    """A Qwen2.5-VL checkpoint (tiny by default: 2 decoder layers, hidden 64, GQA 4/2,
    a 4-block window-attention vision tower whose blocks 1 and 3 attend fully)."""
    vision = {"out_hidden_size": text["hidden_size"], "tokens_per_second": 2, **vision}
    return _write_qwen(
        directory,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        ImageOnlyQwen2_5_VLProcessor,
        text=text,
        vision=vision,
    )


def write_qwen3_vl(
    directory: Path,
    text: dict[str, Any] = TINY_QWEN3_TEXT,
    vision: dict[str, Any] = TINY_QWEN3_VISION,
) -> Path:
    """A Qwen3-VL checkpoint (tiny by default: 3 decoder layers, hidden 64, head_dim 32,
    GQA 4/2, a 4-block tower on 16-pixel patches with two DeepStack mergers)."""
    vision = {"out_hidden_size": text["hidden_size"], **vision}
    return _write_qwen(
        directory,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        ImageOnlyQwen3VLProcessor,
        text=text,
        vision=vision,
        image_processor=qwen3_image_processor(),
    )


def qwen3_image_processor() -> Qwen2VLImageProcessor:
    """Qwen3-VL's image rule (Qwen2-VL's, on 16-pixel patches normalised to [-1, 1])."""
    return Qwen2VLImageProcessor(
        min_pixels=builtin.MIN_PIXELS,
        max_pixels=builtin.MAX_PIXELS,
        patch_size=16,
        temporal_patch_size=builtin.TEMPORAL_PATCH_SIZE,
        merge_size=builtin.SPATIAL_MERGE_SIZE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def write_qwen2_vl(
    directory: Path, text: dict[str, Any] = TINY_TEXT, vision: dict[str, Any] = TINY_QWEN2_VISION
) -> Path:
    """A Qwen2-VL checkpoint written by ``transformers``' own classes."""
    vision = {"hidden_size": text["hidden_size"], **vision}
    return _write_qwen(
        directory,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        ImageOnlyQwen2VLProcessor,
        text=text,
        vision=vision,
    )


def _write_qwen(
    directory: Path,
    config_class: type,
    model_class: type,
    processor_class: type,
    *,
    text: dict[str, Any],
    vision: dict[str, Any],
    image_processor: Qwen2VLImageProcessor | None = None,
) -> Path:
    tok = tokenizer()
    ids = special_ids(tok)
    vocab = builtin._round_up(len(tok), 64)
    config = qwen_vl_config(config_class, ids, vocab, text=text, vision=vision)
    torch.manual_seed(SEED)
    model = model_class(config).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(directory)
    processor = processor_class(
        image_processor=image_processor or qwen_image_processor(),
        tokenizer=tok,
        chat_template=builtin.CHAT_TEMPLATE,
    )
    save_processor(processor, directory, processor_class.__mro__[1].__name__)
    return directory


class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without its video processor (which needs torchvision,
    not installed here); images and text go through the parent's own code."""

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor (as above)."""

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3-VL's processor without its video processor (as above)."""

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


def load_hf_processor(directory: Path, processor_class: type = ImageOnlyQwen2_5_VLProcessor) -> Any:
    return processor_class(
        image_processor=Qwen2VLImageProcessor.from_pretrained(directory),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(directory),
        chat_template=(directory / "chat_template.jinja").read_text(encoding="utf-8"),
    )


def save_processor(processor: Any, directory: Path, class_name: str) -> None:
    """``save_pretrained``, with the processor class recorded under its Hub name."""
    processor.save_pretrained(directory)
    for name in ("processor_config.json", "tokenizer_config.json"):
        path = directory / name
        config = json.loads(path.read_text(encoding="utf-8"))
        config["processor_class"] = class_name
        path.write_text(json.dumps(config, indent=2), encoding="utf-8")


#: LLaVA-1.5's conversation format: "USER: <image>\n... ASSISTANT:".
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] != 'user' %}<|im_end|>{% endif %} "
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
LLAVA_IMAGE_SIZE = 56
#: LLaVA-OneVision's: LLaVA-1.5's format with ``<video>`` for a video part.
LLAVA_ONEVISION_TEMPLATE = LLAVA_TEMPLATE.replace(
    "<image>\n{% elif",
    "<image>\n{% elif part['type'] == 'video' or part['type'] == 'video_url' %}<video>\n{% elif",
)


def write_llava(
    directory: Path,
    text: dict[str, Any] = TINY_TEXT,
    vision: dict[str, Any] = TINY_CLIP,
    image_size: int = LLAVA_IMAGE_SIZE,
) -> Path:
    """A LLaVA-1.5 checkpoint (tiny by default: a 2-layer Llama decoder, hidden 64,
    GQA 4/2, a 3-layer CLIP tower on 56x56 images: 16 patches -> 16 image tokens)."""
    return _write_llava_like(
        directory,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        llava_image_processor(image_size),
        text=text,
        vision=vision,
        image_size=image_size,
        extra={"image_seq_length": (image_size // 14) ** 2},
    )


def llava_next_pinpoints(tile: int) -> list[list[int]]:
    """LLaVA-NeXT's resolutions (``[[336, 672], [672, 336], [672, 672], [1008, 336],
    [336, 1008]]`` at 336 px tiles) for tiles of ``tile`` pixels."""
    return [[tile * h, tile * w] for h, w in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]


def write_llava_next(
    directory: Path,
    text: dict[str, Any] = TINY_TEXT,
    vision: dict[str, Any] = TINY_CLIP,
    image_size: int = LLAVA_IMAGE_SIZE,
) -> Path:
    """A LLaVA-NeXT checkpoint: LLaVA-1.5's tiny parts, anyres tiles of 56 px (each
    4x4 features) over the five LLaVA-NeXT resolutions, and an image newline."""
    return _write_llava_like(
        directory,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
        llava_next_image_processor(image_size),
        text=text,
        vision=vision,
        image_size=image_size,
        extra={"image_grid_pinpoints": llava_next_pinpoints(image_size)},
    )


def _write_llava_like(
    directory: Path,
    config_class: type,
    model_class: type,
    processor_class: type,
    image_processor: Any,
    *,
    text: dict[str, Any],
    vision: dict[str, Any],
    image_size: int,
    extra: dict[str, Any],
    text_class: type = LlamaConfig,
    vision_config: Any = None,
    make_processor: Callable[[Any, Any], Any] | None = None,
    video: bool = False,
) -> Path:
    """``vision_config`` defaults to a CLIP tower of ``vision``; ``make_processor``
    (image processor, tokenizer) -> processor, to :func:`llava_processor`; ``video``:
    a ``<video>`` token (the config's ``video_token_id``) and a template with video
    parts."""
    tok = tokenizer()
    tok.add_special_tokens(
        {"additional_special_tokens": ["<image>", "<video>"] if video else ["<image>"]}
    )
    tok.chat_template = LLAVA_ONEVISION_TEMPLATE if video else LLAVA_TEMPLATE
    ids = special_ids(tok)
    image_id = tok.convert_tokens_to_ids("<image>")
    if video:
        extra = {**extra, "video_token_id": tok.convert_tokens_to_ids("<video>")}
    vocab = builtin._round_up(len(tok), 64)
    text_config = text_class(
        vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-6,
        initializer_range=INITIALIZER_RANGE, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], **text,
    )  # fmt: skip
    if vision_config is None:
        vision_config = CLIPVisionConfig(
            image_size=image_size, patch_size=14, projection_dim=32,
            initializer_range=INITIALIZER_RANGE, **vision,
        )  # fmt: skip
    config = config_class(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=image_id,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(SEED)
    model = model_class(config).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(directory)
    if make_processor is None:
        processor = llava_processor(processor_class, image_processor, tok)
    else:
        processor = make_processor(image_processor, tok)
    save_processor(processor, directory, processor_class.__name__)
    return directory


def llava_processor(processor_class: type, image_processor: Any, tok: Any) -> Any:
    return processor_class(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE,
        image_token="<image>",
        num_additional_image_tokens=1,
    )


def llava_next_image_processor(image_size: int = LLAVA_IMAGE_SIZE) -> LlavaNextImageProcessor:
    return LlavaNextImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_grid_pinpoints=llava_next_pinpoints(image_size),
    )


def load_hf_llava_next_processor(directory: Path) -> LlavaNextProcessor:
    return llava_processor(
        LlavaNextProcessor,
        LlavaNextImageProcessor.from_pretrained(directory),
        PreTrainedTokenizerFast.from_pretrained(directory),
    )


def llava_image_processor(image_size: int = LLAVA_IMAGE_SIZE) -> CLIPImageProcessor:
    return CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )


def load_hf_llava_processor(directory: Path) -> LlavaProcessor:
    return llava_processor(
        LlavaProcessor,
        CLIPImageProcessor.from_pretrained(directory),
        PreTrainedTokenizerFast.from_pretrained(directory),
    )


def llava_onevision_pinpoints(tile: int) -> list[list[int]]:
    """LLaVA-OneVision's resolutions (``[[384, 384], ..., [2304, 2304]]``: 1 to 6 tiles
    a side) for tiles of ``tile`` pixels."""
    return [[tile * h, tile * w] for h in range(1, 7) for w in range(1, 7)]


TINY_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
               "num_attention_heads": 2}  # fmt: skip


def write_llava_onevision(
    directory: Path,
    text: dict[str, Any] = TINY_TEXT,
    vision: dict[str, Any] = TINY_SIGLIP,
    image_size: int = LLAVA_IMAGE_SIZE,
) -> Path:
    """A LLaVA-OneVision checkpoint: a Qwen2 decoder (q/k/v biases), a SigLIP tower
    (no CLS, all its tokens kept: the ``full`` strategy) on tiles of 56 px (4x4
    features), anyres over 1 to 6 tiles a side with ``anyres_max_9`` pooling; a
    ``<video>`` token and a ``LlavaOnevisionVideoProcessor`` config (frames resized
    to one tile)."""
    vision_config = SiglipVisionConfig(
        image_size=image_size, patch_size=14, vision_use_head=False, **vision
    )
    video_config = {
        "video_processor_type": "LlavaOnevisionVideoProcessor",
        "size": {"height": image_size, "width": image_size},
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1 / 255,
        "resample": 3,
        "do_sample_frames": False,
    }
    (directory / "video_preprocessor_config.json").write_text(
        json.dumps(video_config), encoding="utf-8"
    )
    return _write_llava_like(
        directory,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionProcessor,
        llava_onevision_image_processor(image_size),
        text=text,
        vision=vision,
        image_size=image_size,
        extra={
            "image_grid_pinpoints": llava_onevision_pinpoints(image_size),
            "vision_feature_select_strategy": "full",
            "vision_feature_layer": -1,
            "vision_aspect_ratio": "anyres_max_9",
        },
        text_class=Qwen2Config,
        vision_config=vision_config,
        make_processor=functools.partial(llava_onevision_processor, tokens=(image_size // 14) ** 2),
        video=True,
    )


def llava_onevision_image_processor(image_size: int = LLAVA_IMAGE_SIZE) -> Any:
    return LlavaOnevisionImageProcessorPil(
        size={"height": image_size, "width": image_size},
        image_grid_pinpoints=llava_onevision_pinpoints(image_size),
    )


class ImageOnlyLlavaOnevisionProcessor(LlavaOnevisionProcessor):
    """LLaVA-OneVision's processor without its video processor (as the Qwen ones)."""

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


def llava_onevision_processor(image_processor: Any, tok: Any, *, tokens: int) -> Any:
    return ImageOnlyLlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        num_image_tokens=tokens,
        vision_feature_select_strategy="full",
        chat_template=LLAVA_ONEVISION_TEMPLATE,
        image_token="<image>",
        video_token="<video>",
        vision_aspect_ratio="anyres_max_9",
    )


def load_hf_llava_onevision_processor(directory: Path) -> Any:
    image_processor = LlavaOnevisionImageProcessorPil.from_pretrained(directory)
    tokens = (image_processor.size["height"] // 14) ** 2
    return llava_onevision_processor(
        image_processor, PreTrainedTokenizerFast.from_pretrained(directory), tokens=tokens
    )


@pytest.fixture(scope="session")
def llava_onevision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llava_onevision(tmp_path_factory.mktemp("llava_onevision"))


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="session")
def llava_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llava_next(tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


def image_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A deterministic noise image as PNG."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture
def make_image() -> Callable[..., bytes]:
    return image_bytes
