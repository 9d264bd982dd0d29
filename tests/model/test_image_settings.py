"""The Qwen2-VL image processor settings read without transformers' image processing
(``model/image_settings.py``) against transformers' own processor of the same config."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ec_frontend.model.image_settings import (
    SETTINGS,
    QwenVLImageSettings,
    load_image_processor,
    processor_class_names,
    processor_name,
)
from ec_frontend.model.native_preprocess import _rule_of, native_preprocessor_for
from ec_frontend.model.processor import _processor_pixel_range
from ec_frontend.model.video_processor import QwenVideoRule
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..helpers.torchvision import torchvision_env

QWEN2_VL_7B = {  # Qwen/Qwen2-VL-7B-Instruct's keys: the pixel range outside `size`
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
QWEN3_VL = {  # Qwen3-VL's: `size` edges, 16-pixel patches, the fast class
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}

#: Configs read without transformers: name -> preprocessor_config.json.
READ: dict[str, dict[str, Any]] = {
    "qwen2-vl-7b": QWEN2_VL_7B,
    "qwen3-vl": QWEN3_VL,
    "type only": {"image_processor_type": "Qwen2VLImageProcessor"},
    "size and max_pixels": {**QWEN3_VL, "max_pixels": 1003520},
    "flags off": {
        "image_processor_type": "Qwen2VLImageProcessorPil",
        "do_resize": False,
        "do_rescale": False,
        "do_normalize": False,
        "do_convert_rgb": False,
        "resample": 2,
        "rescale_factor": 0.5,
        "image_mean": [0, 1, 2],
    },
}

#: Configs left to transformers: name -> preprocessor_config.json.
DEFERRED: dict[str, dict[str, Any]] = {
    "unknown key": {**QWEN2_VL_7B, "do_pad": True},
    "one size edge": {**QWEN3_VL, "size": {"longest_edge": 1003520}},
    "size in height and width": {**QWEN3_VL, "size": {"height": 224, "width": 224}},
    "four channel mean": {**QWEN2_VL_7B, "image_mean": [0.5, 0.5, 0.5, 0.5]},
    "flag as an int": {**QWEN2_VL_7B, "do_resize": 1},
    "patch size as a string": {**QWEN2_VL_7B, "patch_size": "14"},
    "patch size as a bool": {**QWEN2_VL_7B, "patch_size": True},
    "another class": {
        "image_processor_type": "CLIPImageProcessor",
        "crop_size": {"height": 224, "width": 224},
        "size": {"shortest_edge": 224},
    },
}


def _checkpoint(tmp_path: Path, builtin: Path, config: dict[str, Any]) -> Path:
    """The built-in checkpoint's files with ``config`` as its preprocessor config."""
    directory = tmp_path / "ckpt"
    shutil.copytree(builtin, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    return directory


def _plain(value: Any) -> Any:
    """An attribute as plain values (transformers' ``SizeDict`` without its unset keys)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return tuple(value)
    return {k: v for k, v in dict(value).items() if v is not None}


@pytest.mark.parametrize("name", list(READ))
def test_settings_equal_transformers(name: str, tmp_path: Path, builtin_model_dir: Path) -> None:
    directory = _checkpoint(tmp_path, builtin_model_dir, READ[name])
    ours = load_image_processor(directory)
    assert isinstance(ours, QwenVLImageSettings)
    theirs = [AutoImageProcessor.from_pretrained(directory)]
    theirs.append(Qwen2VLImageProcessorPil.from_pretrained(directory))
    for reference in theirs:
        for attr in sorted(SETTINGS):
            assert _plain(getattr(ours, attr)) == _plain(getattr(reference, attr)), attr
        assert _processor_pixel_range(ours) == _processor_pixel_range(reference)
        # The same native rule (or the same reason for none).
        assert _rule_of(ours, "", 14) == _rule_of(reference, "", 14)
        native = native_preprocessor_for(ours, log=False)
        reference_native = native_preprocessor_for(reference, log=False)
        assert (native and native.spec) == (reference_native and reference_native.spec)
        for key in ("image_mean", "image_std", "patch_size", "merge_size"):
            assert _plain(ours.__dict__[key]) == _plain(reference.__dict__[key]), key
        assert QwenVideoRule.from_checkpoint(directory, ours) == QwenVideoRule.from_checkpoint(
            directory, reference
        )
    assert processor_name(ours) == READ[name]["image_processor_type"]
    assert processor_class_names(ours) & processor_class_names(theirs[0])
    # transformers' processor is not built for the settings.
    assert ours.__dict__["_processor"] is None


@pytest.mark.parametrize("name", list(DEFERRED))
def test_other_configs_load_transformers_processor(
    name: str, tmp_path: Path, builtin_model_dir: Path
) -> None:
    directory = _checkpoint(tmp_path, builtin_model_dir, DEFERRED[name])
    ours = load_image_processor(directory)
    assert not isinstance(ours, QwenVLImageSettings)
    assert type(ours) is type(AutoImageProcessor.from_pretrained(directory))


def test_native_rule_of_the_settings_equals_transformers(builtin_model_dir: Path) -> None:
    ours = load_image_processor(builtin_model_dir)
    theirs = AutoImageProcessor.from_pretrained(builtin_model_dir)
    native_ours, native_theirs = native_preprocessor_for(ours), native_preprocessor_for(theirs)
    assert native_ours is not None and native_theirs is not None
    assert native_ours.spec == native_theirs.spec


def test_a_call_and_other_attributes_go_to_transformers(builtin_model_dir: Path) -> None:
    ours = load_image_processor(builtin_model_dir)
    theirs = AutoImageProcessor.from_pretrained(builtin_model_dir)
    image = Image.fromarray(np.arange(64 * 48 * 3, dtype=np.uint8).reshape(48, 64, 3))
    got = ours(images=[image], return_tensors="pt")
    want = theirs(images=[image], return_tensors="pt")
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    assert ours.model_input_names == theirs.model_input_names
    assert type(ours.transformers_processor()) is type(theirs)
    with pytest.raises(AttributeError):
        ours._not_an_attribute  # noqa: B018


def test_an_api_server_processor_imports_no_image_processing(builtin_model_dir: Path) -> None:
    """What an API server loads (config, tokenizer, image settings, the native rule)
    leaves transformers' image processing and modeling, and ``torch._dynamo``, unimported."""
    code = (
        "import sys\n"
        "from ec_frontend.model.loader import load_processor\n"
        "p = load_processor(sys.argv[1])\n"
        "assert p.native is not None\n"
        "heavy = ['transformers.image_processing_utils', 'transformers.modeling_utils',\n"
        "         'torch._dynamo']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(builtin_model_dir)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_settings_equal_transformers_torchvision_backend(
    tmp_path: Path, builtin_model_dir: Path
) -> None:
    """transformers' torchvision backend (``Qwen2VLImageProcessor``, what it picks where
    torchvision is importable), in a child with the test-only torchvision."""
    directories = [
        _checkpoint(tmp_path / f"c{i}", builtin_model_dir, config)
        for i, config in enumerate(READ.values())
    ]
    code = (
        "import json, sys\n"
        "from transformers import AutoImageProcessor\n"
        "attrs = sys.argv[1].split(',')\n"
        "out = {}\n"
        "for d in sys.argv[2:]:\n"
        "    p = AutoImageProcessor.from_pretrained(d)\n"
        "    values = {a: getattr(p, a) for a in attrs}\n"
        "    values['size'] = {k: v for k, v in dict(p.size).items() if v is not None}\n"
        "    out[d] = [type(p).__name__, values]\n"
        "print(json.dumps(out, default=list))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, ",".join(sorted(SETTINGS)), *map(str, directories)],
        env=torchvision_env(),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    reference = json.loads(done.stdout.strip().splitlines()[-1])
    for directory in directories:
        name, values = reference[str(directory)]
        assert name == "Qwen2VLImageProcessor"  # the torchvision backend
        ours = load_image_processor(directory)
        for attr in sorted(SETTINGS):
            assert _plain(getattr(ours, attr)) == _plain(values[attr]), (directory, attr)
