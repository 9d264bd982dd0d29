"""Request parsing: ec_frontend.parse_request against a pydantic mirror of vLLM's request
model and against orjson.loads; inline-media decode + hash against Python's base64 +
hashlib. Every figure of a case is measured interleaved in one run, so the ratios
compare like with like on a busy machine.

Run: ``.venv/bin/python benches/bench_parse.py`` (``--quick`` for a smoke run). Prints a
table and writes ``benches/results/bench_parse.json``.
"""

from __future__ import annotations

import argparse
import base64
import gc
import hashlib
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ec_frontend as ecf
import orjson

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "benches" / "fixtures"
RESULTS = ROOT / "benches" / "results" / "bench_parse.json"
MODEL_ID = "tiny-qwen2-vl"


def _load_mirror() -> Any:
    """The pydantic mirrors of vLLM's ChatCompletionRequest that the parity test uses."""
    path = ROOT / "tests" / "core" / "vllm_mirror.py"
    spec = importlib.util.spec_from_file_location("vllm_mirror", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_mirror"] = module
    spec.loader.exec_module(module)
    return module


def _image_request() -> tuple[bytes, str, bytes]:
    """A chat body with one 1 MiB (decoded) inline image; also its URL and raw bytes."""
    raw = random.Random(1).randbytes(1 << 20)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    return json.dumps(body).encode(), url, raw


def _time_per_call(fn: Callable[[], object], budget_s: float) -> float:
    """Seconds per call of ``fn``, from as many calls as fit in ``budget_s``."""
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            return elapsed / calls
        calls = max(calls * 2, int(calls * budget_s / max(elapsed, 1e-9)) + 1)


def measure(
    impls: dict[str, Callable[[], object]], rounds: int, budget_s: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per call of each implementation, interleaved round by round: the best
    round (timeit's convention: other processes only ever add time) and the median."""
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for fn in impls.values():
        fn()
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in impls.items():
                samples[name].append(_time_per_call(fn, budget_s))
    finally:
        gc.enable()
    best = {name: min(values) for name, values in samples.items()}
    median = {name: statistics.median(values) for name, values in samples.items()}
    return best, median


def _parse_and_read(body: bytes) -> Callable[[], object]:
    """parse_request plus what a server reads next: sampling, messages, media bytes."""

    def run() -> object:
        req = ecf.parse_request("chat", body, model_id=MODEL_ID)
        return req.sampling, req.messages, [m.data for m in req.media]

    return run


def _pydantic_with_media(mirror: Any, body: bytes) -> Callable[[], object]:
    """The pydantic path plus what it leaves for later and ``parse_request`` already
    does: decode each inline image and hash it (``hashlib.blake2b``), hash each uuid."""

    def run() -> object:
        req = mirror.model_validate_json(body)
        params = req.to_sampling_params()
        hashes = []
        for message in req.messages:
            if not isinstance(message.content, list):
                continue
            for part in message.content:
                if part.type != "image_url":
                    continue
                url = part.image_url.url
                if part.uuid is not None:
                    hashes.append(hashlib.blake2b(part.uuid.encode()).hexdigest())
                elif url.startswith("data:"):
                    data = base64.b64decode(url.split(",", 1)[1])
                    hashes.append(hashlib.blake2b(data).hexdigest())
        return params, hashes

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rounds, budget = (3, 0.02) if args.quick else (40, 0.03)
    mirrors = _load_mirror()
    mirror, full_mirror = mirrors.ChatCompletionRequest, mirrors.FullChatCompletionRequest
    image_body, image_url, image_raw = _image_request()
    cases = {
        "small_text": (FIXTURES / "chat_small.json").read_bytes(),
        "multimodal_2_5k": (FIXTURES / "chat_mm_2_5k.json").read_bytes(),
        "image_1mb": image_body,
    }
    results: dict[str, Any] = {
        "command": "python benches/bench_parse.py" + (" --quick" if args.quick else ""),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "rounds": rounds,
        "cases": {},
    }
    print(f"{'case':<18} {'impl':<26} {'us/call (best round)':>10}")
    for case, body in cases.items():
        impls: dict[str, Callable[[], object]] = {
            "ec_parse_request": lambda b=body: ecf.parse_request("chat", b, model_id=MODEL_ID),
            "ec_parse_and_read": _parse_and_read(body),
            "pydantic_mirror": lambda b=body: mirror.model_validate_json(b).to_sampling_params(),
            "pydantic_mirror_and_media": _pydantic_with_media(mirror, body),
            "pydantic_full_mirror": lambda b=body: full_mirror.model_validate_json(
                b
            ).to_sampling_params(),
            "orjson_loads": lambda b=body: orjson.loads(b),
        }
        best, typical = measure(impls, rounds, budget)
        ours = best["ec_parse_request"]
        ratios = {
            "pydantic_over_ec": best["pydantic_mirror"] / ours,
            "pydantic_and_media_over_ec": best["pydantic_mirror_and_media"] / ours,
            "pydantic_full_over_ec": best["pydantic_full_mirror"] / ours,
            "ec_over_orjson": ours / best["orjson_loads"],
            "ec_read_over_orjson": best["ec_parse_and_read"] / best["orjson_loads"],
        }
        results["cases"][case] = {
            "body_bytes": len(body),
            "best_us": {k: v * 1e6 for k, v in best.items()},
            "median_us": {k: v * 1e6 for k, v in typical.items()},
            "ratios_of_best": ratios,
        }
        for name, seconds in best.items():
            print(f"{case:<18} {name:<26} {seconds * 1e6:>10.2f}")
        print(
            f"{case:<18} pydantic/ec {ratios['pydantic_over_ec']:.2f}x   "
            f"pydantic+media/ec {ratios['pydantic_and_media_over_ec']:.2f}x   "
            f"pydantic-full/ec {ratios['pydantic_full_over_ec']:.2f}x   "
            f"ec/orjson {ratios['ec_over_orjson']:.2f}x   "
            f"ec+read/orjson {ratios['ec_read_over_orjson']:.2f}x"
        )

    expected_hash = ecf.compute_mm_hash(image_raw, model_id=MODEL_ID)
    if ecf.compute_mm_hash(ecf.decode_data_url(image_url)[1], model_id=MODEL_ID) != expected_hash:
        raise RuntimeError("decode + hash does not round-trip")
    payload = image_url.split(",", 1)[1]
    media, media_typical = measure(
        {
            "ec_decode_and_blake3": lambda: ecf.compute_mm_hash(
                ecf.decode_data_url(image_url)[1], model_id=MODEL_ID
            ),
            "python_b64decode_sha256": lambda: hashlib.sha256(
                base64.b64decode(payload)
            ).hexdigest(),
            "python_b64decode_blake2b": lambda: hashlib.blake2b(
                base64.b64decode(payload)
            ).hexdigest(),
        },
        rounds,
        budget,
    )
    ec_media = media["ec_decode_and_blake3"]
    media_ratios = {
        "python_sha256_over_ec": media["python_b64decode_sha256"] / ec_media,
        "python_blake2b_over_ec": media["python_b64decode_blake2b"] / ec_media,
    }
    results["media_1mb"] = {
        "best_us": {k: v * 1e6 for k, v in media.items()},
        "median_us": {k: v * 1e6 for k, v in media_typical.items()},
        "ratios_of_best": media_ratios,
    }
    for name, seconds in media.items():
        print(f"{'media_1mb':<18} {name:<26} {seconds * 1e6:>10.2f}")
    print(
        f"{'media_1mb':<18} sha256/ec {media_ratios['python_sha256_over_ec']:.2f}x   "
        f"blake2b/ec {media_ratios['python_blake2b_over_ec']:.2f}x"
    )

    mm = results["cases"]["multimodal_2_5k"]["ratios_of_best"]
    results["goals"] = {
        "mm_2_5k_at_least_3x_faster_than_pydantic": mm["pydantic_over_ec"] >= 3.0,
        "mm_2_5k_at_least_3x_faster_than_full_pydantic": mm["pydantic_full_over_ec"] >= 3.0,
        "mm_2_5k_within_2x_of_orjson": mm["ec_over_orjson"] <= 2.0,
        "media_1mb_at_least_2x_faster_than_python": min(media_ratios.values()) >= 2.0,
    }
    print("goals:", json.dumps(results["goals"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
