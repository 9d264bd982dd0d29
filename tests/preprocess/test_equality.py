"""The native Qwen2-VL preprocessing against transformers' processor (PIL backend) on
a generated corpus: grids and placeholder counts exact, ``pixel_values`` equal.

transformers' torchvision backend is compared in ``test_torchvision`` (a test-only
install run in a child process).
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import pytest
from ec_frontend import _core
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from .corpus import Case, corpus

CASES = corpus()
#: Largest allowed |native - transformers| after normalization.
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def reference() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil()


def native_for(ip: Qwen2VLImageProcessorPil) -> Any:
    return _core.QwenVlPreprocessor(
        min_pixels=ip.size["shortest_edge"],
        max_pixels=ip.size["longest_edge"],
        patch_size=ip.patch_size,
        merge_size=ip.merge_size,
        temporal_patch_size=ip.temporal_patch_size,
        rescale_factor=ip.rescale_factor,
        image_mean=list(ip.image_mean),
        image_std=list(ip.image_std),
        resample=int(ip.resample),
        max_image_pixels=200_000_000,
    )


def run_reference(ip: Qwen2VLImageProcessorPil, case: Case) -> tuple[np.ndarray, np.ndarray]:
    size = dict(ip.size)
    size.update(
        {k: v for k, v in (("shortest_edge", case.pixels.get("min_pixels")),
                           ("longest_edge", case.pixels.get("max_pixels"))) if v}
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ip(images=[Image.open(io.BytesIO(case.data))], size=size, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"][0]


def run_native(native: Any, case: Case) -> tuple[np.ndarray, tuple[int, int, int]]:
    ((buf, shape, grid),) = native.preprocess([case.data], **case.pixels)
    return np.frombuffer(buf, dtype=np.float32).reshape(shape), grid


def test_corpus_covers_the_must_show_kinds() -> None:
    kinds = {c.name.split("-")[0] for c in CASES}
    assert len(CASES) >= 200
    for needed in ("png_grey", "png_palette", "png_rgba", "png_rgb16", "png_grey16",
                   "jpeg_progressive", "jpeg_cmyk", "gif_animated", "webp_lossy",
                   "webp_lossless", "bmp_rgb"):  # fmt: skip
        assert needed in kinds
    assert any(c.name.endswith("1x1-1") or "-1x1-" in c.name for c in CASES)
    assert any("3000x4000" in c.name for c in CASES)
    assert any("1x200" in c.name or "200x1" in c.name for c in CASES)
    assert sum(bool(c.pixels) for c in CASES) >= 100


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_native_equals_transformers(reference: Qwen2VLImageProcessorPil, case: Case) -> None:
    want_pixels, want_grid = run_reference(reference, case)
    got_pixels, got_grid = run_native(native_for(reference), case)
    assert got_grid == tuple(int(v) for v in want_grid)
    merge = reference.merge_size
    grid_tokens = got_grid[0] * got_grid[1] * got_grid[2] // merge**2
    assert grid_tokens == want_pixels.shape[0] // merge**2
    assert got_pixels.shape == want_pixels.shape
    diff = float(np.abs(got_pixels - want_pixels).max())
    assert diff <= TOLERANCE, f"max |diff| {diff}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decoded_rgb_equals_pillow_and_convert_to_rgb(case: Case) -> None:
    """The first stage alone: the same bytes as Pillow's decoder followed by
    transformers' ``convert_to_rgb`` (the alpha composite over white), every pixel."""
    from transformers.image_transforms import convert_to_rgb

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = np.asarray(convert_to_rgb(Image.open(io.BytesIO(case.data))))
    width, height, data = _core.decode_rgb(case.data, max_image_pixels=200_000_000)
    got = np.frombuffer(data, dtype=np.uint8).reshape(height, width, 3)
    assert got.shape == want.shape
    mismatched = int((got != want).any(axis=-1).sum())
    assert mismatched == 0, f"{mismatched} of {width * height} pixels differ"
