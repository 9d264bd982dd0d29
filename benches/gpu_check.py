"""The GPU check: what a machine with a CUDA device runs in one go (``gpu_check.sh``).

Two checks, each writing JSON under ``--out``:

* ``identity``: the built-in checkpoint decoded greedily by this engine and by
  transformers' ``Qwen2VLForConditionalGeneration.generate`` on the same device
  and dtype (bfloat16 on CUDA), text prompts and one with an image: the token ids
  and, where they differ, the first differing position;
* ``throughput``: a Qwen2-VL-2B-shaped checkpoint with random weights (this
  engine: ``load_format="dummy"``; transformers: the same config, its own random
  init) at batch 1, 8 and 32: generated tokens per second of this engine (all
  requests added at once, stepped to completion) against transformers'
  ``generate`` (``min_new_tokens = max_new_tokens``), and the ratio; this engine
  both as served (decode steps replayed from CUDA graphs) and with
  ``enforce_eager``, and that ratio.

Both also run on the CPU with ``--device cpu --shape tiny``: the smoke test of
this script on a machine without a GPU (the figures mean nothing there).

Run: ``python benches/gpu_check.py --out DIR [--device cuda] [--checks identity throughput]``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import io
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ec_frontend.config import CacheConfig, EngineConfig, SchedulerConfig
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.model.builtin import ensure_builtin_checkpoint
from ec_frontend.model.loader import load_model, load_processor
from ec_frontend.model.processor import ProcessedInputs
from PIL import Image

#: Qwen2-VL-2B-Instruct's published text and vision shapes.
SHAPE_2B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 1536,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "hidden_act": "quick_gelu",
    },
}
#: A small shape for the CPU smoke run.
SHAPE_TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
}


@dataclass(frozen=True, slots=True)
class Media:
    """What the processor reads of a media item: its bytes and ``mm_hash``."""

    data: bytes
    mm_hash: str


def png(seed: int, size: int = 112) -> Media:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return Media(buf.getvalue(), hashlib.blake2b(buf.getvalue(), digest_size=16).hexdigest())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_engine(core: EngineCore, inputs: list[ProcessedInputs], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, item in enumerate(inputs):
        core.add_request(f"r{i}", item, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(inputs))}
    while core.has_work():
        for out in core.step():
            if out.error:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            tokens[out.request_id] += out.token_ids
    return [tokens[f"r{i}"] for i in range(len(inputs))]


def hf_generate(hf: Any, item: ProcessedInputs, max_tokens: int, device: str) -> list[int]:
    ids = torch.tensor([item.prompt_token_ids], device=device)
    kwargs: dict[str, Any] = {}
    if item.mm_features:
        kwargs["pixel_values"] = torch.cat([f.pixel_values for f in item.mm_features]).to(
            device=device, dtype=hf.dtype
        )
        kwargs["image_grid_thw"] = torch.tensor(
            [list(f.image_grid_thw) for f in item.mm_features], device=device
        )
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        **kwargs,
    )
    return out[0, ids.shape[1] :].tolist()


def check_identity(device: str, dtype: str, max_tokens: int) -> dict[str, Any]:
    from transformers import Qwen2VLForConditionalGeneration

    path = ensure_builtin_checkpoint()
    processor = load_processor(path)
    prompts = [
        ("Tell me a story about a lighthouse.", []),
        ("Count from one to twenty in words.", []),
        ("What is in this picture?", [png(1)]),
    ]
    inputs = []
    for text, media in prompts:
        content: list[dict[str, Any]] = [
            {"type": "image", "media_index": i} for i in range(len(media))
        ]
        content.append({"type": "text", "text": text})
        inputs.append(processor.process_chat([{"role": "user", "content": content}], media))
    config = EngineConfig(
        model=str(path),
        device=device,
        dtype=dtype,
        cache=CacheConfig(kv_cache_memory_bytes=256 * 2**20),
    )
    model = load_model(path, device=device, dtype=dtype)
    ours = run_engine(EngineCore(config, model), inputs, max_tokens)
    del model
    _free(device)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).to(device)
    hf.eval()
    with torch.inference_mode():
        theirs = [hf_generate(hf, item, max_tokens, device) for item in inputs]
    cases = []
    for (text, media), a, b in zip(prompts, ours, theirs, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        cases.append(
            {
                "prompt": text,
                "images": len(media),
                "identical": a == b,
                "first_difference": first,
                "ours": a,
                "transformers": b,
            }
        )
    return {"device": device, "dtype": dtype, "max_tokens": max_tokens, "cases": cases}


def shaped_checkpoint(shape: dict[str, Any], directory: Path) -> Path:
    """The built-in checkpoint's tokenizer and processor files with ``shape``
    merged into its config (no weights: the engine loads it with ``dummy``)."""
    src = ensure_builtin_checkpoint()
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, directory / file.name)
    config = json.loads((src / "config.json").read_text())
    vision = {**config.get("vision_config", {}), **shape.get("vision_config", {})}
    config.update({k: v for k, v in shape.items() if k != "vision_config"})
    config["vision_config"] = vision
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def check_throughput(
    device: str, dtype: str, shape: dict[str, Any], batches: list[int], prompt: int, new: int
) -> dict[str, Any]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = shaped_checkpoint(shape, Path(tmp))
        gen = torch.Generator().manual_seed(0)
        vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
        top = min(vocab, 500)
        prompts = {
            b: [torch.randint(0, top, (prompt,), generator=gen).tolist() for _ in range(b)]
            for b in batches
        }
        model = load_model(path, device=device, dtype=dtype, load_format="dummy")
        # The engine as served (decode steps replayed from CUDA graphs where the
        # device allows), then with --enforce-eager.
        ours: dict[str, dict[int, float]] = {"graphs": {}, "eager": {}}
        for mode, rates in ours.items():
            config = EngineConfig(
                model=str(path),
                device=device,
                dtype=dtype,
                scheduler=SchedulerConfig(
                    max_num_seqs=max(batches),
                    max_num_batched_tokens=max(2048, max(batches) * prompt),
                    max_model_len=prompt + new + 16,
                ),
                cache=CacheConfig(
                    kv_cache_memory_bytes=4 * 2**30 if device != "cpu" else 2**28,
                    enforce_eager=mode == "eager",
                ),
            )
            core = EngineCore(config, model)
            with torch.inference_mode():
                run_engine(core, [_text(prompts[batches[0]][0])], 2)  # warm-up
                for b in batches:
                    _sync(device)
                    start = time.perf_counter()
                    run_engine(core, [_text(p) for p in prompts[b]], new)
                    _sync(device)
                    rates[b] = b * new / (time.perf_counter() - start)
            graph_replays = core.stats().lm_graph_replays_total
            if mode == "graphs":
                ours_replays = graph_replays
            del core
            _free(device)
        del model
        _free(device)
        hf_config = Qwen2VLConfig.from_pretrained(path)
        with torch.device(device):
            hf = Qwen2VLForConditionalGeneration._from_config(
                hf_config, dtype=getattr(torch, dtype), attn_implementation="sdpa"
            )
        hf.eval()
        with torch.inference_mode():
            ids = torch.tensor(prompts[batches[0]][:1], device=device)
            hf.generate(input_ids=ids, max_new_tokens=2, do_sample=False)  # warm-up
            for b in batches:
                ids = torch.tensor(prompts[b], device=device)
                _sync(device)
                start = time.perf_counter()
                hf.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                )
                _sync(device)
                theirs = b * new / (time.perf_counter() - start)
                rows.append(
                    {
                        "batch": b,
                        "ours_tok_s": ours["graphs"][b],
                        "ours_eager_tok_s": ours["eager"][b],
                        "transformers_tok_s": theirs,
                        "ratio": ours["graphs"][b] / theirs,
                        "graphs_vs_eager": ours["graphs"][b] / ours["eager"][b],
                    }
                )
        del hf
        _free(device)
    return {
        "device": device,
        "dtype": dtype,
        "shape": shape,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "graph_replays": ours_replays,
        "rows": rows,
    }


def _text(ids: list[int]) -> ProcessedInputs:
    return ProcessedInputs(ids, [], torch.arange(len(ids)).expand(3, -1), 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--checks", nargs="+", default=["identity", "throughput"])
    ap.add_argument("--shape", choices=["2b", "tiny"], default="2b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--identity-tokens", type=int, default=32)
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.out.mkdir(parents=True, exist_ok=True)
    host = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    failed = False
    if "identity" in args.checks:
        result = check_identity(args.device, dtype, args.identity_tokens)
        result["host"] = host
        (args.out / "gpu_identity.json").write_text(json.dumps(result, indent=2) + "\n")
        for case in result["cases"]:
            print(
                f"identity {case['prompt'][:32]!r:36s} images={case['images']} "
                f"identical={case['identical']} first_difference={case['first_difference']}"
            )
            failed |= not case["identical"]
    if "throughput" in args.checks:
        shape = SHAPE_2B if args.shape == "2b" else SHAPE_TINY
        result = check_throughput(args.device, dtype, shape, args.batches, args.prompt, args.new)
        result["host"] = host
        (args.out / "gpu_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
        for row in result["rows"]:
            print(
                f"throughput batch {row['batch']:3d}: ours {row['ours_tok_s']:9.1f} tok/s  "
                f"transformers {row['transformers_tok_s']:9.1f} tok/s  ratio {row['ratio']:.2f}x  "
                f"(eager {row['ours_eager_tok_s']:9.1f} tok/s, "
                f"graphs {row['graphs_vs_eager']:.2f}x)"
            )
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
