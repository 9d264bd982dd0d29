"""Bad images through the native binding: each is refused with an ``ImageError``
naming the image and a short reason, before any pixel is decoded where the header
already says no (a decompression bomb costs no memory)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from ec_frontend import _core
from PIL import Image

from .corpus import encode, pixels


def native(**kwargs: object) -> object:
    return _core.QwenVlPreprocessor(
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 1280,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        rescale_factor=1 / 255,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
        **kwargs,
    )


def png_header_only(width: int, height: int, payload: bytes = b"") -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height`` (RGB, 8-bit), with ``payload`` as IDAT."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", payload) + chunk(b"IEND", b"")
    )


def bomb() -> bytes:
    """30000 x 30000 RGB PNG: a deflate stream of zero rows (a real bomb's start)."""
    row = b"\0" * (1 + 3 * 30000)
    compressor = zlib.compressobj(9)
    data = b"".join(compressor.compress(row) for _ in range(200)) + compressor.flush()
    return png_header_only(30000, 30000, data)


def rss_bytes() -> int:
    fields = Path("/proc/self/statm").read_text().split()
    return int(fields[1]) * 4096


RGB = Image.fromarray(pixels(40, 60, 3, seed=1))
PNG = encode(RGB, "PNG")
JPEG = encode(RGB, "JPEG", quality=90)
WEBP = encode(RGB, "WEBP", quality=80)
GIF = encode(RGB.quantize(16), "GIF")

BAD: list[tuple[str, bytes, str, str]] = [
    # (id, bytes, code, words the message must contain)
    ("empty", b"", "invalid_image", "is empty"),
    ("random", b"not an image at all, just text" * 3, "invalid_image", "not an image"),
    ("svg", b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "invalid_image",
     "SVG"),
    ("svg_bare", b"<svg width='10' height='10'></svg>", "invalid_image", "SVG"),
    ("tiff", encode(RGB, "TIFF"), "invalid_image", "TIFF"),
    ("heic", b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + b"\0" * 64, "invalid_image", "HEIC"),
    ("png_truncated", PNG[: len(PNG) // 2], "invalid_image", "image 1"),
    ("png_header_only", PNG[:40], "invalid_image", "image 1"),
    ("png_bad_ihdr_crc", PNG[:29] + b"\0\0\0\0" + PNG[33:], "invalid_image", "image 1"),
    ("png_zero_width", png_header_only(0, 10), "invalid_image", "image 1"),
    ("jpeg_truncated", JPEG[: len(JPEG) // 2], "invalid_image", "truncated"),
    ("jpeg_header_garbage", JPEG[:4] + b"\x13\x37" * 40, "invalid_image", "image 1"),
    ("webp_truncated", WEBP[: len(WEBP) // 2], "invalid_image", "image 1"),
    ("gif_truncated", GIF[:20], "invalid_image", "image 1"),
    ("bmp_header_only", b"BM" + b"\0" * 20, "invalid_image", "image 1"),
    ("aspect_ratio", encode(Image.new("RGB", (402, 2)), "PNG"), "invalid_image", "aspect ratio"),
    ("bomb", bomb(), "image_too_large", "30000x30000"),
]  # fmt: skip


@pytest.mark.parametrize(("data", "code", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_image_is_refused_naming_it(data: bytes, code: str, words: str) -> None:
    with pytest.raises(_core.ImageError) as info:
        native().preprocess([PNG, data])
    err = info.value
    assert err.index == 1
    assert err.code == code
    assert str(err).startswith("image 1 ")
    assert words in str(err)


def test_bomb_is_refused_from_the_header_without_memory() -> None:
    data = bomb()
    pre = native()
    pre.preprocess([PNG])  # warm up: allocator pools, thread pool
    before = rss_bytes()
    for _ in range(5):
        with pytest.raises(_core.ImageError, match="more than 64000000 pixels"):
            pre.preprocess([data])
        with pytest.raises(_core.ImageError):
            _core.probe_image(data, formats=["JPEG"])
    # 30000 x 30000 x 3 bytes would be 2.7 GB; allow noise, not a decode.
    assert rss_bytes() - before < 16 * 1024 * 1024
    assert _core.probe_image(data) == ("PNG", 30000, 30000)


def test_formats_outside_the_allowed_set_are_refused() -> None:
    pre = native(formats=["PNG", "JPEG"])
    with pytest.raises(_core.ImageError, match="is a WEBP image; supported formats: PNG, JPEG"):
        pre.preprocess([WEBP])
    assert len(pre.preprocess([PNG, JPEG])) == 2


def test_probe_reads_sizes_from_headers() -> None:
    for data, fmt in ((PNG, "PNG"), (JPEG, "JPEG"), (WEBP, "WEBP"), (GIF, "GIF")):
        assert _core.probe_image(data) == (fmt, 60, 40)
    assert _core.probe_image(encode(RGB, "BMP")) == ("BMP", 60, 40)


def test_grid_from_size_matches_preprocessing() -> None:
    pre = native()
    for h, w in ((40, 60), (1, 1), (720, 1280), (3000, 4000), (2, 400)):
        image = encode(Image.new("RGB", (w, h), (10, 20, 30)), "PNG")
        ((buf, shape, grid),) = pre.preprocess([image], max_pixels=200_000)
        assert grid == pre.grid(w, h, max_pixels=200_000)
        assert shape[0] == grid[0] * grid[1] * grid[2]
        assert len(buf) == shape[0] * shape[1]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_pixels"):
        native().preprocess([PNG], min_pixels=10_000, max_pixels=100)
    with pytest.raises(ValueError, match="resample"):
        native(resample=1)
    with pytest.raises(ValueError, match="unknown image format"):
        native(formats=["TIFF"])


def test_pixel_buffer_is_shared_without_a_copy() -> None:
    ((buf, shape, _),) = native().preprocess([PNG])
    view = memoryview(buf)
    assert view.format == "f" and view.nbytes == shape[0] * shape[1] * 4
    a = np.frombuffer(buf, dtype=np.float32)
    b = np.frombuffer(buf, dtype=np.float32)
    assert np.shares_memory(a, b)
    a[0] = 123.0
    assert b[0] == 123.0
