"""transformers' torchvision image processor (``Qwen2VLImageProcessor``) over the test
corpus, in a process whose path has the test-only torchvision install.

torchvision is kept out of the project's ``.venv`` on purpose: with it importable,
transformers picks its torchvision backend for every image processor, which would
change what the rest of the suite and the server run. ``scripts/setup.sh`` installs it
(``--no-deps``) into ``.venv/extras/torchvision``; this script runs with that directory
on ``PYTHONPATH`` and writes, per corpus case, ``pixel_values`` and
``image_grid_thw`` to the ``.npz`` file named by its argument.

Run: ``PYTHONPATH=.venv/extras/torchvision .venv/bin/python
tests/preprocess/torchvision_reference.py OUT.npz``.
"""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import numpy as np
import torchvision
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import corpus


def main(out_path: str) -> None:
    ip = Qwen2VLImageProcessor()
    arrays: dict[str, np.ndarray] = {"torchvision_version": np.array(torchvision.__version__)}
    for case in corpus():
        size = dict(ip.size)
        if "min_pixels" in case.pixels:
            size["shortest_edge"] = case.pixels["min_pixels"]
        if "max_pixels" in case.pixels:
            size["longest_edge"] = case.pixels["max_pixels"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(case.data))
            out = ip(images=[image], size=size, return_tensors="np")
        arrays[f"{case.name}/pixel_values"] = out["pixel_values"]
        arrays[f"{case.name}/grid"] = np.asarray(out["image_grid_thw"][0])
    np.savez(out_path, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
