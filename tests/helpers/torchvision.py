"""The test-only torchvision (``scripts/setup.sh`` installs it outside the venv's
site-packages, so that transformers picks its PIL backend everywhere else): tests that
compare with transformers' torchvision backend run a child with it on the path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TORCHVISION_DIR = Path(sys.prefix) / "extras" / "torchvision"


def torchvision_env() -> dict[str, str]:
    """This process's environment with the test-only torchvision importable; a test
    failure when ``scripts/setup.sh`` did not install it."""
    if not (TORCHVISION_DIR / "torchvision").is_dir():
        pytest.fail(f"the test-only torchvision is not in {TORCHVISION_DIR} (scripts/setup.sh)")
    return dict(os.environ, PYTHONPATH=str(TORCHVISION_DIR))
