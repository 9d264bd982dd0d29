"""Image bytes -> RGB PIL image, with every failure as an :class:`InputError`.

Only the decoders in ``formats`` are reachable (PNG, JPEG, WebP, GIF and BMP
by default), and an image's size is read from its header and checked before
any pixel is decoded, so a decompression bomb costs no memory.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from ec_frontend import _core
from ec_frontend.model.errors import InputError

#: Largest image (width x height) that is decoded; below PIL's bomb warning.
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000
#: Pillow format names of the decoders a request may reach.
DEFAULT_IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: The formats the Rust core decodes (and probes).
_NATIVE_FORMATS = frozenset(DEFAULT_IMAGE_FORMATS)


def _open(data: bytes, index: int, formats: tuple[str, ...]) -> Image.Image:
    """The image with only its header read (Pillow decodes on ``load()``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Image.open(io.BytesIO(data), formats=list(formats))
    except Image.DecompressionBombError as exc:
        raise InputError(f"image {index} is too large: {exc}", code="image_too_large") from exc
    except UnidentifiedImageError as exc:
        allowed = ", ".join(formats)
        raise InputError(
            f"image {index} is not an image in an allowed format ({allowed})",
            code="invalid_image",
        ) from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise InputError(f"image {index} could not be read: {exc}", code="invalid_image") from exc


def probe_image(
    data: bytes, *, index: int, formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS
) -> tuple[str, int, int]:
    """``(format, width, height)`` from the header of ``data``; nothing is decoded.

    The Rust core's probe reads the header when it knows every format in ``formats``
    (it names formats it does not decode, SVG, TIFF or HEIC, in its error); Pillow's
    otherwise."""
    if not data:
        raise InputError(f"image {index} is empty", code="invalid_image")
    if all(f.upper() in _NATIVE_FORMATS for f in formats):
        try:
            fmt, width, height = _core.probe_image(data, index=index, formats=list(formats))
        except _core.ImageError as exc:
            raise InputError(str(exc), code=exc.code) from exc
        return fmt, width, height
    image = _open(data, index, formats)
    try:
        width, height = image.size
        return str(image.format), width, height
    finally:
        image.close()


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' ``convert_rgb`` makes it: an image with transparency (an
    alpha band or a transparent palette / colour key) is composited over white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(
    data: bytes | None,
    *,
    index: int,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS,
) -> Image.Image:
    """Decode ``data`` (one of ``formats``) into an RGB image.

    ``index`` names the media item in error messages. Raises :class:`InputError`
    for missing, undecodable or oversized images; the size is checked from the
    header, before decoding.
    """
    if data is None:
        raise InputError(
            f"image {index} has no inline data; remote image URLs must be fetched first",
            code="invalid_image",
        )
    if not data:
        raise InputError(f"image {index} is empty", code="invalid_image")
    image = _open(data, index, formats)
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise InputError(
            f"image {index} is {width}x{height}, more than {max_pixels} pixels",
            code="image_too_large",
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image.load()
            return _to_rgb(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InputError(
            f"image {index} could not be decoded: {exc}", code="invalid_image"
        ) from exc
