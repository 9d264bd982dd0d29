"""The per-item fields vLLM's EPD protocol puts in every ``ec_transfer_params`` entry.

vLLM's EC producers report, for each ``mm_hash`` of a finished request::

    {"modality": "image", "item_indices": [0, 2],
     "metadata": {"image_grid_thw": [t, h, w]}}

``item_indices`` are the positions of the item in the request's multimodal
features (in prompt order, images and videos together; a repeated item lists
each position) and ``metadata`` what the consumer needs to size the item's
placeholder without the media: for Qwen2-VL images, the ``image_grid_thw`` the
processor produced; for its videos (``"modality": "video"``), the
``video_grid_thw``, and for a Qwen2.5-VL video also ``second_per_grid_ts`` (the
seconds per temporal patch, as vLLM's per-item list of one number:
``{"video_grid_thw": [t, h, w], "second_per_grid_ts": [0.75]}``). It is empty for
an item whose placement needs more than that (Qwen3-VL's timestamps,
LLaVA-OneVision's videos): both proxies then send the item itself, and the
consumer still loads its encoder output. vLLM's EPD proxy turns them into
metadata-only ``image_embeds`` / ``video_embeds`` references for the
prefill/decode instance. ec-frontend's producers add these fields next to their
own transfer fields (before signing, so a signature covers them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ec_frontend.types import JSONDict, JSONObject

if TYPE_CHECKING:
    from ec_frontend.model.processor import MultiModalFeature

IMAGE = "image"
#: The metadata key of a video's seconds per temporal patch (vLLM's name).
SECOND_PER_GRID_TS = "second_per_grid_ts"


def item_fields(features: Sequence[MultiModalFeature]) -> dict[str, JSONObject]:
    """``{mm_hash: {"modality", "item_indices", "metadata"}}`` for ``features``; a
    video's metadata is its ``video_grid_thw`` (and its ``second_per_grid_ts``)."""
    items: dict[str, JSONObject] = {}
    indices: dict[str, list[int]] = {}
    for index, feature in enumerate(features):
        known = indices.get(feature.mm_hash)
        if known is None:
            indices[feature.mm_hash] = known = [index]
            items[feature.mm_hash] = {
                "modality": getattr(feature, "modality", IMAGE),
                "item_indices": known,
                "metadata": metadata(feature),
            }
        else:
            known.append(index)
    return items


def metadata(feature: MultiModalFeature) -> JSONObject:
    """What sizes and places ``feature`` without its media (empty when that is more
    than a reference carries): its grid under ``<modality>_grid_thw``, and a video's
    ``second_per_grid_ts`` as a list of one number, the shape of vLLM's per-item
    metadata (its EPD proxy copies every value as a list)."""
    if not getattr(feature, "sized_by_grid", True):
        return {}
    modality = getattr(feature, "modality", IMAGE)
    out: JSONDict = {f"{modality}_grid_thw": published_grid(feature)}
    seconds = getattr(feature, "second_per_grid_ts", None)
    if seconds is not None:
        out[SECOND_PER_GRID_TS] = [seconds]
    return out


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
