"""vLLM's per-item ec_transfer_params fields, and the ``ec_items`` check."""

from __future__ import annotations

from typing import Any

import pytest
from ec_frontend.connectors.ec_item_params import ec_items_problem, item_fields
from ec_frontend.connectors.transfer_trust import check_signature, signed


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
