"""transformers' ``Qwen2VLVideoProcessor`` (which requires torchvision) over the
frames of ``test_video.py``'s native-kernel cases, in a process whose path has the
test-only torchvision install (see ``tests/preprocess/torchvision_reference.py``
for why torchvision stays out of the project's venv).

Reads ``IN.npz`` (per case ``<case>/frames``: ``[n, H, W, 3]`` uint8 RGB, and
``<case>/pixels``: ``[min_pixels, max_pixels]``) and writes per case
``<case>/pixel_values_videos`` and ``<case>/video_grid_thw`` to ``OUT.npz``.

Run: ``PYTHONPATH=<venv>/extras/torchvision python video_torchvision_reference.py
IN.npz OUT.npz``.
"""

from __future__ import annotations

import sys

import numpy as np
import torchvision
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor


def main(in_path: str, out_path: str) -> None:
    cases = np.load(in_path)
    processor = Qwen2VLVideoProcessor()
    out: dict[str, np.ndarray] = {"torchvision_version": np.array(torchvision.__version__)}
    for name in sorted({key.split("/")[0] for key in cases.files}):
        low, high = (int(v) for v in cases[f"{name}/pixels"])
        result = processor(
            videos=[cases[f"{name}/frames"]],
            size={"shortest_edge": low, "longest_edge": high},
            do_sample_frames=False,
            cap_pixels_per_frame=False,
            return_tensors="np",
        )
        for key in ("pixel_values_videos", "video_grid_thw"):
            out[f"{name}/{key}"] = np.asarray(result[key])
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
