"""The hand-written stub ``_core.pyi`` and the native module name the same API."""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import ec_frontend
import ec_frontend._core as core
import pytest

STUB = Path(ec_frontend.__file__).with_name("_core.pyi")


def _stub_api() -> dict[str, set[str]]:
    """Top-level names of the stub, each with the members it declares (classes)."""
    tree = ast.parse(STUB.read_text())
    api: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            api[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            api[node.name] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            api[node.target.id] = set()
    api.pop("Endpoint", None)
    return api


API = _stub_api()


@pytest.mark.parametrize("name", sorted(API))
def test_stub_names_exist_at_runtime(name: str) -> None:
    obj = getattr(core, name)
    for member in API[name]:
        if member == "__buffer__" and sys.version_info < (3, 12):
            # PEP 688: before 3.12 the buffer protocol is a C slot with no attribute;
            # tests/preprocess/test_bad_input.py takes a memoryview of a PixelBuffer.
            continue
        assert hasattr(obj, member), f"{name}.{member} is in the stub but not in the module"


def test_runtime_api_is_in_the_stub() -> None:
    public = {n for n in dir(core) if not n.startswith("_")} | {"__version__"}
    assert public == set(API)
    for name in ("Limits", "MediaItem", "ParsedRequest"):
        runtime = {n for n, _ in inspect.getmembers(getattr(core, name)) if not n.startswith("_")}
        assert runtime <= API[name], f"{name}: {sorted(runtime - API[name])} missing from the stub"


def test_package_reexports_everything() -> None:
    assert set(ec_frontend.__all__) == set(API)
