"""A pydantic v2 mirror of vLLM's ``ChatCompletionRequest`` sampling fields.

Field names and defaults follow vLLM's OpenAI protocol (``ChatCompletionRequest``,
``_DEFAULT_SAMPLING_PARAMS``, ``to_sampling_params`` and ``SamplingParams``'s checks),
with the deliberate differences of this project: transfer params merge by DESIGN.md
4.1 (an explicit ``{}`` is forwarded), and OpenAI's ranges are enforced for
``temperature`` (0..2), ``top_logprobs`` (0..20) and ``n`` (1..128).

Test and benchmark code only: the product parses in Rust.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LONG_MIN = -(2**63)
LONG_MAX = 2**63 - 1
SAMPLING_EPS = 1e-5
DEFAULT_SAMPLING_PARAMS = {
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL
    uuid: str | None = None


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ChatCompletionRequest(BaseModel):
    """The sampling-relevant part of vLLM's chat request; other fields are allowed."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage]
    model: str | None = None
    frequency_penalty: float | None = 0.0
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = 0.0
    seed: int | None = Field(None, ge=LONG_MIN, le=LONG_MAX)
    stop: str | list[str] | None = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    echo: bool = False
    add_generation_prompt: bool = True
    prompt_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.stream_options and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= 20:
                raise ValueError("top_logprobs must be in [0, 20]")
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("when using top_logprobs, logprobs must be set to true")
        if self.prompt_logprobs is not None:
            if not -1 <= self.prompt_logprobs <= 20:
                raise ValueError("prompt_logprobs must be -1 or in [0, 20]")
            if self.stream and self.prompt_logprobs != 0:
                raise ValueError("prompt_logprobs are not available when stream is true")
        return self

    def to_sampling_params(self) -> dict[str, Any]:
        """vLLM's ``to_sampling_params`` followed by ``SamplingParams``' checks and
        normalizations, as a dict with the keys of ``ParsedRequest.sampling``."""
        defaults = DEFAULT_SAMPLING_PARAMS

        def pick(value: Any, key: str) -> Any:
            return defaults[key] if value is None else value

        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.top_logprobs
        stop = self.stop if self.stop is not None else []
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": float(pick(self.temperature, "temperature")),
            "top_p": float(pick(self.top_p, "top_p")),
            "top_k": int(pick(self.top_k, "top_k")),
            "min_p": float(pick(self.min_p, "min_p")),
            "seed": self.seed,
            "stop": [stop] if isinstance(stop, str) else list(stop),
            "stop_token_ids": list(self.stop_token_ids or []),
            "n": 1 if self.n is None else self.n,
            "presence_penalty": float(self.presence_penalty or 0.0),
            "frequency_penalty": float(self.frequency_penalty or 0.0),
            "repetition_penalty": float(pick(self.repetition_penalty, "repetition_penalty")),
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "prompt_logprobs": prompt_logprobs,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "extra_args": self._extra_args(),
        }
        _verify(params)
        if params["top_k"] == -1:
            params["top_k"] = 0
        if params["temperature"] < SAMPLING_EPS:
            params.update(top_p=1.0, top_k=0, min_p=0.0)
        return params

    def _extra_args(self) -> dict[str, Any] | None:
        """DESIGN.md 4.1: present params (even ``{}``) win; the inputs are not changed."""
        extra = self.vllm_xargs
        for key, value in (
            ("kv_transfer_params", self.kv_transfer_params),
            ("ec_transfer_params", self.ec_transfer_params),
        ):
            if value is not None:
                extra = {**(extra or {}), key: value}
        return extra


def _verify(p: dict[str, Any]) -> None:
    checks = [
        (p["max_tokens"] is None or p["max_tokens"] >= 1, "max_tokens must be at least 1"),
        (1 <= p["n"] <= 128, "n must be in [1, 128]"),
        (0.0 <= p["temperature"] <= 2.0, "temperature must be in [0, 2]"),
        (0.0 < p["top_p"] <= 1.0, "top_p must be in (0, 1]"),
        (-1 <= p["top_k"] <= 2**31 - 1, "top_k must be -1 or at least 0"),
        (0.0 <= p["min_p"] <= 1.0, "min_p must be in [0, 1]"),
        (-2.0 <= p["presence_penalty"] <= 2.0, "presence_penalty must be in [-2, 2]"),
        (-2.0 <= p["frequency_penalty"] <= 2.0, "frequency_penalty must be in [-2, 2]"),
        (p["repetition_penalty"] > 0.0, "repetition_penalty must be positive"),
        (all(0 <= t < 2**31 for t in p["stop_token_ids"]), "stop_token_ids out of range"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
