"""Type stubs for the native core (`rust/ec-py`, logic in `rust/ec-core`).

Every request body passes through :func:`parse_request`. It parses the raw
bytes, validates them (typed errors naming the parameter path), merges
``kv_transfer_params`` / ``ec_transfer_params`` into ``vllm_xargs``, decodes
inline media and gives each item its key (``mm_hash``). The GIL is released while a body of 32 KiB
or more is parsed (a smaller one parses in microseconds, less than a GIL hand-off).
"""

from __future__ import annotations

from typing import Any, Final, Literal, final

from typing_extensions import Buffer, Self

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

Endpoint = Literal["chat", "completions", "responses", "generate"]

__version__: Final[str]

class RequestError(ValueError):
    """A request that cannot be served as sent (maps to HTTP 400).

    ``param`` is the offending parameter path (``messages[2].content[0].image_url.url``),
    or ``None`` when the body as a whole is at fault (invalid JSON, say).
    ``code`` is a short machine-readable reason: ``invalid_json``, ``invalid_type``,
    ``missing_field``, ``invalid_value``, ``out_of_range``, ``limit_exceeded``,
    ``invalid_base64``, ``invalid_data_url``, ``invalid_utf8``, ``unknown_endpoint``.
    """

    param: str | None
    message: str
    code: str

@final
class Limits:
    """Bounds applied while parsing. All sizes are in bytes.

    ``max_depth`` counts nested arrays and objects (the body object is level 1); values
    above 127 act as 127. ``max_string_bytes`` applies to every string, keys included;
    ``max_media_bytes`` to a request's decoded media together; ``max_token_ids`` to its
    prompt token ids together. An integer literal may have at most 4300 digits.
    """

    def __new__(
        cls,
        *,
        max_body_bytes: int = 64 * 1024 * 1024,
        max_depth: int = 64,
        max_messages: int = 1024,
        max_media_items: int = 64,
        max_string_bytes: int = 16 * 1024 * 1024,
        max_media_bytes: int = 32 * 1024 * 1024,
        max_token_ids: int = 1_048_576,
    ) -> Self: ...
    max_body_bytes: int
    max_depth: int
    max_messages: int
    max_media_items: int
    max_string_bytes: int
    max_media_bytes: int
    max_token_ids: int

@final
class MediaItem:
    """One media item of a request, in order of appearance."""

    @property
    def kind(self) -> Literal["image", "video"]:
        """``image`` (an ``image_url`` / ``input_image`` / ``image_embeds`` part) or
        ``video`` (a ``video_url`` part)."""
    @property
    def mime_type(self) -> str | None: ...
    @property
    def data(self) -> bytes | None:
        """Decoded bytes of an inline (``data:``) item; ``None`` for a URL reference.

        The ``bytes`` object is made on first read (one copy of the decoded buffer) and
        the same object is returned after that; an item whose bytes are never read is
        never copied.
        """
    @property
    def url(self) -> str | None:
        """The http(s) or ``file://`` URL of a referenced item (fetched by the server,
        ``ec_frontend.media``); ``None`` for inline data."""
    @property
    def uuid(self) -> str | None: ...
    @property
    def mm_hash(self) -> str:
        """The item's key: lower-case hex, 64 characters.

        blake3 over the kind of key, the model id, the processor kwargs, the request's
        ``cache_salt``, for a video its sampling options (``media_io_kwargs["video"]``,
        with video tags of their own) and the item: without ``uuid`` its decoded bytes
        (:func:`compute_mm_hash`) or, for a URL reference, the URL (the server replaces
        it by the content key once the item is fetched); with a ``uuid``
        (1 to 512 bytes) the uuid (:func:`hash_for_uuid`), whatever it looks like.
        Each kind has its own domain tag, so no uuid gives the key of some content,
        and requests with different salts never share a key. Every instance computes
        the same key for the same item, salt and kwargs.
        """
    @property
    def param(self) -> str:
        """Where the item sits in the body, e.g. ``messages[0].content[1].image_url``."""
    @property
    def image_grid_thw(self) -> tuple[int, int, int] | None:
        """``(t, h, w)`` of a metadata-only ``image_embeds`` reference (vLLM's EPD
        protocol: no bytes, no URL; its encoder output comes through the EC connector,
        keyed by the hash of its ``uuid``); ``None`` for any other item."""
    @property
    def video_grid_thw(self) -> tuple[int, int, int] | None:
        """``(t, h, w)`` of a metadata-only ``video_embeds`` reference (the same protocol;
        keyed by the hash of its ``uuid`` and the request's ``media_io_kwargs.video``, as
        its encoder keyed the video); ``None`` for any other item."""
    @property
    def second_per_grid_ts(self) -> float | None:
        """The seconds one temporal patch spans, as a ``video_embeds`` reference carries
        it beside its grid (vLLM's ``second_per_grid_ts``: Qwen2.5-VL's absolute time;
        a finite number in ``(0, 86400]``); ``None`` when the reference has none, and
        for any other item."""
    @property
    def timestamps(self) -> list[float] | None:
        """The time in seconds of each temporal patch, as a ``video_embeds`` reference
        carries them beside its grid (vLLM's ``timestamps``, which Qwen3-VL writes into
        the prompt: one per patch of the grid's ``t``, each in ``[0, 86400]``); ``None``
        when the reference has none, and for any other item."""
    def __len__(self) -> int: ...

@final
class ParsedRequest:
    """A validated request, normalized across the four endpoints."""

    @property
    def endpoint(self) -> Endpoint: ...
    @property
    def model(self) -> str | None: ...
    @property
    def stream(self) -> bool: ...
    @property
    def include_usage(self) -> bool: ...
    @property
    def continuous_usage_stats(self) -> bool:
        """``stream_options.continuous_usage_stats`` with ``include_usage``: usage on
        every stream chunk (as vLLM, the flag alone does nothing)."""
    @property
    def stream_interval(self) -> int:
        """vLLM's ``stream_interval`` (chat, completions; default 1): a stream chunk per
        this many tokens, the first and the last sent at once."""
    @property
    def return_token_ids(self) -> bool:
        """vLLM's ``return_token_ids`` (chat, completions, generate)."""
    @property
    def output_mode(self) -> str:
        """Generate's ``output_mode``: ``"tokens"`` (default) or ``"text"``."""
    @property
    def continue_final_message(self) -> bool:
        """vLLM's ``continue_final_message`` (chat; never with ``add_generation_prompt``)."""
    @property
    def truncate_prompt_tokens(self) -> int | None:
        """vLLM's ``truncate_prompt_tokens`` (chat, completions; ``-1``: the context)."""
    @property
    def truncation_side(self) -> str | None:
        """``"left"`` (keep the last tokens), ``"right"`` (the first) or ``None``."""
    @property
    def n(self) -> int: ...
    @property
    def user(self) -> str | None: ...
    @property
    def request_id(self) -> str | None:
        """``request_id`` of a generate request."""
    @property
    def sampling(self) -> dict[str, Any]:
        """Normalized sampling parameters (a fresh dict each call).

        Keys: ``max_tokens`` (int | None), ``temperature``, ``top_p``, ``top_k``,
        ``min_p``, ``seed`` (int | None), ``stop`` (list[str]), ``stop_token_ids``
        (list[int]), ``n``, ``presence_penalty``, ``frequency_penalty``,
        ``repetition_penalty``, ``logprobs`` (int | None: number of top logprobs
        per token), ``prompt_logprobs`` (int | None), ``ignore_eos``,
        ``skip_special_tokens``, ``include_stop_str_in_output``, ``logit_bias``
        (dict[int, float] | None, each bias clamped to [-100, 100]),
        ``allowed_token_ids`` (list[int] | None, never empty), ``min_tokens``,
        ``bad_words`` (list[str], no repeats), ``extra_args`` (the merged
        ``vllm_xargs``: dict | None).

        Defaults are vLLM's: ``temperature`` 1.0, ``top_p`` 1.0, ``top_k`` 0 (disabled;
        a requested -1 is normalized to 0), ``min_p`` 0.0, ``repetition_penalty`` 1.0.
        ``max_tokens`` is ``max_completion_tokens`` or else ``max_tokens`` (chat),
        ``max_output_tokens`` (responses), and when unset ``None`` for chat and
        responses and generate (the rest of the context), 16 for completions.
        """
    @property
    def messages(self) -> list[dict[str, Any]] | None:
        """Chat and responses requests: ``[{"role": str, "content": [part, ...]}]``.

        Each part is ``{"type": "text", "text": str}`` or
        ``{"type": "image", "media_index": int}`` (an index into :attr:`media`).
        A string content becomes one text part. An assistant message may carry
        ``tool_calls`` (OpenAI's list, ``arguments`` a string), a ``tool`` message
        its ``tool_call_id``.
        """
    @property
    def prompts(self) -> list[str | list[int]] | None:
        """Completions requests: the prompt(s), each a string or token ids."""
    @property
    def token_ids(self) -> list[int] | None:
        """Generate requests: the prompt token ids."""
    @property
    def features(self) -> dict[str, Any] | None:
        """Generate requests: multimodal features already placed in ``token_ids``.

        ``{"mm_hashes": [str], "mm_placeholders": [{"offset": int, "length": int}],
        "mm_grid_thw": [[t, h, w]] | None}``; the lists have one entry per item, in
        prompt order (vLLM's per-modality dicts are flattened).
        """
    @property
    def media(self) -> list[MediaItem]: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def ec_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def mm_processor_kwargs(self) -> dict[str, Any] | None: ...
    @property
    def media_io_kwargs(self) -> dict[str, Any] | None:
        """vLLM's ``media_io_kwargs`` (chat, responses), checked: ``video`` may hold
        ``num_frames`` (an integer, -1 to 2**20; 0 or less: every frame) and ``fps``
        (a number; 0 or less: the source's rate); ``image`` must be empty."""
    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None: ...
    @property
    def structured(self) -> dict[str, Any] | None:
        """Structured outputs and tools (chat, completions, responses), or ``None``.

        ``{"constraint": None | {"kind": "json" | "json_object" | "regex" | "choice" |
        "grammar", "spec": Any, "param": str}, "tools": None | [{"name", "description",
        "parameters", "strict"}], "tool_choice": "none" | "auto" | "required" |
        "function", "tool_name": str | None, "parallel_tool_calls": bool}``; shapes are
        checked, the grammar itself is compiled by the engine's library.
        """
    @property
    def add_generation_prompt(self) -> bool: ...
    @property
    def echo(self) -> bool: ...
    @property
    def instructions(self) -> str | None:
        """Responses requests: ``instructions`` (already prepended as a system message)."""
    @property
    def cache_salt(self) -> str | None:
        """vLLM's ``cache_salt`` (chat, completions, responses): a non-empty string.

        It enters every media key of the request (see :attr:`MediaItem.mm_hash`).
        A generate request names its keys itself: there it is an unknown field.
        """
    @property
    def unknown_fields(self) -> list[str]:
        """Top-level fields that were accepted and ignored (for logging).

        Unknown members of a generate request's ``sampling_params`` are listed as
        ``sampling_params.<name>``. Each name once, at most 64 names.
        """
    def to_json(self) -> str:
        """The whole parsed request as JSON (media bytes left out), for logs and tests."""

def parse_request(
    endpoint: str,
    body: bytes | str,
    *,
    model_id: str = "",
    limits: Limits | None = None,
) -> ParsedRequest:
    """Parse and validate a request body.

    ``endpoint`` is ``chat``, ``completions``, ``responses``, ``generate`` or the
    route path (``/v1/chat/completions``, ...). ``model_id`` enters every content
    hash, so instances of one deployment must pass the same value.
    Raises :class:`RequestError`.
    """

def merge_kv_transfer_params(
    xargs: dict[str, Any] | None, params: dict[str, Any] | None
) -> dict[str, Any] | None:
    """``xargs`` with ``params`` under ``"kv_transfer_params"``.

    Present params (even ``{}``) are inserted and win over a same-named key;
    ``None`` leaves ``xargs`` as it is. The caller's dict is never mutated.
    Returns ``None`` only when there is nothing to carry.
    """

def merge_ec_transfer_params(
    xargs: dict[str, Any] | None, params: dict[str, Any] | None
) -> dict[str, Any] | None:
    """As :func:`merge_kv_transfer_params`, under ``"ec_transfer_params"``."""

def compute_mm_hash(
    data: bytes,
    *,
    model_id: str = "",
    processor_kwargs: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    kind: Literal["image", "video"] = "image",
    video_options: dict[str, Any] | None = None,
) -> str:
    """The key (blake3, lower-case hex) :func:`parse_request` gives an inline item without
    ``uuid``: ``data`` are its decoded bytes, ``processor_kwargs`` the request's
    ``mm_processor_kwargs``, ``cache_salt`` its salt; a ``video`` key also covers
    ``video_options`` (the request's ``media_io_kwargs["video"]``)."""

def hash_for_uuid(
    uuid: str,
    *,
    model_id: str = "",
    processor_kwargs: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    kind: Literal["image", "video"] = "image",
    video_options: dict[str, Any] | None = None,
) -> str:
    """The key :func:`parse_request` gives an item that carries ``uuid``, inline or by URL
    (``kind`` and ``video_options`` as for :func:`compute_mm_hash`)."""

def decode_data_url(url: str) -> tuple[str, bytes]:
    """``(mime_type, bytes)`` of a base64 ``data:`` URL. Raises :class:`RequestError`."""

def is_valid_mm_hash(value: str) -> bool:
    """True for a non-empty lower-case hex string of at most 128 characters."""

# --- native image preprocessing (ec_core::preprocess) ---------------------------------

class ImageError(ValueError):
    """An image that cannot be preprocessed. ``str(err)`` is ``"image {index} {message}"``."""

    index: int
    """Position of the failing image in the call's list."""
    message: str
    """Why, without the image's name (``"is truncated"``, ``"is a TIFF image; ..."``)."""
    code: str
    """``"invalid_image"`` or ``"image_too_large"``."""

@final
class PixelBuffer:
    """Float32 pixel values of one image through the buffer protocol (1-D, format ``"f"``,
    writable): ``numpy.frombuffer(buf, dtype=numpy.float32)`` and ``torch.frombuffer``
    wrap it without a copy."""

    def __len__(self) -> int:
        """Number of float32 values."""
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class QwenVlPreprocessor:
    """transformers' Qwen2-VL image processor (PIL backend) in Rust: decode (PNG, JPEG,
    WebP, GIF first frame, BMP), RGB (transparency over white), ``smart_resize``, Pillow's
    resampling, rescale, normalize, patchify. Equal to transformers' output."""

    def __new__(
        cls,
        *,
        min_pixels: int,
        max_pixels: int,
        patch_size: int,
        merge_size: int,
        temporal_patch_size: int,
        rescale_factor: float,
        image_mean: list[float],
        image_std: list[float],
        resample: int = 3,
        formats: list[str] | None = None,
        max_image_pixels: int = 64_000_000,
    ) -> Self:
        """``resample`` is Pillow's number (2 bilinear, 3 bicubic); ``formats`` Pillow's
        names of the decoders allowed (default all five); images over
        ``max_image_pixels`` (from the header) are refused before decoding. Raises
        ``ValueError`` for settings it cannot honour."""

    def grid(
        self,
        width: int,
        height: int,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> tuple[int, int, int]:
        """``(t, h, w)`` of a ``width`` x ``height`` image, from its size alone."""

    def preprocess(
        self,
        images: list[bytes],
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> list[tuple[PixelBuffer, tuple[int, int], tuple[int, int, int]]]:
        """Per image ``(pixels, (rows, patch_dim), (t, h, w))``, in order. The GIL is
        released throughout; the images are processed in parallel. Raises
        :class:`ImageError` for the first failing image (by position)."""

    def preprocess_video(
        self,
        frames: Buffer,
        *,
        index: int = 0,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> tuple[PixelBuffer, tuple[int, int], tuple[int, int, int]]:
        """transformers' ``Qwen2VLVideoProcessor`` rule over ``frames`` (a C-contiguous
        uint8 ``[n, height, width, 3]`` buffer of RGB frames, not written to during the
        call): one target size for all frames, Pillow's resampling (frames in parallel),
        rescale and normalize fused, ``temporal_patch_size`` consecutive frames per
        temporal patch, the last frame repeated to pad. ``(pixels, (rows, patch_dim),
        (t, h, w))``; the GIL is released throughout. Raises :class:`ImageError` (with
        ``index``) for a frame size the rule refuses, ``ValueError`` for a buffer of
        another shape."""

@final
class ClipPreprocessor:
    """transformers' CLIP image processor (PIL backend) in Rust, for CLIP-tower families
    (LLaVA-1.5): decode and RGB as :class:`QwenVlPreprocessor`, the shortest edge resized
    to ``shortest_edge`` with Pillow's resampling, a centre crop, rescale, normalize,
    channel-first. Equal to transformers' output."""

    def __new__(
        cls,
        *,
        shortest_edge: int,
        crop_height: int,
        crop_width: int,
        rescale_factor: float,
        image_mean: list[float],
        image_std: list[float],
        resample: int = 3,
        formats: list[str] | None = None,
        max_image_pixels: int = 64_000_000,
    ) -> Self:
        """As :class:`QwenVlPreprocessor`; a crop larger than ``shortest_edge`` (which
        transformers pads) raises ``ValueError``."""

    def preprocess(
        self, images: list[bytes]
    ) -> list[tuple[PixelBuffer, tuple[int, int, int, int]]]:
        """Per image ``(pixels, (1, 3, crop_height, crop_width))``, in order, the GIL
        released and the images processed in parallel. Raises :class:`ImageError` for the
        first failing image (by position)."""

def probe_image(
    data: bytes, *, index: int = 0, formats: list[str] | None = None
) -> tuple[str, int, int]:
    """``(format, width, height)`` from the header alone (nothing is decoded). Raises
    :class:`ImageError` (with ``index``) for empty, unknown, unsupported or damaged headers."""

def decode_rgb(
    data: bytes,
    *,
    index: int = 0,
    formats: list[str] | None = None,
    max_image_pixels: int = 64_000_000,
) -> tuple[int, int, bytes]:
    """``(width, height, pixels)``: ``data`` decoded to 8-bit RGB as Pillow's decoder plus
    transformers' ``convert_rgb`` give it (rows top to bottom, 3 bytes a pixel), the GIL
    released: the first stage of the preprocessors' ``preprocess``. Raises
    :class:`ImageError` (with ``index``) as they do."""
