"""Qwen2-VL's vision tower: ours (``model/qwen2_vl_vision.py``) against
``transformers``' ``Qwen2VisionTransformerPretrainedModel`` on the same weights.

The widths are Qwen2-VL-2B's vision tower (embed 1280, 16 heads, MLP 5120,
merger to 1536) with fewer blocks (``--depth``, 4 by default, so that a round
takes seconds on a CPU); the inputs are one 448x448 image (1024 patches), four
of them in one call, and an 8-frame 448x448 video (4 temporal patches). Each
round times both towers on each input, alternating which goes first; the
figures are medians of the rounds, with the ratio transformers / ours. Both
towers give equal outputs (checked here before timing).

Writes ``benches/results/bench_vision_tower.json``.

Run: ``.venv/bin/python benches/bench_vision_tower.py [--rounds 5] [--depth 4]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from ec_frontend.model.qwen2_vl_vision import Qwen2VisionTower
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

INPUTS = {
    "one 448x448 image": [[1, 32, 32]],
    "four 448x448 images": [[1, 32, 32]] * 4,
    "8-frame 448x448 video": [[4, 32, 32]],
}


def towers(depth: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = Qwen2VLConfig(
        vision_config={"depth": depth, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16}
    ).vision_config
    torch.manual_seed(0)
    theirs = Qwen2VisionTransformerPretrainedModel._from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    ours = Qwen2VisionTower(config)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs.eval(), ours.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--out", default="benches/results/bench_vision_tower.json")
    args = parser.parse_args()
    theirs, ours = towers(args.depth)
    gen = torch.Generator().manual_seed(1)
    results = {}
    for name, grid in INPUTS.items():
        thw = torch.tensor(grid)
        pixels = torch.randn(int(thw.prod(-1).sum()), 3 * 2 * 14 * 14, generator=gen)

        def run_theirs(p: torch.Tensor = pixels, g: torch.Tensor = thw) -> torch.Tensor:
            out: torch.Tensor = theirs(p, grid_thw=g).pooler_output
            return out

        def run_ours(p: torch.Tensor = pixels, g: torch.Tensor = thw) -> torch.Tensor:
            out: torch.Tensor = ours(p, grid_thw=g)
            return out

        with torch.no_grad():
            assert torch.equal(run_theirs(), run_ours()), name
            times: dict[str, list[float]] = {"transformers": [], "ours": []}
            for r in range(args.rounds):
                order = [("ours", run_ours), ("transformers", run_theirs)]
                for label, fn in order if r % 2 else order[::-1]:
                    started = time.perf_counter()
                    fn()
                    times[label].append(time.perf_counter() - started)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        results[name] = {
            "ms": med,
            "per_round_ms": {k: [round(x * 1e3, 1) for x in v] for k, v in times.items()},
            "transformers_over_ours": med["transformers"] / med["ours"],
        }
        print(
            f"{name:>24}: transformers {med['transformers']:8.1f} ms, ours "
            f"{med['ours']:8.1f} ms, ratio {med['transformers'] / med['ours']:.3f}x"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "depth": args.depth,
                "rounds": args.rounds,
                "torch_threads": torch.get_num_threads(),
                "host": platform.node(),
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
