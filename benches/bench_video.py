"""Video: decode + preprocess of one clip, ours against transformers', in one run.

The clip is written by PyAV at run time: 10 s of 1280x720 H.264 (libx264, 30 fps,
a keyframe every 30 frames, moving photo-like content), in an MP4. 32 frames are
sampled (vLLM's default ``num_frames``), spread by ``linspace`` over the 300.

* **ours**: the file's bytes -> ``model/video.py``'s ``decode_video`` (demux pass,
  keyframe seeks, the 32 frames converted to RGB) -> the Qwen2-VL video rule
  (``model/video_processor.py``'s ``QwenVideoRule``), as the server runs a video
  part. Both stages are timed, and the rule's Python path (Pillow resize, torch
  normalize and patchify) beside the native one when the rule has it.
* **transformers**: its own video loading, ``transformers.video_utils.load_video``
  (``backend="pyav"``: the only backend installed here, and the default; it decodes
  from the first frame to the last sampled one and converts the sampled ones to
  RGB), then ``Qwen2VLVideoProcessor`` (torchvision: the class requires it; the
  test-only install in ``<venv>/extras/torchvision`` is put on ``sys.path``) on the
  same 32 frames with ``do_sample_frames=False`` (``load_video`` is given vLLM's
  ``linspace`` indices as its ``sample_indices_fn``, so both decode the same
  frames). This is transformers' fastest path in this environment: ``decord`` /
  ``torchcodec`` / ``opencv`` are not installed, and its processor given a path
  calls the same ``load_video``.

Both sides use the same pixel range (transformers' class defaults: min 100,352,
max 602,112 pixels): the frames become 560x1008, grid (16, 40, 72), 46,080 rows.
Rounds alternate the two sides; the figures are medians of wall time. The
``pixel_values_videos`` of the two are compared (shapes equal; the max |difference|
is printed: frames that are resized differ by torchvision's resampling, see
``docs/video.md``).

Writes ``benches/results/bench_video.json``.

Run: ``.venv/bin/python benches/bench_video.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from ec_frontend.model.video import VideoLimits, VideoSampling, decode_video
from ec_frontend.model.video_processor import QwenVideoRule

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
TORCHVISION_DIR = Path(sys.prefix) / "extras" / "torchvision"
WIDTH, HEIGHT, RATE, SECONDS, GOP, NUM_FRAMES = 1280, 720, 30, 10, 30, 32


def make_clip() -> bytes:
    """The benchmark clip: a smooth colour field panning across the frame, plus
    per-frame noise (so every frame carries detail, as a camera's would)."""
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (HEIGHT // 40 + 2, WIDTH // 40 + 40, 3), dtype=np.uint8)
    field = np.repeat(np.repeat(small, 40, axis=0), 40, axis=1).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=RATE)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.gop_size = GOP
        stream.codec_context.options = {"preset": "veryfast", "crf": "20", "keyint_min": str(GOP)}
        for i in range(RATE * SECONDS):
            x = (i * 4) % (field.shape[1] - WIDTH)
            noise = rng.integers(-8, 9, (HEIGHT, WIDTH, 3), dtype=np.int16)
            rgb = np.clip(field[:HEIGHT, x : x + WIDTH] + noise, 0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def keyframe_interval(data: bytes) -> int:
    """Frames from the first keyframe to the second."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        keys = sorted(p.pts for p in c.demux(stream) if p.pts is not None and p.is_keyframe)
        if len(keys) < 2:
            return 0
        return round(float((keys[1] - keys[0]) * stream.time_base * stream.average_rate))


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    if not (TORCHVISION_DIR / "torchvision").is_dir():
        sys.exit(f"the test-only torchvision is not in {TORCHVISION_DIR} (scripts/setup.sh)")
    sys.path.insert(0, str(TORCHVISION_DIR))
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import load_video

    data = make_clip()
    hf = Qwen2VLVideoProcessor()
    rule = QwenVideoRule(
        min_pixels=int(hf.size["shortest_edge"]),
        max_pixels=int(hf.size["longest_edge"]),
        patch_size=int(hf.patch_size),
        temporal_patch_size=int(hf.temporal_patch_size),
        merge_size=int(hf.merge_size),
        image_mean=tuple(float(v) for v in hf.image_mean),  # type: ignore[arg-type]
        image_std=tuple(float(v) for v in hf.image_std),  # type: ignore[arg-type]
        rescale_factor=float(hf.rescale_factor),
    )
    native = hasattr(rule, "preprocess_python")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mp4"
        path.write_bytes(data)

        def ours_decode() -> Any:
            return decode_video(
                path.read_bytes(),
                index=0,
                sampling=VideoSampling(NUM_FRAMES, -1),
                limits=VideoLimits(),
            )

        def hf_decode() -> Any:
            return load_video(str(path), backend="pyav", sample_indices_fn=vllm_indices)

        def vllm_indices(metadata: Any, **_: Any) -> np.ndarray:
            # vLLM's linspace rule (transformers' default is ``arange(n) * total // n``),
            # so that both sides decode the same frames.
            return np.linspace(0, metadata.total_num_frames - 1, NUM_FRAMES, dtype=int)

        def hf_process(frames: np.ndarray) -> Any:
            return hf(
                videos=[frames],
                do_sample_frames=False,
                cap_pixels_per_frame=False,
                return_tensors="pt",
            )

        times: dict[str, list[float]] = {
            k: []
            for k in (
                "ours_decode",
                "ours_preprocess",
                "ours_preprocess_python",
                "hf_decode",
                "hf_preprocess",
            )
        }
        check: dict[str, Any] = {}
        for r in range(args.rounds + 1):  # round 0 warms both up, not counted
            t_dec, video = timed(ours_decode)
            t_pre, (grid, pixels) = timed(lambda v=video: rule.preprocess(v.frames, index=0))
            t_py = float("nan")
            if native:
                t_py, (grid_py, pixels_py) = timed(
                    lambda v=video: rule.preprocess_python(v.frames, index=0)  # type: ignore[attr-defined]
                )
            h_dec, (frames, _meta) = timed(hf_decode)
            h_pre, result = timed(lambda f=frames: hf_process(f))
            if r == 0:
                assert video.indices == [int(i) for i in _meta.frames_indices], "other frames"
                assert np.array_equal(video.frames, frames), "the decoders' RGB frames differ"
                ref = result["pixel_values_videos"]
                check = {
                    "grid": list(grid),
                    "hf_grid": result["video_grid_thw"][0].tolist(),
                    "rows": int(pixels.shape[0]),
                    "max_abs_diff_vs_transformers": float((pixels - ref).abs().max()),
                    "mean_abs_diff_vs_transformers": float((pixels - ref).abs().mean()),
                }
                if native:
                    check["native_equals_python_path"] = bool(
                        tuple(grid_py) == tuple(grid) and torch.equal(pixels_py, pixels)
                    )
                print(json.dumps(check))
                continue
            for key, value in (
                ("ours_decode", t_dec),
                ("ours_preprocess", t_pre),
                ("ours_preprocess_python", t_py),
                ("hf_decode", h_dec),
                ("hf_preprocess", h_pre),
            ):
                times[key].append(value)
            print(
                f"round {r}: ours {1e3 * (t_dec + t_pre):.0f} ms "
                f"(decode {1e3 * t_dec:.0f}, preprocess {1e3 * t_pre:.0f}), transformers "
                f"{1e3 * (h_dec + h_pre):.0f} ms (load {1e3 * h_dec:.0f}, "
                f"processor {1e3 * h_pre:.0f})",
                flush=True,
            )

    med = {k: 1e3 * statistics.median(v) for k, v in times.items() if v and v[0] == v[0]}
    ours = med["ours_decode"] + med["ours_preprocess"]
    theirs = med["hf_decode"] + med["hf_preprocess"]
    result_doc = {
        "clip": {
            "size": f"{WIDTH}x{HEIGHT}",
            "fps": RATE,
            "seconds": SECONDS,
            "keyframe_interval": keyframe_interval(data),
            "bytes": len(data),
            "sampled_frames": NUM_FRAMES,
        },
        "check": check,
        "native_rule": native,
        "median_ms": {k: round(v, 1) for k, v in med.items()},
        "ours_ms": round(ours, 1),
        "transformers_ms": round(theirs, 1),
        "ratio": round(theirs / ours, 2),
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
    }
    print(json.dumps(result_doc, indent=2))
    print(
        f"decode + preprocess, median of {args.rounds}: ours {ours:.0f} ms, transformers "
        f"{theirs:.0f} ms: {theirs / ours:.2f}x"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_video.json").write_text(json.dumps(result_doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
