"""A deterministic corpus of encoded images for the preprocessing tests and bench.

Every case is real file bytes written by Pillow (or, for 16-bit colour PNG, which
Pillow cannot write, by a small PNG writer here), with content that is smooth plus
noise so that resampling and colour conversion differences would show.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    #: ``min_pixels`` / ``max_pixels`` for this request (absent: the processor's own).
    pixels: dict[str, int] = field(default_factory=dict)


def pixels(h: int, w: int, channels: int, seed: int) -> np.ndarray:
    """Smooth waves plus noise, ``(h, w, channels)`` uint8."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    planes = [
        128
        + 70 * np.sin(x / (3 + 5 * k) + k) * np.cos(y / (4 + 3 * k) + 2 * k)
        + rng.normal(0, 25, (h, w))
        for k in range(channels)
    ]
    return np.clip(np.stack(planes, -1), 0, 255).astype(np.uint8)


def encode(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def png16(array: np.ndarray) -> bytes:
    """A 16-bit PNG (grey, grey+alpha, RGB or RGBA by the last axis) of ``uint16`` data."""
    h, w = array.shape[:2]
    channels = 1 if array.ndim == 2 else array.shape[2]
    color_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    rows = array.astype(">u2").reshape(h, w * channels).tobytes()
    stride = w * channels * 2
    raw = b"".join(b"\0" + rows[i * stride : (i + 1) * stride] for i in range(h))

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


# Sizes (h, w): tiny, odd, extreme aspect ratios (up to 200), around the merge factor.
SIZES: tuple[tuple[int, int], ...] = (
    (1, 1), (1, 2), (2, 1), (3, 3), (5, 7), (13, 11), (28, 28), (27, 29), (56, 56),
    (57, 83), (97, 131), (131, 97), (100, 37), (37, 100), (1, 200), (200, 1), (2, 400),
    (400, 2), (3, 150), (150, 3), (64, 255), (255, 64), (120, 160), (161, 119),
)  # fmt: skip

# Per-request pixel ranges (besides the processor's own).
PIXEL_RANGES: tuple[dict[str, int], ...] = (
    {},
    {"max_pixels": 28 * 28 * 4},
    {"min_pixels": 112 * 112},
    {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16},
    {"min_pixels": 56 * 56, "max_pixels": 200 * 300},
)


def _variants(
    h: int, w: int, seed: int, keep: Callable[[int], bool]
) -> Iterator[tuple[str, bytes]]:
    """The encoded variants whose position ``v`` passes ``keep(v)`` (others are skipped
    before they are encoded)."""
    rgb = Image.fromarray(pixels(h, w, 3, seed))
    rgba = pixels(h, w, 4, seed + 1)
    rgba[..., 3] = np.where(rgba[..., 3] < 90, 0, rgba[..., 3])  # some fully transparent
    rgba_im = Image.fromarray(rgba, "RGBA")
    grey = Image.fromarray(pixels(h, w, 1, seed + 2)[..., 0])
    if keep(0):
        yield "png_rgb", encode(rgb, "PNG")
    if keep(1):
        yield "png_rgba", encode(rgba_im, "PNG")
    if keep(2):
        yield "png_grey", encode(grey, "PNG")
    if keep(3):
        yield "png_la", encode(Image.fromarray(pixels(h, w, 2, seed + 3), "LA"), "PNG")
    if keep(4):
        yield "png_palette", encode(rgb.quantize(37, method=Image.Quantize.FASTOCTREE), "PNG")
    palette_t = rgb.quantize(16, method=Image.Quantize.FASTOCTREE)
    if keep(5):
        yield "png_palette_trns", encode(palette_t, "PNG", transparency=3)
    if keep(6):
        yield "png_1bit", encode(grey.convert("1"), "PNG")
    wide = (pixels(h, w, 1, seed + 4)[..., 0].astype(np.uint16) * 3) % 400
    if keep(7):
        yield "png_grey16", encode(Image.fromarray(wide.astype(np.uint16)), "PNG")
    if keep(8):
        yield "png_rgb16", png16(pixels(h, w, 3, seed + 5).astype(np.uint16) * 257 + 13)
    if keep(9):
        yield "png_rgba16", png16(pixels(h, w, 4, seed + 6).astype(np.uint16) * 251)
    if keep(10):
        yield "jpeg_420", encode(rgb, "JPEG", quality=85)
    if keep(11):
        yield "jpeg_444", encode(rgb, "JPEG", quality=95, subsampling=0)
    if keep(12):
        yield "jpeg_422", encode(rgb, "JPEG", quality=75, subsampling=1)
    if keep(13):
        yield "jpeg_progressive", encode(rgb, "JPEG", quality=80, progressive=True)
    if keep(14):
        yield "jpeg_grey", encode(grey, "JPEG", quality=90)
    if keep(15):
        yield "jpeg_cmyk", encode(Image.fromarray(pixels(h, w, 4, seed + 7), "CMYK"), "JPEG")
    if keep(16):
        yield "webp_lossy", encode(rgb, "WEBP", quality=80)
    if keep(17):
        yield "webp_lossless", encode(rgb, "WEBP", lossless=True)
    if keep(18):
        yield "webp_lossy_alpha", encode(rgba_im, "WEBP", quality=70)
    if keep(19):
        yield "webp_lossless_alpha", encode(rgba_im, "WEBP", lossless=True)
    if keep(20):
        yield "gif", encode(rgb.quantize(64, method=Image.Quantize.FASTOCTREE), "GIF")
    if keep(21):
        yield (
            "gif_transparent",
            encode(rgb.quantize(32, method=Image.Quantize.FASTOCTREE), "GIF", transparency=5),
        )
    frames = [
        rgb.quantize(32, method=Image.Quantize.FASTOCTREE),
        Image.fromarray(pixels(h, w, 3, seed + 8)).quantize(32, method=Image.Quantize.FASTOCTREE),
    ]
    if keep(22):
        yield "gif_animated", encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    if keep(23):
        yield "bmp_rgb", encode(rgb, "BMP")
    if keep(24):
        yield "bmp_grey", encode(grey, "BMP")
    if keep(25):
        yield "bmp_palette", encode(rgb.quantize(20, method=Image.Quantize.FASTOCTREE), "BMP")


def corpus() -> list[Case]:
    """Every format/mode variant at a rotating subset of sizes, a pixel range each,
    plus a few large photos-sized JPEGs and PNGs."""
    cases: list[Case] = []
    n = 0
    for s, (h, w) in enumerate(SIZES):
        # Every variant at every third size, rotating which, so the corpus stays small.
        for kind, data in _variants(h, w, s, lambda v, s=s: (s + v) % 3 == 0):
            pixels_kw = PIXEL_RANGES[n % len(PIXEL_RANGES)]
            n += 1
            cases.append(Case(f"{kind}-{h}x{w}-{n}", data, pixels_kw))
    big = Image.fromarray(pixels(600, 800, 3, seed=99)).resize((4000, 3000), Image.BICUBIC)
    cases.append(Case("jpeg_420-3000x4000", encode(big, "JPEG", quality=90)))
    cases.append(
        Case(
            "jpeg_progressive-4000x3000",
            encode(big.transpose(Image.Transpose.ROTATE_90), "JPEG", quality=85, progressive=True),
        )
    )
    cases.append(
        Case(
            "png_rgb-720x1280", encode(big.crop((0, 0, 1280, 720)), "PNG"), {"max_pixels": 12845056}
        )
    )
    cases.append(
        Case("webp_lossy-1080x1920", encode(big.crop((100, 100, 2020, 1180)), "WEBP", quality=85))
    )
    return cases
