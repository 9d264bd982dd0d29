"""The native CLIP rule (LLaVA-1.5's image processor) against transformers'
``CLIPImageProcessorPil`` on the generated corpus: shapes equal and ``pixel_values``
equal (measured maximum |difference| 0.0; the check allows the issue's 1e-2), and
which processors the native path takes on."""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import pytest
from ec_frontend import _core
from ec_frontend.model.native_preprocess import native_preprocessor_for
from PIL import Image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from .corpus import corpus

CASES = corpus()
TOLERANCE = 1e-2
#: (shortest edge, crop): LLaVA-1.5's 336 and CLIP's class default 224.
SIZES = [(336, 336), (224, 224)]


def reference(edge: int, crop: int) -> CLIPImageProcessorPil:
    return CLIPImageProcessorPil(
        size={"shortest_edge": edge}, crop_size={"height": crop, "width": crop}
    )


def native_for(ip: CLIPImageProcessorPil) -> Any:
    return _core.ClipPreprocessor(
        shortest_edge=ip.size["shortest_edge"],
        crop_height=ip.crop_size["height"],
        crop_width=ip.crop_size["width"],
        rescale_factor=ip.rescale_factor,
        image_mean=list(ip.image_mean),
        image_std=list(ip.image_std),
        resample=int(ip.resample),
        max_image_pixels=200_000_000,
    )


@pytest.mark.parametrize(("edge", "crop"), SIZES)
def test_native_equals_transformers(edge: int, crop: int) -> None:
    ip = reference(edge, crop)
    native = native_for(ip)
    worst = 0.0
    for case in CASES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = ip(images=[Image.open(io.BytesIO(case.data))], return_tensors="np")
        ((buf, shape),) = native.preprocess([case.data])
        got = np.frombuffer(buf, dtype=np.float32).reshape(shape)
        assert got.shape == want["pixel_values"].shape == (1, 3, crop, crop), case.name
        diff = float(np.abs(got - want["pixel_values"]).max())
        assert diff <= TOLERANCE, f"{case.name}: max |diff| {diff}"
        worst = max(worst, diff)
    print(f"CLIP {edge}/{crop}: {len(CASES)} images, max |diff| {worst}")


def test_the_native_path_takes_clip_processors_it_reproduces() -> None:
    ip = reference(336, 336)
    native = native_preprocessor_for(ip, patch_size=14, log=False)
    assert native is not None and native.rule == "clip"
    assert native.grid(1000, 10) == (1, 24, 24)
    assert native.covers(None) and not native.covers({"shortest_edge": 300})
    data = io.BytesIO()
    Image.new("RGB", (500, 300), (10, 200, 30)).save(data, "PNG")
    ((grid, pixels),) = native.preprocess([data.getvalue()], [0])
    assert grid == (1, 24, 24) and tuple(pixels.shape) == (1, 3, 336, 336)
    # No patch size to size the grid, a crop the resize cannot fill (transformers pads),
    # a resize to a fixed size: transformers' processor stays.
    assert native_preprocessor_for(ip, log=False) is None
    padded = reference(200, 224)
    assert native_preprocessor_for(padded, patch_size=14, log=False) is None
    square = CLIPImageProcessorPil(size={"height": 336, "width": 336})
    assert native_preprocessor_for(square, patch_size=14, log=False) is None
