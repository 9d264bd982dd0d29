"""Output tokens/s of ec-frontend against ``transformers`` ``generate`` per model family.

For each family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-1.5, LLaVA-NeXT,
LLaVA-OneVision) a mid-size
random checkpoint is written with ``transformers``' own classes (decoder hidden 1024
in 8 layers; the vision tower at its real depth, narrowed), then the same workload
runs on both:
one image plus a short question, ``--max-tokens`` greedy tokens with EOS ignored,

* ec-frontend: ``ec-frontend serve`` on loopback, streaming chat completions,
  1 request, then 8 concurrent requests;
* transformers: ``generate(do_sample=False, min_new_tokens=max_new_tokens)`` on the
  processor's batch of 1, then of 8 (the 8 concurrent requests as one batch).

Both sides run on the CPU in float32 with the same number of torch threads
(``--threads``); one run each. Writes ``benches/results/bench_models.json``
(a run of some ``--families`` replaces those families' rows and keeps the others).

Run: ``.venv/bin/python benches/bench_models.py [--threads 2] [--max-tokens 32]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))

from bench_serving import launch_server  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import (  # noqa: E402
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
    LlavaOnevisionForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from tests.families import conftest as ckpt  # noqa: E402

RESULTS = ROOT / "benches" / "results"
TEXT = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
#: Real depths (Qwen2-VL / Qwen2.5-VL: 32 blocks; Qwen3-VL-2B/4B: 24 blocks with DeepStack
#: mergers after blocks 5, 11 and 17; CLIP ViT-L: 24 layers at 336 px), width 256.
FAMILIES: dict[str, tuple[Any, dict[str, Any], Any, Any]] = {
    "Qwen2-VL": (
        ckpt.write_qwen2_vl,
        {"depth": 32, "embed_dim": 256, "mlp_ratio": 4, "num_heads": 4},
        Qwen2VLForConditionalGeneration,
        ckpt.load_hf_processor,
    ),
    "Qwen2.5-VL": (
        ckpt.write_qwen2_5_vl,
        {
            "depth": 32,
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_heads": 4,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
        Qwen2_5_VLForConditionalGeneration,
        ckpt.load_hf_processor,
    ),
    "Qwen3-VL": (
        # head_dim given explicitly (Qwen3's config defaults it to 128): hidden / heads.
        lambda directory, text, vision: ckpt.write_qwen3_vl(
            directory, {**text, "head_dim": 64}, vision
        ),
        {
            "depth": 24,
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_heads": 4,
            "patch_size": 16,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
        },
        Qwen3VLForConditionalGeneration,
        functools.partial(ckpt.load_hf_processor, processor_class=ckpt.ImageOnlyQwen3VLProcessor),
    ),
    "LLaVA-1.5": (
        functools.partial(ckpt.write_llava, image_size=336),
        {
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_hidden_layers": 24,
            "num_attention_heads": 4,
        },
        LlavaForConditionalGeneration,
        ckpt.load_hf_llava_processor,
    ),
    # LLaVA-1.5's tower at 336 px tiles over LLaVA-NeXT's five resolutions.
    "LLaVA-NeXT": (
        functools.partial(ckpt.write_llava_next, image_size=336),
        {
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_hidden_layers": 24,
            "num_attention_heads": 4,
        },
        LlavaNextForConditionalGeneration,
        ckpt.load_hf_llava_next_processor,
    ),
    # SigLIP-so400m's depth (27 layers, 14 px patches at 384 px), width 256; anyres over
    # 1 to 6 tiles a side: a 224 px picture is its base tile plus one tile.
    "LLaVA-OneVision": (
        functools.partial(ckpt.write_llava_onevision, image_size=384),
        {
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_hidden_layers": 27,
            "num_attention_heads": 4,
        },
        LlavaOnevisionForConditionalGeneration,
        ckpt.load_hf_llava_onevision_processor,
    ),
}
QUESTION = "Describe this picture in detail."
IMAGE_SIZE = 224


def image_png() -> bytes:
    return ckpt.image_bytes(IMAGE_SIZE, IMAGE_SIZE, seed=7)


async def served_rate(url: str, n: int, max_tokens: int) -> float:
    """Output tokens/s of ``n`` concurrent chat completions (after one warm-up request)."""
    content = [
        {"type": "image_url", "image_url": {"url": ckpt.data_url(image_png())}},
        {"type": "text", "text": QUESTION},
    ]
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
    }

    async def one(client: httpx.AsyncClient) -> int:
        r = await client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=600) as client:
        await one(client)  # warm-up
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(client) for _ in range(n)))
        return sum(tokens) / (time.perf_counter() - start)


def hf_rate(model: Any, processor: Any, n: int, max_tokens: int) -> float:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(image_png())) for _ in range(n)]
    inputs = processor(text=[text] * n, images=images, return_tensors="pt")
    kwargs = {"do_sample": False, "max_new_tokens": max_tokens, "min_new_tokens": max_tokens}
    with torch.no_grad():
        model.generate(**inputs, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        out = model.generate(**inputs, **kwargs)
    elapsed = time.perf_counter() - start
    return (out.shape[0] * (out.shape[1] - inputs["input_ids"].shape[1])) / elapsed


def bench_family(name: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    write, vision, model_class, load_processor = FAMILIES[name]
    directory = write(root / name, TEXT, vision)
    proc, url = launch_server(
        [
            "--model",
            str(directory),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--log-level",
            "warning",
            "--cpu-threads",
            str(args.threads),
            "--max-num-seqs",
            "8",
        ]
    )
    try:
        ours = {n: asyncio.run(served_rate(url, n, args.max_tokens)) for n in (1, 8)}
    finally:
        proc.terminate()
        proc.wait(60)
    torch.set_num_threads(args.threads)
    model = model_class.from_pretrained(directory, dtype=torch.float32).eval()
    params = {"parameters": sum(p.numel() for p in model.parameters())}
    processor = load_processor(directory)
    theirs = {n: hf_rate(model, processor, n, args.max_tokens) for n in (1, 8)}
    del model
    row = {"family": name, **params}
    for n in (1, 8):
        row[f"ec_frontend_tok_s_{n}"] = round(ours[n], 2)
        row[f"transformers_tok_s_{n}"] = round(theirs[n], 2)
        row[f"ratio_{n}"] = round(ours[n] / theirs[n], 3)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-models-"))
    try:
        rows = [bench_family(name, root, args) for name in args.families]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "bench": "bench_models",
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "image": f"{IMAGE_SIZE}x{IMAGE_SIZE}",
        "text_shape": TEXT,
        "host": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "rows": rows,
    }
    path = RESULTS / "bench_models.json"
    result["rows"] = _merged_rows(path, rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def _merged_rows(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows``, plus the earlier rows of ``path`` for families this run left out,
    in :data:`FAMILIES` order."""
    by_family = {}
    if path.is_file():
        by_family = {r["family"]: r for r in json.loads(path.read_text()).get("rows", [])}
    by_family.update({r["family"]: r for r in rows})
    return [by_family[name] for name in FAMILIES if name in by_family]


if __name__ == "__main__":
    main()
