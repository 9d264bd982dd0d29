"""merge_kv/ec_transfer_params through the bindings (DESIGN.md 4.1)."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import ec_frontend as ecf
import pytest

MERGES = [ecf.merge_ec_transfer_params, ecf.merge_kv_transfer_params]
KEYS = {
    ecf.merge_ec_transfer_params: "ec_transfer_params",
    ecf.merge_kv_transfer_params: "kv_transfer_params",
}

# (xargs, params, expected with KEY standing for the merged key)
CASES: list[tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]] = [
    (None, None, None),
    (None, {}, {"KEY": {}}),
    ({}, None, {}),
    ({}, {}, {"KEY": {}}),
    ({"a": 1}, None, {"a": 1}),
    ({"a": 1}, {"h": {"peer_port": 5501}}, {"a": 1, "KEY": {"h": {"peer_port": 5501}}}),
    ({"KEY": {"old": True}, "b": [1, 2]}, {"new": 1}, {"b": [1, 2], "KEY": {"new": 1}}),
    ({"KEY": {"old": True}}, {}, {"KEY": {}}),
    ({"KEY": {"old": True}}, None, {"KEY": {"old": True}}),
    (None, {"ü": "漢字 😀", "e\u0301": "\u0000"}, {"KEY": {"ü": "漢字 😀", "e\u0301": "\u0000"}}),
    (
        {"big": 2**100, "neg": -(2**70)},
        {"u64": 2**64 - 1, "i64": -(2**63)},
        {"big": 2**100, "neg": -(2**70), "KEY": {"u64": 2**64 - 1, "i64": -(2**63)}},
    ),
    (
        None,
        {"f": 0.1, "n": None, "t": True, "l": [1, (2, 3)]},
        {"KEY": {"f": 0.1, "n": None, "t": True, "l": [1, [2, 3]]}},
    ),
]


def _with_key(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        return {(key if k == "KEY" else k): _with_key(v, key) for k, v in value.items()}
    return value


@pytest.mark.parametrize("merge", MERGES, ids=["ec", "kv"])
@pytest.mark.parametrize(("xargs", "params", "expected"), CASES)
def test_merge_semantics(
    merge: Any,
    xargs: dict[str, Any] | None,
    params: dict[str, Any] | None,
    expected: dict[str, Any] | None,
) -> None:
    key = KEYS[merge]
    xargs = _with_key(xargs, key)
    params = _with_key(params, key)
    before = (copy.deepcopy(xargs), copy.deepcopy(params))
    got = merge(xargs, params)
    assert got == _with_key(expected, key)
    assert (xargs, params) == before, "the caller's dicts must not change"
    if got is not None:
        assert got is not xargs and got is not params
        if params is not None:
            assert got[key] is not params
            got[key]["mutated"] = 1
            assert "mutated" not in params


def test_result_types_are_exact() -> None:
    got = ecf.merge_kv_transfer_params({"i": 2**100, "f": 1.0, "b": False}, {})
    assert got is not None
    assert type(got["i"]) is int and type(got["f"]) is float and type(got["b"]) is bool


def test_cli_prints_forwarded_empty_params() -> None:
    code = "import ec_frontend as e; print(e.merge_ec_transfer_params(None, {}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "{'ec_transfer_params': {}}"


def _deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("xargs", "params", "code", "param"),
    [
        (None, _deep(10_000), "limit_exceeded", "ec_transfer_params"),
        (_deep(500), None, "limit_exceeded", "vllm_xargs"),
        ([1], None, "invalid_type", "vllm_xargs"),
        (None, "x", "invalid_type", "ec_transfer_params"),
        (None, {1: "int key"}, "invalid_type", "ec_transfer_params"),
        (None, {"f": float("nan")}, "invalid_value", "ec_transfer_params"),
        (None, {"o": object()}, "invalid_type", "ec_transfer_params"),
    ],
    ids=["deep-params", "deep-xargs", "xargs-list", "params-str", "int-key", "nan", "object"],
)
def test_merge_refuses_bad_values(xargs: Any, params: Any, code: str, param: str) -> None:
    with pytest.raises(ecf.RequestError) as info:
        ecf.merge_ec_transfer_params(xargs, params)
    assert (info.value.code, info.value.param) == (code, param)
    assert info.value.message


def test_self_referencing_dict_is_refused_not_crashed() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(ecf.RequestError) as info:
        ecf.merge_kv_transfer_params(None, loop)
    assert info.value.code == "limit_exceeded"
