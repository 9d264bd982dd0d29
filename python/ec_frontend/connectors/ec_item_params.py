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
``{"video_grid_thw": [t, h, w], "second_per_grid_ts": [0.75]}``). vLLM's EPD
proxy turns them into metadata-only ``image_embeds`` / ``video_embeds`` references
for the prefill/decode instance. ec-frontend's producers add these fields next to
their own transfer fields (before signing, so a signature covers them).

A Qwen3-VL video is encoded as one item per temporal patch (its prompt puts each
patch's time between them), but published as one entry, as vLLM's proxy expects
one per item it sent: keyed by the video's ``mm_hash``, with the video's
``video_grid_thw`` and ``timestamps`` (the time of each patch, vLLM's key) as its
metadata and the patch items' own entries, each as its connector made and signed it,
under ``"patches"`` (:func:`group_video_patches`). A consumer lifts those back to
the top level (:func:`flatten_video_patches`), where its connector looks items up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar, cast

from ec_frontend.types import JSONDict, JSONObject

if TYPE_CHECKING:
    from ec_frontend.model.processor import MultiModalFeature

_T = TypeVar("_T")

IMAGE = "image"
#: The metadata key of a video's seconds per temporal patch (vLLM's name).
SECOND_PER_GRID_TS = "second_per_grid_ts"
#: The metadata key of a video's time of each temporal patch (vLLM's name).
TIMESTAMPS = "timestamps"
#: The key of a whole video's entry under which its patch items' entries travel.
PATCHES = "patches"


def source_indices(features: Sequence[MultiModalFeature]) -> list[int]:
    """Each feature's position among the request's media items (in prompt order,
    images and videos together): the temporal patch items of one video share one."""
    out: list[int] = []
    count = -1
    for feature in features:
        whole = getattr(feature, "video_patch_of", None)
        if whole is None or whole.patch == 0:
            count += 1
        out.append(count)
    return out


def item_fields(features: Sequence[MultiModalFeature]) -> dict[str, JSONObject]:
    """``{mm_hash: {"modality", "item_indices", "metadata"}}`` for ``features``; a
    video's metadata is its ``video_grid_thw`` (and its ``second_per_grid_ts``)."""
    items: dict[str, JSONObject] = {}
    indices: dict[str, list[int]] = {}
    for index, feature in zip(source_indices(features), features, strict=True):
        known = indices.get(feature.mm_hash)
        if known is None:
            indices[feature.mm_hash] = known = [index]
            items[feature.mm_hash] = {
                "modality": getattr(feature, "modality", IMAGE),
                "item_indices": known,
                "metadata": metadata(feature),
            }
        elif known[-1] != index:
            known.append(index)
    return items


def group_video_patches(
    params: JSONDict | None, features: Sequence[MultiModalFeature]
) -> JSONDict | None:
    """``params`` (a producer's ``{mm_hash: entry}``) with the entries of each video's
    temporal patch items moved under one entry for the video: ``{"modality":
    "video", "item_indices": [...], "metadata": {"video_grid_thw", "timestamps"},
    "patches": {patch mm_hash: entry}}``. The metadata is empty (the proxies then send
    the video itself) unless every patch has its entry."""
    if not params:
        return params
    videos: dict[str, JSONDict] = {}
    counts: dict[str, int] = {}
    for index, feature in zip(source_indices(features), features, strict=True):
        whole = getattr(feature, "video_patch_of", None)
        if whole is None:
            continue
        group = videos.get(whole.mm_hash)
        if group is None:
            t, h, w = whole.grid
            group = videos[whole.mm_hash] = {
                "modality": "video",
                "item_indices": [],
                "metadata": {"video_grid_thw": [t, h, w], TIMESTAMPS: list(whole.times)},
                PATCHES: {},
            }
            counts[whole.mm_hash] = t
        indices = group["item_indices"]
        assert isinstance(indices, list)
        if not indices or indices[-1] != index:
            indices.append(index)
        entry = params.pop(feature.mm_hash, None)
        patches = group[PATCHES]
        assert isinstance(patches, dict)
        if entry is not None:
            patches[feature.mm_hash] = entry
    for mm_hash, group in videos.items():
        patches = group[PATCHES]
        assert isinstance(patches, dict)
        if not patches:
            continue
        if len(patches) < counts[mm_hash]:
            group["metadata"] = {}
        params[mm_hash] = group
    return params or None


def flatten_video_patches(params: _T) -> _T:
    """A consumer's ``ec_transfer_params`` with each whole video's ``"patches"`` lifted
    to the top level (an entry already there is kept), so that connectors find every
    patch item by its own ``mm_hash``; anything else as it is."""
    if not isinstance(params, dict):
        return params
    out: dict[str, object] | None = None
    for entry in params.values():
        patches = entry.get(PATCHES) if isinstance(entry, dict) else None
        if not isinstance(patches, dict):
            continue
        if out is None:
            out = dict(params)
        for mm_hash, item in patches.items():
            out.setdefault(mm_hash, item)
    return params if out is None else cast("_T", out)


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
