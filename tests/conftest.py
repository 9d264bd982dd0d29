"""Fixtures shared by every test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ec_frontend.model.builtin import ensure_builtin_checkpoint


@pytest.fixture(scope="session")
def builtin_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen2-VL checkpoint, created once per test session.

    It goes into ``$EC_FRONTEND_CACHE`` when that is set (so repeated runs reuse
    it), else into the session's pytest temporary directory.
    """
    cache = os.environ.get("EC_FRONTEND_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("ec-frontend-cache")
    return ensure_builtin_checkpoint(root)
