"""Our Qwen2-VL vision tower against ``transformers``' own, on the same weights:
equal to the last bit for images, videos and mixed batches, in float32 and
bfloat16; the fallback to ``transformers``' tower for configs it does not
cover; and an engine process that loads the built-in model without importing
``transformers``' modeling code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from ec_frontend.model.qwen2_vl_vision import Qwen2VisionTower, build_vision, covers
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel


def vision_config(**changes: object) -> Qwen2VLConfig:
    vision = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 48,
        "num_heads": 4,
        "mlp_ratio": 2,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        **changes,
    }
    return Qwen2VLConfig(vision_config=vision)


def pair(config: Qwen2VLConfig, dtype: torch.dtype = torch.float32):
    """Theirs with random weights, and ours holding the same state dict."""
    torch.manual_seed(0)
    theirs = Qwen2VisionTransformerPretrainedModel._from_config(
        config.vision_config, dtype=torch.float32, attn_implementation="sdpa"
    )
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    ours = Qwen2VisionTower(config.vision_config)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing and not unexpected
    return theirs.to(dtype).eval(), ours.to(dtype).eval()


def patches(grid: list[list[int]], config: Qwen2VLConfig, dtype=torch.float32) -> torch.Tensor:
    v = config.vision_config
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    rows = sum(t * h * w for t, h, w in grid)
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(1)).to(dtype)


GRIDS = {
    "one image": [[1, 4, 6]],
    "three images": [[1, 4, 4], [1, 2, 8], [1, 6, 2]],
    "video": [[4, 4, 6]],
    "image and video": [[1, 8, 4], [3, 2, 4], [1, 2, 2]],
}


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_transformers_tower(grid, dtype):
    config = vision_config()
    theirs, ours = pair(config, dtype)
    pixels = patches(grid, config, dtype)
    thw = torch.tensor(grid)
    with torch.no_grad():
        expected = theirs(pixels, grid_thw=thw).pooler_output
        got = ours(pixels, grid_thw=thw)
    rows = sum(t * h * w for t, h, w in grid) // 4
    assert got.shape == expected.shape == (rows, 48)
    assert got.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "silu"])
def test_other_activations_equal_too(act):
    config = vision_config(hidden_act=act)
    theirs, ours = pair(config)
    grid = [[2, 4, 4]]
    pixels = patches(grid, config)
    with torch.no_grad():
        assert torch.equal(
            ours(pixels, grid_thw=torch.tensor(grid)),
            theirs(pixels, grid_thw=torch.tensor(grid)).pooler_output,
        )


def test_frames_attend_only_to_themselves():
    # Changing the second frame's pixels leaves the first frame's rows as they were.
    config = vision_config()
    _, ours = pair(config)
    grid = torch.tensor([[2, 4, 4]])
    pixels = patches([[2, 4, 4]], config)
    changed = pixels.clone()
    changed[16:] += 1.0
    with torch.no_grad():
        a, b = ours(pixels, grid_thw=grid), ours(changed, grid_thw=grid)
    assert torch.equal(a[:4], b[:4])
    assert not torch.equal(a[4:], b[4:])


def test_configs_it_does_not_cover_get_the_transformers_tower():
    assert covers(vision_config().vision_config)
    assert isinstance(build_vision(vision_config()), Qwen2VisionTower)
    other = vision_config(hidden_act="relu")
    assert not covers(other.vision_config)
    assert isinstance(build_vision(other), Qwen2VisionTransformerPretrainedModel)
    square = vision_config(patch_size=[14, 14])
    assert not covers(square.vision_config)


def test_builtin_engine_imports_no_transformers_modeling(builtin_model_dir):
    # The built-in model loads, encodes an image and runs its language model in a
    # fresh interpreter without importing transformers' modeling code or torch._dynamo.
    code = f"""
import json, sys, torch
from ec_frontend.model.loader import load_model
m = load_model({str(builtin_model_dir)!r}, device="cpu")
rows = m.encode_images(torch.zeros(16, 3 * 2 * 14 * 14), torch.tensor([[1, 4, 4]]))
print(json.dumps({{
    "rows": list(rows[0].shape),
    "tower": type(m.vision).__name__,
    "loaded": sorted(n for n in ("transformers.modeling_utils", "torch._dynamo",
                                  "transformers.models.qwen2_vl.modeling_qwen2_vl")
                     if n in sys.modules),
}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"rows": [4, 64], "tower": "Qwen2VisionTower", "loaded": []}
