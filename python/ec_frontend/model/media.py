"""Image bytes -> RGB PIL image, with every failure as an :class:`InputError`."""

from __future__ import annotations

import io
import warnings

from PIL import Image

from ec_frontend.model.errors import InputError

#: Largest image (width x height) that is decoded; below PIL's bomb warning.
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000


def decode_image(
    data: bytes | None, *, index: int, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> Image.Image:
    """Decode ``data`` (any format PIL reads) into an RGB image.

    ``index`` names the media item in error messages. Raises :class:`InputError`
    for missing, undecodable or oversized images.
    """
    if data is None:
        raise InputError(
            f"image {index} has no inline data; remote image URLs must be fetched first",
            code="invalid_image",
        )
    if not data:
        raise InputError(f"image {index} is empty", code="invalid_image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise InputError(
                    f"image {index} is {width}x{height}, more than {max_pixels} pixels",
                    code="image_too_large",
                )
            image.load()
            if image.mode == "P" or image.mode.endswith("A"):
                image = image.convert("RGBA")
            return image.convert("RGB")
    except InputError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InputError(
            f"image {index} could not be decoded: {exc}", code="invalid_image"
        ) from exc
