"""Local Hugging Face Qwen2-VL checkpoint -> model and input processor.

Entry points used by the engine:

* :func:`load_model` builds a :class:`~ec_frontend.model.qwen2_vl.Qwen2VLModel`
  from ``config.json`` and the ``*.safetensors`` weights (single file or
  sharded), reading only the tensors of the parts asked for.
* :func:`load_processor` builds an :class:`~ec_frontend.model.processor.InputProcessor`
  from the tokenizer, chat template and image processor config.
* :func:`ensure_builtin_checkpoint` (re-exported) gives the built-in model's directory.

Both the Hub layout (``visual.*``, ``model.layers.*``) and the layout of
``transformers`` 5 (``model.visual.*``, ``model.language_model.*``) are read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from ec_frontend.model.builtin import ensure_builtin_checkpoint
from ec_frontend.model.processor import InputProcessor
from ec_frontend.model.qwen2_text import Qwen2TextModel, TextModelConfig
from ec_frontend.model.qwen2_vl import Qwen2VLModel

__all__ = [
    "ModelLoadError",
    "ensure_builtin_checkpoint",
    "load_model",
    "load_processor",
    "resolve_device",
    "resolve_dtype",
]

SUPPORTED_MODEL_TYPES = ("qwen2_vl",)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
# (prefix in the checkpoint, component, prefix inside the component); first match wins.
_PREFIXES = (
    ("model.visual.", "vision", ""),
    ("visual.", "vision", ""),
    ("model.language_model.", "language", ""),
    ("lm_head.", "language", "lm_head."),
    ("model.", "language", ""),
)


class ModelLoadError(RuntimeError):
    """A checkpoint directory that cannot be loaded as asked (missing files or
    weights, an unsupported architecture, an unavailable device or dtype)."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` or ``"auto"``: CUDA when available, else CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"invalid device {device!r}: {exc}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for, but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` or ``"auto"``: bfloat16 on CUDA, float32 elsewhere."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        resolved = _DTYPES[dtype.lower()]
    else:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(f"unsupported dtype {resolved}")
    return resolved


def load_config(path: str | Path) -> PretrainedConfig:
    """The checkpoint's ``transformers`` config, checked to be a supported architecture."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{directory} is not a checkpoint directory (no config.json)")
    config = AutoConfig.from_pretrained(directory)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported model_type {config.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    return config


def text_model_config(config: PretrainedConfig) -> TextModelConfig:
    """The language-model shape of a Qwen2-VL config."""
    text = config.text_config
    rope = text.rope_parameters or {}
    section = tuple(rope.get("mrope_section") or ())
    if len(section) != 3:
        raise ModelLoadError(f"config has no 3-part mrope_section (got {list(section)})")
    if text.hidden_act != "silu":
        raise ModelLoadError(f"unsupported hidden_act {text.hidden_act!r} (expected 'silu')")
    if getattr(text, "use_sliding_window", False):
        raise ModelLoadError("sliding-window attention is not supported")
    return TextModelConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_layers=text.num_hidden_layers,
        num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads or text.num_attention_heads,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 1_000_000.0)),
        mrope_section=(int(section[0]), int(section[1]), int(section[2])),
        tie_word_embeddings=bool(config.tie_word_embeddings),
    )


def load_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    load_vision: bool = True,
    load_language: bool = True,
    load_format: str = "auto",
) -> Qwen2VLModel:
    """Load a local Qwen2-VL checkpoint.

    ``device`` defaults to CUDA when available, else CPU; ``dtype`` to bfloat16
    on CUDA, float32 elsewhere. ``load_vision`` / ``load_language`` choose the
    parts to build (an encoder-only instance needs no language model).
    ``load_format="dummy"`` skips the weight files and gives deterministic
    random weights for the config (for benchmarks of large shapes).
    Raises :class:`ModelLoadError`.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unsupported load_format {load_format!r}; use one of {LOAD_FORMATS}")
    directory = Path(path)
    config = load_config(directory)
    target_device = resolve_device(device)
    target_dtype = resolve_dtype(dtype, target_device)
    text_cfg = text_model_config(config)
    dummy = load_format == "dummy"
    wanted = {name for name, on in (("vision", load_vision), ("language", load_language)) if on}
    weights = {} if dummy else _read_weights(directory, wanted)

    vision = None
    language = None
    # Built under a fixed seed: dummy weights are reproducible, the global RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if load_vision:
            vision = Qwen2VisionTransformerPretrainedModel._from_config(config.vision_config)
        if load_language:
            language = Qwen2TextModel(text_cfg)
    if vision is not None:
        if not dummy:
            _load_into(vision, weights["vision"], "vision tower")
        vision = _to_keeping_float32_rope(vision, target_device, target_dtype)
    if language is not None:
        if not dummy:
            lm_weights = weights["language"]
            if text_cfg.tie_word_embeddings:
                lm_weights.pop("lm_head.weight", None)
            _load_into(language, lm_weights, "language model")
        language = language.to(device=target_device, dtype=target_dtype).eval()
    return Qwen2VLModel(
        text_config=text_cfg,
        image_token_id=int(config.image_token_id),
        spatial_merge_size=int(config.vision_config.spatial_merge_size),
        vision=vision,
        language=language,
        device=target_device,
        dtype=target_dtype,
    )


def load_processor(path: str | Path, *, model_id: str = "") -> InputProcessor:
    """The input processor of a local checkpoint (tokenizer, chat template, images)."""
    directory = Path(path)
    config = load_config(directory)
    return InputProcessor.from_pretrained(directory, config, model_id=model_id)


def _to_keeping_float32_rope(
    module: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """``module.to(device, dtype)``, except rotary ``inv_freq`` buffers stay float32."""
    saved = {
        name: buf.detach().float().clone()
        for name, buf in module.named_buffers()
        if name.endswith("inv_freq")
    }
    module = module.to(device=device, dtype=dtype).eval()
    for name, buf in saved.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        setattr(owner, attr, buf.to(device))
    return module


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {directory}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"weight files listed in the index are missing: {missing}")
    return files


def _read_weights(directory: Path, wanted: set[str]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in wanted}
    if not wanted:
        return out
    for file in _weight_files(directory):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                for prefix, component, inner in _PREFIXES:
                    if key.startswith(prefix):
                        if component in wanted:
                            out[component][inner + key[len(prefix) :]] = handle.get_tensor(key)
                        break
    return out


def _load_into(module: torch.nn.Module, weights: dict[str, torch.Tensor], what: str) -> None:
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    missing = sorted(shapes.keys() - weights.keys())
    unexpected = sorted(weights.keys() - shapes.keys())
    if missing or unexpected:
        raise ModelLoadError(
            f"{what}: checkpoint weights do not match the config "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})"
        )
    for name, tensor in weights.items():
        if tuple(tensor.shape) != shapes[name]:
            raise ModelLoadError(
                f"{what}: weight {name} has shape {tuple(tensor.shape)}, expected {shapes[name]}"
            )
    module.load_state_dict(weights, strict=True)
