"""Checkpoint -> model and input processor, for every family of the registry.

Entry points used by the engine:

* :func:`resolve_model_path`: a local checkpoint directory, or a Hugging Face id
  resolved through the local Hugging Face cache (downloaded only when the hub is
  not offline);
* :func:`load_model` builds the :class:`~ec_frontend.model.interface.VisionLanguageModel`
  of the checkpoint's family (:mod:`ec_frontend.model.registry`) from
  ``config.json`` and its ``*.safetensors`` weights (single file or sharded),
  reading only the tensors of the parts asked for;
* :func:`load_processor` builds an :class:`~ec_frontend.model.processor.InputProcessor`
  from the tokenizer, chat template and image processor config;
* :func:`ensure_builtin_checkpoint` (re-exported) gives the built-in model's directory.

Loading holds at real sizes: modules are built with their parameters on the
``meta`` device (no memory, no random init), then each safetensors shard is
opened with ``safe_open`` on the target device and every tensor becomes its
parameter directly, cast to the target dtype one tensor at a time. A bf16
checkpoint loaded in bf16 is never copied, so peak host memory stays near the
checkpoint's size. ``load_format="dummy"`` fills the same parameters with
seeded random values instead (for benchmarks of real shapes without weights).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from ec_frontend.model.builtin import ensure_builtin_checkpoint
from ec_frontend.model.checkpoint_files import image_processor_problem, tokenizer_problem
from ec_frontend.model.errors import ModelLoadError
from ec_frontend.model.paged_attention import resolve_backend
from ec_frontend.model.processor import InputProcessor
from ec_frontend.model.qwen2_text import TextShape
from ec_frontend.model.qwen2_vl import Qwen2VLModel
from ec_frontend.model.registry import ModelFamily, family_for

log = logging.getLogger(__name__)

__all__ = [
    "ModelLoadError",
    "ensure_builtin_checkpoint",
    "load_config",
    "load_model",
    "load_processor",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_path",
]

LOAD_FORMATS = ("auto", "safetensors", "dummy")
#: Files a served checkpoint needs from the hub (weights, configs, tokenizer, template).
HUB_FILE_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")
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


def resolve_model_path(model: str | Path, revision: str | None = None) -> Path:
    """A local checkpoint directory for ``--model``.

    An existing path is used as it is. Anything else that reads as a Hugging Face
    id (``org/name``) is looked up in the local Hugging Face cache
    (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``);
    when it is not there and the hub is not offline (``HF_HUB_OFFLINE`` unset),
    the checkpoint's files (:data:`HUB_FILE_PATTERNS`) are downloaded into that
    cache first. ``revision`` (a branch, tag or commit) picks the hub snapshot;
    a directory has none. Raises :class:`ModelLoadError`.
    """
    path = Path(model)
    if path.exists():
        if revision is not None:
            raise ModelLoadError(
                f"--revision {revision!r} applies to a Hugging Face id, not a directory"
            )
        return path
    name = str(model)
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        raise ModelLoadError(
            f"--model {name!r} is neither a checkpoint directory nor a Hugging Face id (org/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    patterns = list(HUB_FILE_PATTERNS)
    cache = _hub_cache_dir()
    try:
        return Path(
            snapshot_download(
                name,
                revision=revision,
                allow_patterns=patterns,
                cache_dir=cache,
                local_files_only=True,
            )
        )
    except LocalEntryNotFoundError:
        pass
    except HFValidationError as exc:
        raise ModelLoadError(f"--model {name!r} is not a valid Hugging Face id: {exc}") from None
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ModelLoadError(
            f"--model {name!r}: not a directory and not in the local Hugging Face cache "
            "(HF_HUB_OFFLINE is set; download it first: `hf download "
            f"{name}`, or unset HF_HUB_OFFLINE)"
        )
    try:
        return Path(
            snapshot_download(name, revision=revision, allow_patterns=patterns, cache_dir=cache)
        )
    except Exception as exc:
        raise ModelLoadError(
            f"--model {name!r}: download from the Hugging Face hub failed: {exc}"
        ) from None


def _hub_cache_dir() -> str | None:
    """The Hugging Face hub cache as the environment names it now (``huggingface_hub``
    reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def load_config(path: str | Path) -> PretrainedConfig:
    """The checkpoint's ``transformers`` config, checked to be of a registered family."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{directory} is not a checkpoint directory (no config.json)")
    try:
        raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory}/config.json cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{directory}/config.json is not a JSON object")
    family_for(raw)
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(directory)
        return config
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{directory}/config.json is not a valid config: {exc}") from None


def text_model_config(config: PretrainedConfig) -> TextShape:
    """The language-model shape of a checkpoint config of a registered family."""
    return family_for(config).text_config(config)


def load_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    load_vision: bool = True,
    load_language: bool = True,
    load_format: str = "auto",
    attention_backend: str = "auto",
) -> Qwen2VLModel:
    """Load a local checkpoint of a registered family.

    ``device`` defaults to CUDA when available, else CPU; ``dtype`` to bfloat16
    on CUDA, float32 elsewhere. ``load_vision`` / ``load_language`` choose the
    parts to build (an encoder-only instance needs no language model).
    ``load_format="dummy"`` skips the weight files and gives deterministic
    random weights for the config (for benchmarks of large shapes).
    ``attention_backend`` is resolved by
    :func:`~ec_frontend.model.paged_attention.resolve_backend` (a bad one raises
    its :class:`~ec_frontend.config.ConfigError`).
    Raises :class:`ModelLoadError`.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unsupported load_format {load_format!r}; use one of {LOAD_FORMATS}")
    directory = Path(path)
    config = load_config(directory)
    family = family_for(config)
    target_device = resolve_device(device)
    target_dtype = resolve_dtype(dtype, target_device)
    text_cfg = family.text_config(config)
    try:
        text_cfg.validate()
    except ValueError as exc:
        raise ModelLoadError(f"{family.name} config: {exc}") from None

    with parameters_on_meta():
        vision = family.build_vision(config) if load_vision else None
        language = family.build_language(text_cfg) if load_language else None
    parts: dict[str, nn.Module] = {
        name: part for name, part in (("vision", vision), ("language", language)) if part
    }
    if load_format == "dummy":
        gen = torch.Generator().manual_seed(0)
        for module in parts.values():
            _fill_random(module, target_device, target_dtype, gen)
    elif parts:
        skip = {"lm_head.weight"} if text_cfg.tie_word_embeddings else set()
        _stream_weights(directory, family, parts, target_device, target_dtype, skip)
    for name, module in parts.items():
        _finish(module, _PART_NAMES[name], target_device)
    if language is not None:
        language.attention_backend = resolve_backend(attention_backend, target_device)
    model_class: type[Qwen2VLModel] = family.model_type()
    return model_class(
        text_config=text_cfg,
        image_token_id=int(config.image_token_id),
        spatial_merge_size=family.spatial_merge_size(config),
        vision=vision,
        language=language,
        device=target_device,
        dtype=target_dtype,
    )


def load_processor(path: str | Path, *, model_id: str = "") -> InputProcessor:
    """The input processor of a local checkpoint (tokenizer, chat template, images).
    A checkpoint without a tokenizer or an image processor config is refused with
    :class:`ModelLoadError` naming the missing file."""
    directory = Path(path)
    config = load_config(directory)
    family = family_for(config)
    missing = tokenizer_problem(directory) or image_processor_problem(directory)
    if missing is not None:
        raise ModelLoadError(missing)
    try:
        processor_class: type[InputProcessor] = family.processor_type()
        return processor_class.from_pretrained(
            directory,
            config,
            model_id=model_id,
            positions=family.positions(config),
            spatial_merge_size=family.spatial_merge_size(config),
            image_tokens=functools.partial(family.num_image_tokens, config),
            video_rule=family.load_video_rule,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"{directory}: tokenizer or image processor cannot load: {exc}"
        ) from None


_PART_NAMES = {"vision": "vision tower", "language": "language model"}


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the ``meta`` device (no memory,
    and initialisation is a no-op); buffers (rotary frequencies) stay real. It
    patches ``nn.Module.register_parameter`` for the whole process while active:
    build nothing else concurrently (the engine loads before it serves).

    ``nn.Embedding``'s initialisation is skipped outright: ``normal_`` on a meta
    tensor runs through ``torch._refs``, whose first use imports ``torch._dynamo``
    (about 1.2 CPU-seconds of an engine start, for values nobody reads)."""
    original = nn.Module.register_parameter
    embedding_reset = nn.Embedding.reset_parameters

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        original(self, name, param)

    def no_reset(self: nn.Embedding) -> None:
        pass

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    nn.Embedding.reset_parameters = no_reset  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        nn.Embedding.reset_parameters = embedding_reset  # type: ignore[method-assign]


def _set_parameter(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


#: Values in the pool dummy weights are tiled from (a prime, so no row of a weight
#: matrix repeats another).
_DUMMY_POOL = 1_000_003


def _fill_random(
    module: nn.Module, device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """Seeded weights that keep activations of order one: norms at 1 (bias 0), other
    biases small, matrices with standard deviation ``1/sqrt(fan_in)``.

    Values come from one seeded pool of standard normals, each parameter reading it
    from its own offset and wrapping around: filling billions of values then costs
    a memory copy, not a random draw each (minutes on a CPU at 7B).
    """
    pool = torch.randn(_DUMMY_POOL, generator=gen).to(device=device, dtype=dtype)
    index = 0
    for owner_name, owner in module.named_modules():
        is_norm = "norm" in type(owner).__name__.lower()
        for attr, param in list(owner.named_parameters(recurse=False)):
            value = torch.empty(param.shape, device=device, dtype=dtype)
            if is_norm:
                value.fill_(1.0 if attr == "weight" else 0.0)
            else:
                _tile(value.view(-1), pool, index * 7919 % _DUMMY_POOL)
                value.mul_(0.02 if param.ndim == 1 else param[0].numel() ** -0.5)
            index += 1
            _set_parameter(module, f"{owner_name}.{attr}" if owner_name else attr, value)


def _tile(flat: torch.Tensor, pool: torch.Tensor, start: int) -> None:
    pos, cursor, n = 0, start, flat.numel()
    while pos < n:
        take = min(n - pos, pool.numel() - cursor)
        flat[pos : pos + take].copy_(pool[cursor : cursor + take])
        pos, cursor = pos + take, 0


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return str(device)


def _stream_weights(
    directory: Path,
    family: ModelFamily,
    parts: dict[str, nn.Module],
    device: torch.device,
    dtype: torch.dtype,
    skip: set[str],
) -> None:
    """Every wanted tensor straight from its shard into its parameter: one shard open
    at a time, one tensor in flight, cast on arrival."""
    expected = {
        part: {name: tuple(p.shape) for name, p in module.named_parameters()}
        for part, module in parts.items()
    }
    unexpected: dict[str, list[str]] = {part: [] for part in parts}
    files = _weight_files(directory)
    total = sum(f.stat().st_size for f in files)
    start = time.monotonic()
    done = 0
    for i, file in enumerate(files, 1):
        size = file.stat().st_size
        log.info(
            "loading weights: shard %d/%d %s (%.2f GiB; %.2f of %.2f GiB read)",
            i, len(files), file.name, size / 2**30, done / 2**30, total / 2**30,
        )  # fmt: skip
        done += size
        with safe_open(str(file), framework="pt", device=_safetensors_device(device)) as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                located = family.weight_part(key)
                if located is None or located[0] not in parts:
                    continue
                part, name = located
                if name in skip and part == "language":
                    continue
                shapes = expected[part]
                if name not in shapes:
                    unexpected[part].append(name)
                    continue
                shape = tuple(handle.get_slice(key).get_shape())
                if shape != shapes[name]:
                    raise ModelLoadError(
                        f"{_PART_NAMES[part]}: weight {name} has shape {shape}, "
                        f"expected {shapes[name]}"
                    )
                tensor = handle.get_tensor(key)
                if tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                _set_parameter(parts[part], name, tensor)
    log.info(
        "weights read: %d shard(s), %.2f GiB in %.1f s",
        len(files), total / 2**30, time.monotonic() - start,
    )  # fmt: skip
    for part, module in parts.items():
        missing = sorted(n for n, p in module.named_parameters() if p.device.type == "meta")
        extra = sorted(unexpected[part])
        if missing or extra:
            raise ModelLoadError(
                f"{_PART_NAMES[part]}: checkpoint weights do not match the config "
                f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''})"
            )


def _finish(module: nn.Module, what: str, device: torch.device) -> None:
    """Buffers to the device (rotary ``inv_freq`` stays float32), eval mode."""
    for name, buf in list(module.named_buffers()):
        if buf.device.type == "meta":
            raise ModelLoadError(f"{what}: buffer {name} was not initialised")
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._buffers[attr] = buf.to(device)
    module.eval()


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
