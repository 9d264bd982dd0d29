"""Running test code under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before Triton is first imported: in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, *, args: Sequence[str] = (), timeout_s: float = 600) -> str:
    """Run ``code`` with ``python -c`` (``args`` in ``sys.argv[1:]``) from the
    repository root (so ``tests.…`` imports) with the interpreter on; its stdout,
    after asserting it exited 0."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, *(a for a in args if a)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
