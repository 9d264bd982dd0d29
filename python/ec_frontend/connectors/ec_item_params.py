"""The per-item fields vLLM's EPD protocol puts in every ``ec_transfer_params`` entry.

vLLM's EC producers report, for each ``mm_hash`` of a finished request::

    {"modality": "image", "item_indices": [0, 2],
     "metadata": {"image_grid_thw": [t, h, w]}}

``item_indices`` are the positions of the item in the request's multimodal
features (in prompt order, images and videos together; a repeated item lists
each position) and ``metadata`` what the consumer needs to size the item's
placeholder without the media: for Qwen2-VL images, the ``image_grid_thw`` the
processor produced; for its videos (``"modality": "video"``), the
``video_grid_thw`` (empty for a video whose placement needs more than its grid,
Qwen2.5-VL's frame times: both proxies then send the video itself, and the
consumer still loads its encoder output). vLLM's EPD proxy turns them into metadata-only
``image_embeds`` / ``video_embeds`` references for the prefill/decode instance.
ec-frontend's producers add these fields next to their own transfer fields
(before signing, so a signature covers them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    from ec_frontend.model.processor import MultiModalFeature

IMAGE = "image"


def item_fields(features: Sequence[MultiModalFeature]) -> dict[str, JSONObject]:
    """``{mm_hash: {"modality", "item_indices", "metadata"}}`` for ``features``; a
    video's metadata is its ``video_grid_thw``."""
    items: dict[str, JSONObject] = {}
    indices: dict[str, list[int]] = {}
    for index, feature in enumerate(features):
        known = indices.get(feature.mm_hash)
        if known is None:
            indices[feature.mm_hash] = known = [index]
            modality = getattr(feature, "modality", IMAGE)
            items[feature.mm_hash] = {
                "modality": modality,
                "item_indices": known,
                "metadata": {f"{modality}_grid_thw": published_grid(feature)}
                if getattr(feature, "sized_by_grid", True)
                else {},
            }
        else:
            known.append(index)
    return items


def ec_items_problem(params: object, max_items: int) -> str | None:
    """Why a request's ``ec_transfer_params.ec_items`` cannot be accepted (``None``: it
    is absent or well formed).

    vLLM's EPD proxy lists there, per item, ``{"mm_hash": ..., "transfer_id": ...}``
    (push-style connectors key their transfers by ``transfer_id``); ec-frontend's
    connectors find items by ``mm_hash`` and need nothing from it, but a malformed list
    is refused rather than ignored.
    """
    if not isinstance(params, dict):
        return None
    items = params.get("ec_items")
    if items is None:
        return None
    if not isinstance(items, list):
        return "ec_transfer_params.ec_items must be a list of objects"
    if len(items) > max_items:
        return (
            f"ec_transfer_params.ec_items has {len(items)} entries, over the limit of {max_items}"
        )
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            return f"ec_transfer_params.ec_items[{i}] must be an object"
        for key in ("mm_hash", "transfer_id"):
            value = item.get(key)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= 512):
                return f"ec_transfer_params.ec_items[{i}].{key} must be a non-empty string"
    return None


def published_grid(feature: MultiModalFeature) -> list[int]:
    """The grid a reference to ``feature`` carries: its ``reference_grid`` where it has
    one (a LLaVA-OneVision video's ``[frames, height, width]``), else its grid."""
    grid = getattr(feature, "reference_grid", None) or feature.image_grid_thw
    return list(grid)
