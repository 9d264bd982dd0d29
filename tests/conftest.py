"""Fixtures shared by every test suite."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import pytest
from ec_frontend.model.builtin import ensure_builtin_checkpoint

_EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def builtin_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen2-VL checkpoint, created once per test session.

    It goes into ``$EC_FRONTEND_CACHE`` when that is set (so repeated runs reuse
    it), else into the session's pytest temporary directory.
    """
    cache = os.environ.get("EC_FRONTEND_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("ec-frontend-cache")
    return ensure_builtin_checkpoint(root)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without Mooncake's native exit handlers once its clients were loaded here.

    At exit, Mooncake's store library unmounts every client's segment from its master;
    a fault test killed some of those masters, and that unmount then retries forever.
    Python's own exit functions still run (they kill any master left over).
    """
    if not any(name in sys.modules for name in ("mooncake.store", "mooncake.engine")):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash.get(_EXIT_STATUS, 1))
