"""``ec-frontend proxy`` on the command line: flags and startup errors."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ec_frontend.entrypoints.cli", "proxy", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_help_lists_the_stages() -> None:
    out = run("--help")
    assert out.returncode == 0
    for flag in ("--encode", "--prefill", "--decode", "--host", "--port", "--transfer-secret"):
        assert flag in out.stdout


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ((), 2, "--decode"),
        (("--decode", "localhost:8000"), 2, "not an http(s) URL"),
        (("--encode", "ftp://e", "--decode", "http://127.0.0.1:1"), 2, "not an http(s) URL"),
        (("--decode", "http://127.0.0.1:1", "--transfer-secret", "short"), 2, "at least 16 bytes"),
        (
            ("--decode", "http://127.0.0.1:1", "--transfer-secret-file", "/nonexistent/secret"),
            2,
            "cannot read --transfer-secret-file",
        ),
    ],
)
def test_startup_errors(args: tuple[str, ...], code: int, message: str) -> None:
    out = run(*args)
    assert out.returncode == code
    assert message in out.stderr
