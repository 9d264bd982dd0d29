"""The media flags of ``ec-frontend serve``: bad values stop the start, and
``--no-fetch-media-urls`` refuses every URL item."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..helpers.origin import Origin, Route
from ..server.conftest import ServerProcess
from .conftest import image_messages, png_bytes


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--allowed-media-networks", "10.0.0.0/33"], "--allowed-media-networks"),
        (["--allowed-media-networks", "not-a-network"], "--allowed-media-networks"),
        (["--allowed-local-media-path", "/nonexistent/media"], "not a directory"),
        (["--media-fetch-timeout", "0"], "--media-fetch-timeout must be > 0"),
        (["--max-media-item-bytes", "0"], "--max-media-item-bytes must be > 0"),
        (["--max-media-redirects", "-1"], "--max-media-redirects must be >= 0"),
        (["--media-cache-bytes", "-5"], "--media-cache-bytes must be >= 0"),
    ],
)
def test_bad_media_flags_stop_the_start(flags: list[str], message: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--mock-engine", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def test_file_as_local_path_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    r = subprocess.run(
        [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--mock-engine",
         "--allowed-local-media-path", str(f)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "not a directory" in r.stderr


@pytest.fixture(scope="module")
def no_fetch() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        ["--mock-engine", "--no-fetch-media-urls", "--allowed-media-networks", "127.0.0.0/8"]
    )
    yield proc
    assert proc.stop() == 0


def test_no_fetch_refuses_url_items_without_a_connection(
    no_fetch: ServerProcess, local_origin: Origin
) -> None:
    url = local_origin.set("/never.png", Route(png_bytes(28, (1, 2, 3))))
    before = local_origin.accepted
    for path, body in [
        ("/v1/chat/completions", {"messages": image_messages(url), "max_tokens": 1}),
        ("/tokenize", {"messages": image_messages(url)}),
    ]:
        r = httpx.post(no_fetch.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (
            "messages[0].content[1].image_url",
            "unsupported_media_url",
        )
    assert local_origin.accepted == before
