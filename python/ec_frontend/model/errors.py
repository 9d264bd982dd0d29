"""The error raised for inputs the model layer cannot process."""

from __future__ import annotations


class InputError(ValueError):
    """A request input that cannot be turned into model inputs (maps to HTTP 400).

    ``code`` is a short machine-readable reason: ``invalid_image``,
    ``image_too_large``, ``too_many_tokens``, ``empty_prompt``,
    ``invalid_token_id``, ``placeholder_mismatch``, ``invalid_features``,
    ``invalid_media_index``, ``invalid_template``, ``invalid_processor_kwargs``,
    ``invalid_video``, ``video_too_large``, ``video_too_long``, ``unsupported_video``,
    ``invalid_image_embeds``, ``invalid_video_embeds``.
    ``param`` names the request part at fault when one is known (a media item's
    ``param``, e.g. ``messages[0].content[1].video_url``).
    """

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class ModelLoadError(RuntimeError):
    """A checkpoint that cannot be loaded as asked (missing files or weights, an
    unsupported architecture, an unavailable device or dtype)."""
