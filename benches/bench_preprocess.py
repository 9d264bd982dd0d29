"""Image preprocessing: the native (Rust) Qwen2-VL path against transformers' two
backends as the server would run them (Pillow decode + RGB, then the image processor):
the PIL backend (``Qwen2VLImageProcessorPil``, what this environment runs) and the
torchvision backend (``Qwen2VLImageProcessor``; torchvision is a test-only install in
``.venv/extras/torchvision``, so that path runs in a child process with it on
``PYTHONPATH``).

1. ms per image, one thread (torch and rayon), Qwen2-VL checkpoint pixel range (min
   3136, max 12845056): 1280x720 JPEG, 448x448 PNG, 3000x4000 JPEG. Medians of the
   calling thread's CPU time and of wall time, native and PIL calls interleaved.
   With them, two stages the native path cannot go below: its decode alone
   (``_core.decode_rgb``; for JPEG the libjpeg-turbo that Pillow links, whose bytes
   it must reproduce) and one write of a ``pixel_values``-sized float32 buffer,
   as a share of the 8x-vs-PIL budget (PIL's time / 8).
2. Scaling: images per second with 1 and 2 concurrent Python threads calling each
   path (the native call releases the GIL; transformers' mostly holds it).
3. End to end: ``ec-frontend serve --mock-engine`` whose mock processor runs the
   image path (``EC_FRONTEND_MOCK_IMAGE_MODEL``), chat requests with 4 x 1280x720
   JPEGs each (all distinct: the native path decodes known bytes only once),
   requests/s and server CPU seconds per request, native vs transformers PIL
   (``EC_FRONTEND_DISABLE_NATIVE_PREPROCESS=1``).

Writes ``benches/results/bench_preprocess.json``.

Run: ``.venv/bin/python benches/bench_preprocess.py [--quick]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from ec_frontend import _core
from ec_frontend.model.builtin import ensure_builtin_checkpoint
from ec_frontend.model.media import decode_image
from ec_frontend.model.native_preprocess import DISABLE_ENV, native_preprocessor_for
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import launch_server

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
TORCHVISION_DIR = ROOT / ".venv" / "extras" / "torchvision"
#: Qwen2-VL-7B-Instruct's preprocessor_config.json pixel range.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384


def photo(h: int, w: int, seed: int) -> Image.Image:
    """Photo-like content: smooth colour fields plus sensor noise."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(h // 40, 2), max(w // 40, 2), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC))
    noise = rng.normal(0, 6, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def encoded(fmt: str, h: int, w: int, seed: int = 0) -> bytes:
    out = io.BytesIO()
    kwargs: dict[str, Any] = {"quality": 90} if fmt == "JPEG" else {}
    photo(h, w, seed).save(out, fmt, **kwargs)
    return out.getvalue()


def processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def transformers_path(ip: Any, data: bytes) -> Any:
    image = decode_image(data, index=0, max_pixels=200_000_000)
    return ip(images=[image], return_tensors="pt")["pixel_values"]


def timed(fns: dict[str, Any], repeat: int) -> dict[str, tuple[float, float]]:
    """Per function, median (CPU seconds of the calling thread, wall seconds) of
    ``repeat`` calls after one warm-up, the functions called in turn so that each
    round sees the same host load. Every path runs on the calling thread (one torch
    thread; one image is one rayon task), so thread CPU time is its cost, which the
    other sessions on this shared host inflate far less than wall time."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            c, t = time.thread_time(), time.perf_counter()
            fn()
            samples[name].append((time.thread_time() - c, time.perf_counter() - t))
    return {
        name: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
        for name, v in samples.items()
    }


def test_images(quick: bool) -> list[tuple[str, bytes, int]]:
    """``(name, bytes, repeats)`` of the per-image table."""
    return [
        ("1280x720 JPEG", encoded("JPEG", 720, 1280), 3 if quick else 10),
        ("448x448 PNG", encoded("PNG", 448, 448), 5 if quick else 20),
        ("3000x4000 JPEG", encoded("JPEG", 4000, 3000), 1 if quick else 3),
    ]


def rates(fn: Any, per_thread: int) -> list[float]:
    """Images/s of 1 and 2 threads each calling ``fn`` ``per_thread`` times."""
    fn()
    out = []
    for threads in (1, 2):
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: [fn() for _ in range(per_thread)], range(threads)))
        out.append(threads * per_thread / (time.perf_counter() - start))
    return out


def torchvision_worker(quick: bool) -> None:
    """In the child process: the torchvision backend's timings, as JSON on stdout."""
    import torch
    import torchvision
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    ip = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    torch.set_num_threads(1)
    per_image = {
        name: timed({"tv": lambda d=data: transformers_path(ip, d)}, repeat)["tv"]
        for name, data, repeat in test_images(quick)
    }
    torch.set_num_threads(2)
    data = encoded("JPEG", 720, 1280)
    scaling = rates(lambda: transformers_path(ip, data), 4 if quick else 12)
    print(json.dumps({"version": torchvision.__version__, "per_image": per_image,
                      "scaling": scaling}))  # fmt: skip


def torchvision_timings(quick: bool) -> dict[str, Any] | None:
    """The torchvision backend's timings from a child process, or ``None`` (said why)."""
    if not (TORCHVISION_DIR / "torchvision").is_dir():
        print(f"torchvision: not installed in {TORCHVISION_DIR} (scripts/setup.sh installs it)")
        return None
    args = [sys.executable, __file__, "--torchvision-worker"] + (["--quick"] if quick else [])
    env = dict(os.environ, PYTHONPATH=str(TORCHVISION_DIR))
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_image(quick: bool, tv: dict[str, Any] | None) -> list[dict[str, Any]]:
    ip = processor()
    native = native_preprocessor_for(ip, max_image_pixels=200_000_000)
    assert native is not None
    rows = []
    for name, data, repeat in test_images(quick):
        ((_, pixel_values),) = native.preprocess([data], [0])
        out = np.empty(pixel_values.numel(), dtype=np.float32)
        got = timed(
            {
                "pil": lambda d=data: transformers_path(ip, d),
                "native": lambda d=data: native.preprocess([d], [0]),
                "native_decode": lambda d=data: _core.decode_rgb(d, max_image_pixels=200_000_000),
                "write_output": lambda o=out: o.fill(0.5),
            },
            repeat,
        )
        stages = {label: got.pop(label) for label in ("native_decode", "write_output")}
        if tv is not None:
            got["torchvision"] = tuple(tv["per_image"][name])
        row: dict[str, Any] = {"image": name}
        line = f"{name:15s}"
        for label, (cpu, wall) in got.items():
            row[f"{label}_cpu_ms"] = round(cpu * 1e3, 2)
            row[f"{label}_wall_ms"] = round(wall * 1e3, 2)
            line += f"  {label} {cpu * 1e3:7.1f} ms"
        for label in ("pil", "torchvision"):
            if label in got:
                row[f"speedup_vs_{label}_cpu"] = round(got[label][0] / got["native"][0], 1)
                row[f"speedup_vs_{label}_wall"] = round(got[label][1] / got["native"][1], 1)
                line += f"  x{row[f'speedup_vs_{label}_cpu']} vs {label}"
        # What the native path cannot go below: decoding (libjpeg-turbo for JPEG, as in
        # Pillow; the bytes must be Pillow's) and writing pixel_values once.
        decode, write = stages["native_decode"][0], stages["write_output"][0]
        row["native_decode_cpu_ms"] = round(decode * 1e3, 2)
        row["write_output_cpu_ms"] = round(write * 1e3, 2)
        budget = got["pil"][0] / 8
        row["decode_plus_write_share_of_8x_budget"] = round((decode + write) / budget, 2)
        rows.append(row)
        print(line + "  (thread CPU, median)")
        print(
            f"{'':15s}  native decode {decode * 1e3:.1f} ms + one write of pixel_values "
            f"{write * 1e3:.1f} ms = {row['decode_plus_write_share_of_8x_budget']:.0%} of the "
            f"8x budget ({budget * 1e3:.1f} ms); resize, normalize and patchify "
            f"get the rest"
        )
    return rows


def scaling(quick: bool, tv: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Images/s of N threads each preprocessing 1280x720 JPEGs one call at a time."""
    ip = processor()
    native = native_preprocessor_for(ip, max_image_pixels=200_000_000)
    assert native is not None
    data = encoded("JPEG", 720, 1280)
    per_thread = 4 if quick else 12
    measured = {
        "transformers_pil": rates(lambda: transformers_path(ip, data), per_thread),
        "native": rates(lambda: native.preprocess([data], [0]), per_thread),
    }
    if tv is not None:
        measured["transformers_torchvision"] = tv["scaling"]
    rows = []
    for label, per in measured.items():
        for threads, rate in zip((1, 2), per, strict=True):
            rows.append({"path": label, "threads": threads, "images_per_s": round(rate, 1)})
            print(f"{label:24s} {threads} thread(s): {rate:6.1f} images/s")
    return rows


def image_model_dir(tmp: Path) -> Path:
    """The built-in checkpoint with Qwen2-VL's real pixel range in its image config."""
    src = ensure_builtin_checkpoint(tmp / "cache")
    dst = tmp / "qwen2-vl-pixels"
    shutil.copytree(src, dst)
    cfg_path = dst / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    cfg["size"] = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    cfg_path.write_text(json.dumps(cfg))
    return dst


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def end_to_end(quick: bool, tmp: Path) -> list[dict[str, Any]]:
    model_dir = image_model_dir(tmp)
    n_requests = 8 if quick else 24

    def body(i: int) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": "compare these"}]
        for k in range(4):
            data = encoded("JPEG", 720, 1280, seed=1000 + 4 * i + k)
            url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
            content.append({"type": "image_url", "image_url": {"url": url}})
        return {"model": "mock", "messages": [{"role": "user", "content": content}],
                "max_tokens": 4}  # fmt: skip

    bodies = [body(i) for i in range(n_requests + 1)]
    rows = []
    for label, disable in (("transformers_pil", "1"), ("native", "0")):
        os.environ["EC_FRONTEND_MOCK_IMAGE_MODEL"] = str(model_dir)
        os.environ[DISABLE_ENV] = disable
        proc, url = launch_server(["--mock-engine", "--log-level", "warning"])
        try:
            with httpx.Client(timeout=300) as client:
                client.post(url + "/v1/chat/completions", json=bodies[-1]).raise_for_status()
                cpu0 = cpu_seconds(proc.pid)
                start = time.perf_counter()

                def send(i: int, c: httpx.Client = client, u: str = url) -> None:
                    c.post(u + "/v1/chat/completions", json=bodies[i]).raise_for_status()

                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(send, range(n_requests)))
                elapsed = time.perf_counter() - start
                cpu = cpu_seconds(proc.pid) - cpu0
                images = httpx.get(url + "/metrics").text
        finally:
            proc.terminate()
            proc.wait(30)
        counted = [ln for ln in images.splitlines() if ln.startswith("ec_frontend_images_pre")]
        rows.append(
            {
                "path": label,
                "requests_per_s": round(n_requests / elapsed, 2),
                "server_cpu_s_per_request": round(cpu / n_requests, 3),
                "metric": counted[0] if counted else None,
            }
        )
        print(f"{label:16s} {n_requests / elapsed:6.2f} requests/s  "
              f"{cpu / n_requests:6.3f} server CPU s/request  {rows[-1]['metric']}")  # fmt: skip
    for key in ("EC_FRONTEND_MOCK_IMAGE_MODEL", DISABLE_ENV):
        os.environ.pop(key, None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--torchvision-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchvision_worker:
        torchvision_worker(args.quick)
        return
    import torch

    torch.set_num_threads(1)
    tv = torchvision_timings(args.quick)
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "pixel_range": [MIN_PIXELS, MAX_PIXELS],
        "torch_threads_per_image": 1,
        "torchvision": tv["version"] if tv else "not installed (not measured)",
    }
    result["per_image_one_thread"] = per_image(args.quick, tv)
    torch.set_num_threads(2)
    result["scaling_1280x720_jpeg"] = scaling(args.quick, tv)
    if not args.skip_e2e:
        with tempfile.TemporaryDirectory() as tmp:
            result["end_to_end_mock_engine_4x1280x720"] = end_to_end(args.quick, Path(tmp))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "bench_preprocess.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
