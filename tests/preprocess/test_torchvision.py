"""The native Qwen2-VL preprocessing against transformers' torchvision backend
(``Qwen2VLImageProcessor``) on the same corpus as ``test_equality``.

torchvision lives in a test-only directory (``.venv/extras/torchvision``, installed
``--no-deps`` by ``scripts/setup.sh``), so the reference runs in a child process
(``torchvision_reference.py``) with that directory on its path; the project's own
environment keeps transformers' PIL backend.

transformers' two backends do not agree with each other: torchvision resamples in
float with its own antialiasing and composites transparency differently, so its pixels
differ from Pillow's (measured: max 0.42, mean 0.001 over the corpus). The native path
equals the PIL backend bit for bit (``test_equality``), so the checks here are: grids
and placeholder counts exact, and per image the native pixels no further from
torchvision's than transformers' own PIL backend is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..helpers.torchvision import torchvision_env
from .corpus import corpus
from .test_equality import native_for, run_native, run_reference

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def torchvision_out(tmp_path_factory: pytest.TempPathFactory) -> Any:
    env = torchvision_env()
    out = tmp_path_factory.mktemp("torchvision") / "reference.npz"
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("torchvision_reference.py")), str(out)],
        env=env,
        check=True,
        timeout=600,
    )
    return np.load(out)


def test_native_against_the_torchvision_backend(torchvision_out: Any) -> None:
    reference = Qwen2VLImageProcessorPil()
    native = native_for(reference)
    merge = reference.merge_size
    cases = corpus()
    worst, means = 0.0, []
    for case in cases:
        want = torchvision_out[f"{case.name}/pixel_values"]
        want_grid = tuple(int(v) for v in torchvision_out[f"{case.name}/grid"])
        got, got_grid = run_native(native, case)
        assert tuple(got_grid) == want_grid, case.name
        assert got_grid[0] * got_grid[1] * got_grid[2] // merge**2 == want.shape[0] // merge**2
        assert got.shape == want.shape, case.name
        pil, _ = run_reference(reference, case)
        ours = float(np.abs(got - want).max())
        theirs = float(np.abs(pil - want).max())
        assert ours <= theirs + 1e-6, f"{case.name}: native {ours} vs PIL backend {theirs}"
        worst = max(worst, ours)
        means.append(float(np.abs(got - want).mean()))
    # The backends agree closely on average even where single pixels differ.
    assert float(np.mean(means)) < 5e-3, np.mean(means)
    print(f"torchvision {torchvision_out['torchvision_version']}: {len(cases)} images, "
          f"max |native - torchvision| {worst:.3f}, mean {np.mean(means):.5f}")  # fmt: skip
