"""transformers' own Qwen-VL and LLaVA-OneVision processors, with their video
processors (``Qwen2VLVideoProcessor``, ``Qwen3VLVideoProcessor``,
``LlavaOnevisionVideoProcessor``, which need torchvision), over the video cases of
``test_qwen*_video.py`` and ``test_llava_onevision_video.py``, in a process whose
path has the test-only torchvision install (see
``tests/preprocess/torchvision_reference.py``).

Reads ``IN.npz`` (``checkpoint``, ``family`` (``qwen2_vl`` when absent,
``qwen2_5_vl``, ``qwen3_vl``, ``llava_onevision``), and per case ``<case>/text``,
``<case>/video``: the sampled frames ``[n, H, W, 3]`` uint8, ``<case>/image``: PNG
bytes or empty, and for the families that read it ``<case>/metadata``: ``[fps,
total frames, *sampled indices]`` of the video) and writes what the processor returns per case to
``OUT.npz``. Images go through the PIL image backend, as in the server's
environment.

Run: ``PYTHONPATH=<venv>/extras/torchvision python video_reference.py IN.npz OUT.npz``.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torchvision
from PIL import Image
from transformers import (
    LlavaOnevisionProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)
from transformers.models.llava_onevision.video_processing_llava_onevision import (
    LlavaOnevisionVideoProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

FAMILIES = {
    "qwen2_vl": (Qwen2VLProcessor, Qwen2VLVideoProcessor),
    "qwen2_5_vl": (Qwen2_5_VLProcessor, Qwen2VLVideoProcessor),
    "qwen3_vl": (Qwen3VLProcessor, Qwen3VLVideoProcessor),
}


def main(in_path: str, out_path: str) -> None:
    cases = np.load(in_path)
    directory = Path(str(cases["checkpoint"]))
    family = str(cases["family"]) if "family" in cases.files else "qwen2_vl"
    if family == "llava_onevision":
        processor = llava_onevision(directory)
    else:
        processor = qwen(directory, family)
    out: dict[str, np.ndarray] = {"torchvision_version": np.array(torchvision.__version__)}
    names = sorted({key.split("/")[0] for key in cases.files if "/" in key})
    for name in names:
        png = cases[f"{name}/image"].tobytes()
        images = [Image.open(io.BytesIO(png)).convert("RGB")] if png else None
        extra = {}
        if f"{name}/metadata" in cases.files:
            fps, total, *indices = cases[f"{name}/metadata"].tolist()
            meta = VideoMetadata(
                total_num_frames=int(total), fps=fps, frames_indices=[int(i) for i in indices]
            )
            extra["video_metadata"] = [meta]
        if family != "llava_onevision":
            extra["cap_pixels_per_frame"] = False
        result = processor(
            text=[str(cases[f"{name}/text"])],
            images=images,
            videos=[cases[f"{name}/video"]],
            do_sample_frames=False,
            return_tensors="np",
            **extra,
        )
        for key, value in result.items():
            out[f"{name}/{key}"] = np.asarray(value)
    np.savez(out_path, **out)


def qwen(directory: Path, family: str) -> Any:
    processor_class, video_processor_class = FAMILIES[family]
    return processor_class(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(directory),
        video_processor=video_processor_class.from_pretrained(directory),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(directory),
        chat_template=(directory / "chat_template.jinja").read_text(encoding="utf-8"),
    )


def llava_onevision(directory: Path) -> Any:
    """The checkpoint's ``LlavaOnevisionProcessor`` values (``processor_config.json``)
    with its PIL image processor and its video processor."""
    saved = json.loads((directory / "processor_config.json").read_text(encoding="utf-8"))
    keys = ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio")
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessorPil.from_pretrained(directory),
        video_processor=LlavaOnevisionVideoProcessor.from_pretrained(directory),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(directory),
        chat_template=(directory / "chat_template.jinja").read_text(encoding="utf-8"),
        image_token="<image>",
        video_token="<video>",
        **{key: saved[key] for key in keys},
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
