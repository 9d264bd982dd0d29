"""Video over the encoder cache: what refusing it costs the API server, in one run.

The clip is ``bench_video.py``'s (10 s of 1280x720 H.264 at 30 fps, 32 frames
sampled), sent as a chat to the built-in model's processor. Its one encoder item is
``t*h*w/4`` rows; the processor is told the encoder cache holds one row less.

* **refused early** (this tree): ``configure_media(max_item_rows=rows - 1)``: the
  processor counts the container's packets, samples the frames, finds the item too
  large and refuses it (400 ``video_too_large``) before decoding a frame.
* **refused by the engine** (before this change, and still with
  ``max_item_rows=None``): the processor decodes the 32 frames and preprocesses
  them; the engine then refuses the item, whose pixels were never needed.

Rounds alternate the two; medians of wall time. Writes
``benches/results/bench_video_refusal.json``.

Run: ``.venv/bin/python benches/bench_video_refusal.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ec_frontend.model.builtin import ensure_builtin_checkpoint
from ec_frontend.model.errors import InputError
from ec_frontend.model.loader import load_processor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_video import NUM_FRAMES, make_clip

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"


class Clip:
    """The clip as the parser gives a ``video_url`` item."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.mm_hash = "ab" * 32
        self.param = "messages[0].content[0].video_url"
        self.kind = "video"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    clip = Clip(make_clip())
    processor = load_processor(ensure_builtin_checkpoint())
    content = [{"type": "video", "media_index": 0}, {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": content}]
    kwargs: dict[str, Any] = {"media_io_kwargs": {"video": {"num_frames": NUM_FRAMES}}}

    def run(rows: int | None) -> tuple[float, str]:
        processor.configure_media(max_item_rows=rows)
        start = time.perf_counter()
        try:
            out = processor.process_chat(messages, [clip], **kwargs)
            outcome = f"processed: one item of {out.mm_features[0].length} rows"
        except InputError as exc:
            outcome = f"refused: {exc.code}"
        return time.perf_counter() - start, outcome

    _, first = run(None)
    rows = int(first.split(" of ")[1].split()[0])
    print(f"clip: {len(clip.data) / 1e6:.1f} MB, {NUM_FRAMES} frames sampled, {first}")
    times: dict[str, list[float]] = {"early": [], "engine": []}
    outcomes = {}
    for _ in range(args.rounds):
        for name, limit in (("early", rows - 1), ("engine", None)):
            seconds, outcome = run(limit)
            times[name].append(seconds)
            outcomes[name] = outcome
    early, engine = statistics.median(times["early"]), statistics.median(times["engine"])
    print(f"refused early (cache {rows - 1} rows): {early * 1e3:.1f} ms ({outcomes['early']})")
    print(f"decoded and preprocessed for the engine to refuse: {engine * 1e3:.1f} ms")
    print(f"ratio, engine path / early refusal: {engine / early:.1f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "bench": "bench_video_refusal",
        "rounds": args.rounds,
        "item_rows": rows,
        "early_ms": early * 1e3,
        "engine_path_ms": engine * 1e3,
        "ratio": engine / early,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    (RESULTS / "bench_video_refusal.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
