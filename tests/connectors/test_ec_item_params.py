"""vLLM's per-item ec_transfer_params fields, and the ``ec_items`` check."""

from __future__ import annotations

from typing import Any

import pytest
from ec_frontend.connectors.ec_item_params import (
    ec_items_problem,
    flatten_video_patches,
    group_video_patches,
    item_fields,
)
from ec_frontend.connectors.transfer_trust import check_signature, signed
from ec_frontend.model.processor import MultiModalFeature, VideoPatches, video_patch_hash


def test_item_fields_list_every_position_of_a_repeated_item(h_engine: Any) -> None:
    request = h_engine.fake_request("r", 40, images=[("a", 0, 4), ("b", 10, 6), ("a", 30, 4)])
    a, b, _ = (f.mm_hash for f in request.mm_features)
    assert item_fields(request.mm_features) == {
        a: {"modality": "image", "item_indices": [0, 2], "metadata": {"image_grid_thw": [1, 2, 8]}},
        b: {"modality": "image", "item_indices": [1], "metadata": {"image_grid_thw": [1, 2, 12]}},
    }


@pytest.mark.parametrize(
    "change",
    [{"item_indices": [1]}, {"metadata": {"image_grid_thw": [1, 4, 4]}}, {"modality": "video"}],
)
def test_a_signature_covers_the_item_fields(change: dict[str, Any]) -> None:
    secret = b"s" * 32
    entry = {"modality": "image", "item_indices": [0], "metadata": {"image_grid_thw": [1, 2, 8]},
             "peer_host": "127.0.0.1", "peer_port": 5501, "num_tokens": 4}  # fmt: skip
    good = signed(secret, "ec", "ab" * 16, entry, 60.0)
    assert check_signature(secret, "ec", "ab" * 16, good, consume=False) is None
    assert check_signature(secret, "ec", "ab" * 16, {**good, **change}) == "bad signature"


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        (None, None),
        ({"ab": {}}, None),
        ({"ec_items": None}, None),
        ({"ec_items": []}, None),
        ({"ec_items": [{"mm_hash": "ab", "transfer_id": "t"}, {"transfer_id": "u"}]}, None),
        ({"ec_items": "x"}, "must be a list of objects"),
        ({"ec_items": {"mm_hash": "ab"}}, "must be a list of objects"),
        ({"ec_items": [3]}, "ec_items[0] must be an object"),
        ({"ec_items": [{"mm_hash": 3}]}, "ec_items[0].mm_hash must be a non-empty string"),
        ({"ec_items": [{}, {"transfer_id": ""}]}, "ec_items[1].transfer_id"),
        ({"ec_items": [{"transfer_id": "x" * 513}]}, "ec_items[0].transfer_id"),
        ({"ec_items": [{}] * 5}, "5 entries, over the limit of 4"),
    ],
)
def test_ec_items_problem(params: Any, problem: str | None) -> None:
    got = ec_items_problem(params, 4)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


def _patches(video: str, t: int, first_offset: int) -> list[MultiModalFeature]:
    """The ``t`` temporal patch items of a Qwen3-VL video ``video`` (4 rows each)."""
    times = tuple(0.5 + k for k in range(t))
    out = []
    for k in range(t):
        feature = MultiModalFeature(video_patch_hash(video, k), first_offset + 6 * k, 4,
                                    (1, 4, 4), None)  # fmt: skip
        feature.video_patch_of = VideoPatches(video, (t, 4, 4), times, k)
        out.append(feature)
    return out


def test_a_videos_patch_entries_travel_under_one_entry_and_come_back() -> None:
    """An image, a 3-patch video, the image again, the video again: the video is item 1
    and 3; its entry has the grid, the times and each patch's entry; a consumer lifts
    those back beside the rest."""
    video = "cd" * 32
    image = MultiModalFeature("ab" * 32, 0, 4, (1, 2, 8), None)
    features = [image, *_patches(video, 3, 10), image, *_patches(video, 3, 40)]
    fields = item_fields(features)
    assert fields[image.mm_hash]["item_indices"] == [0, 2]
    made = {f.mm_hash: {**fields[f.mm_hash], "peer_port": 5501} for f in features}
    grouped = group_video_patches(dict(made), features)
    assert grouped is not None and set(grouped) == {image.mm_hash, video}
    entry = grouped[video]
    assert entry["modality"] == "video" and entry["item_indices"] == [1, 3]
    assert entry["metadata"] == {"video_grid_thw": [3, 4, 4], "timestamps": [0.5, 1.5, 2.5]}
    patch_hashes = [video_patch_hash(video, k) for k in range(3)]
    assert entry["patches"] == {h: made[h] for h in patch_hashes}
    assert flatten_video_patches(grouped) == {**grouped, **{h: made[h] for h in patch_hashes}}


def test_a_video_missing_a_patch_entry_publishes_no_metadata() -> None:
    """A patch the connector did not publish: no reference could be loaded whole, so
    the proxies get no metadata and send the video itself; the patches that are there
    still travel."""
    video = "cd" * 32
    features = _patches(video, 2, 0)
    one = {features[0].mm_hash: {"peer_port": 5501}}
    grouped = group_video_patches(dict(one), features)
    assert grouped == {video: {"modality": "video", "item_indices": [0], "metadata": {},
                               "patches": one}}  # fmt: skip
    assert group_video_patches({}, features) == {}
    assert group_video_patches(None, features) is None


@pytest.mark.parametrize(
    "params",
    [None, [], {"ab": {"patches": []}}, {"ab": "x"}, {"ab": {"peer_port": 1}}],
)
def test_flattening_leaves_other_params_as_they_are(params: Any) -> None:
    assert flatten_video_patches(params) is params


def test_a_top_level_entry_wins_over_a_patch_entry_of_the_same_item() -> None:
    params = {"v": {"patches": {"p": {"peer_port": 1}}}, "p": {"peer_port": 2}}
    assert flatten_video_patches(params)["p"] == {"peer_port": 2}
