"""A pydantic v2 mirror of vLLM's ``ChatCompletionRequest`` sampling fields.

Field names and defaults follow vLLM's OpenAI protocol (``ChatCompletionRequest``,
``_DEFAULT_SAMPLING_PARAMS``, ``to_sampling_params`` and ``SamplingParams``'s checks),
with the deliberate differences of this project: transfer params merge by DESIGN.md
4.1 (an explicit ``{}`` is forwarded), and OpenAI's ranges are enforced for
``temperature`` (0..2), ``top_logprobs`` (0..20) and ``n`` (1..128).

Test and benchmark code only: the product parses in Rust.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

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


def _flag(data: dict[str, Any], key: str) -> bool:
    """A boolean field as the model will read it (pydantic's lax coercion).

    vLLM's "before" validators test the raw value's truthiness (``"off"`` counts as
    true there); this project checks the coerced value (docs/compatibility.md).
    """
    try:
        return bool(TypeAdapter(bool | None).validate_python(data.get(key)))
    except ValidationError:
        return bool(data.get(key))


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
    stop: str | Annotated[list[str], Field(max_length=4)] | None = []
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
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    min_tokens: int = 0
    bad_words: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.echo:
            raise ValueError("echo is refused on chat (docs/compatibility.md)")
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
            "logit_bias": _logit_bias(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids,
            "min_tokens": self.min_tokens,
            "bad_words": list(dict.fromkeys(self.bad_words)),
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


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """vLLM's conversion: ``int()`` of each key, each bias clamped to [-100, 100]."""
    if bias is None:
        return None
    return {int(k): min(100.0, max(-100.0, float(v))) for k, v in bias.items()}


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
        (all(0 <= t < 2**31 for t in p["logit_bias"] or ()), "logit_bias ids out of range"),
        (p["allowed_token_ids"] != [], "allowed_token_ids must not be empty"),
        (p["min_tokens"] >= 0, "min_tokens must be at least 0"),
        (all(p["bad_words"]), "bad_words cannot contain an empty string"),
        (
            p["max_tokens"] is None or p["min_tokens"] <= p["max_tokens"],
            "min_tokens must be at most max_tokens",
        ),
        (
            all(0 <= t < 2**31 for t in p["allowed_token_ids"] or ()),
            "allowed_token_ids out of range",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    function: NamedFunction
    type: Literal["function"] = "function"


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(BaseModel):
    json_: Any = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FullChatCompletionRequest(ChatCompletionRequest):
    """The whole field list of vLLM's ``ChatCompletionRequest`` and its "before"
    validators (stream options, logprobs, structured outputs, tools, generation
    prompt, cache salt), written for this benchmark: what vLLM validates per request."""

    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "none"
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    min_tokens: int = 0
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=LONG_MAX)] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: int = 0
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    logits_processors: list[str | dict[str, Any]] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0

    @model_validator(mode="before")
    @classmethod
    def _stream_options(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not _flag(data, "stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return data

    @model_validator(mode="before")
    @classmethod
    def _logprobs(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        prompt_logprobs = data.get("prompt_logprobs")
        if isinstance(prompt_logprobs, int) and _flag(data, "stream") and prompt_logprobs != 0:
            raise ValueError("prompt_logprobs are not available when stream is true")
        top = data.get("top_logprobs")
        if isinstance(top, int) and top > 0 and not _flag(data, "logprobs"):
            raise ValueError("when using top_logprobs, logprobs must be set to true")
        return data

    @model_validator(mode="before")
    @classmethod
    def _structured_outputs(cls, data: Any) -> Any:
        so = data.get("structured_outputs") if isinstance(data, dict) else None
        if (
            isinstance(so, dict)
            and sum(so.get(k) is not None for k in ("json", "regex", "choice")) > 1
        ):
            raise ValueError("only one kind of structured output constraint may be set")
        return data

    @model_validator(mode="before")
    @classmethod
    def _tools(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "tool_choice" not in data and data.get("tools"):
            data["tool_choice"] = "auto"
        choice = data.get("tool_choice")
        if choice not in (None, "none") and not data.get("tools"):
            raise ValueError("tool_choice needs tools")
        return data

    @model_validator(mode="before")
    @classmethod
    def _generation_prompt(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("continue_final_message")
            and data.get("add_generation_prompt")
        ):
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        return data

    @model_validator(mode="before")
    @classmethod
    def _cache_salt(cls, data: Any) -> Any:
        salt = data.get("cache_salt") if isinstance(data, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("cache_salt must be a non-empty string")
        return data
