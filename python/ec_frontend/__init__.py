"""ec-frontend: OpenAI-compatible serving for vision-language models with E/P/D disaggregation."""

from __future__ import annotations

from ec_frontend._core import (
    ClipPreprocessor,
    ImageError,
    Limits,
    MediaItem,
    ParsedRequest,
    PixelBuffer,
    QwenVlPreprocessor,
    RequestError,
    __version__,
    compute_mm_hash,
    decode_data_url,
    decode_rgb,
    hash_for_uuid,
    is_valid_mm_hash,
    merge_ec_transfer_params,
    merge_kv_transfer_params,
    parse_request,
    probe_image,
)

__all__ = [
    "ClipPreprocessor",
    "ImageError",
    "Limits",
    "MediaItem",
    "ParsedRequest",
    "PixelBuffer",
    "QwenVlPreprocessor",
    "RequestError",
    "__version__",
    "compute_mm_hash",
    "decode_data_url",
    "decode_rgb",
    "hash_for_uuid",
    "is_valid_mm_hash",
    "merge_ec_transfer_params",
    "merge_kv_transfer_params",
    "parse_request",
    "probe_image",
]
