"""Shared pieces of the media tests: images as bytes, chat bodies, loopback origins."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image

from ..helpers.origin import Origin, origin


def png_bytes(size: int, color: tuple[int, int, int]) -> bytes:
    """A PNG with a pattern (so that two colours give clearly different encoder outputs)."""
    buf = io.BytesIO()
    img = Image.new("RGB", (size, size), color)
    for x in range(0, size, 7):
        img.putpixel((x, (x * 3) % size), (255 - color[0], color[1] // 2, 90))
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_messages(url: str, text: str = "describe it") -> list[dict[str, Any]]:
    """One user message: a text part, then the image (so its param is ``content[1]``)."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


@pytest.fixture(scope="module")
def local_origin() -> Iterator[Origin]:
    with origin("127.0.0.1") as o:
        yield o
