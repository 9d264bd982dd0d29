"""A chat about one video, turn by turn: input processing with the processed-video
cache (``--mm-processor-cache-gb``, the default) against without it, in one run.

The clip is ``bench_video.py``'s (10 s of 1280x720 H.264, 32 frames sampled). A
conversation of ``--turns`` user turns carries the video in its first message, as
a client resends the whole history each turn; each turn is the built-in model's
``InputProcessor.process_chat`` of the history so far (chat template, tokenization,
video decode + preprocess, positions), what an API server does before the engine
sees the request. Rounds alternate the two processors (a fresh cache each round);
the figures are medians of wall time per turn. Turn 1 decodes in both; from turn 2
on, the cached side takes the video from its cache.

Writes ``benches/results/bench_video_repeat.json``.

Run: ``.venv/bin/python benches/bench_video_repeat.py [--rounds 5] [--turns 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))

from bench_video import NUM_FRAMES, make_clip  # noqa: E402
from ec_frontend.model.builtin import ensure_builtin_checkpoint  # noqa: E402
from ec_frontend.model.loader import load_processor  # noqa: E402
from ec_frontend.model.processor import InputProcessor  # noqa: E402

RESULTS = ROOT / "benches" / "results"


class Item:
    def __init__(self, data: bytes) -> None:
        self.data, self.mm_hash, self.param, self.kind = data, "v" * 64, "messages[0]", "video"


def conversation(turns: int) -> list[list[dict[str, Any]]]:
    """The message history sent at each turn."""
    history: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "video", "media_index": 0},
        {"type": "text", "text": "What happens in this clip?"}]}]  # fmt: skip
    out = [list(history)]
    for turn in range(1, turns):
        history += [
            {"role": "assistant", "content": f"Answer {turn}: a colour field pans to the left."},
            {"role": "user", "content": f"And then? ({turn})"},
        ]
        out.append(list(history))
    return out


def run(proc: InputProcessor, clip: bytes, turns: list[list[dict[str, Any]]]) -> list[float]:
    kwargs = {"video": {"num_frames": NUM_FRAMES}}
    times = []
    for messages in turns:
        start = time.perf_counter()
        proc.process_chat(messages, [Item(clip)], media_io_kwargs=kwargs)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    clip = make_clip()
    turns = conversation(args.turns)
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_builtin_checkpoint(Path(tmp))
        sides = {"cached": 4 << 30, "uncached": 0}
        samples: dict[str, list[list[float]]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, cache_bytes in sides.items():
                proc = load_processor(model)
                proc.configure_media(video_cache_bytes=cache_bytes)
                samples[side].append(run(proc, clip, turns))
    medians = {
        side: [statistics.median(r[t] for r in rounds) * 1000 for t in range(args.turns)]
        for side, rounds in samples.items()
    }
    later = {side: statistics.median(v[1:]) for side, v in medians.items()}
    ratio = later["uncached"] / later["cached"]
    print(f"{len(clip) / 1e6:.1f} MB clip, {NUM_FRAMES} frames, {args.rounds} rounds (medians)")
    for side, values in medians.items():
        cells = "  ".join(f"turn {i + 1}: {v:7.1f} ms" for i, v in enumerate(values))
        print(f"  {side:9s} {cells}")
    print(f"turns 2..{args.turns}: uncached / cached = {ratio:.1f}x")
    result = {
        "bench": "bench_video_repeat",
        "command": "python benches/bench_video_repeat.py " + " ".join(sys.argv[1:]),
        "rounds": args.rounds,
        "turns": args.turns,
        "clip_bytes": len(clip),
        "num_frames": NUM_FRAMES,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "median_ms_per_turn": {k: [round(x, 1) for x in v] for k, v in medians.items()},
        "later_turns_uncached_over_cached": round(ratio, 2),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_video_repeat.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
