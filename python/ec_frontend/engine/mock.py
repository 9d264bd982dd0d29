"""An engine without a model, for measuring the HTTP frontend alone (``--mock-engine``).

It speaks the :class:`~ec_frontend.engine.async_engine.AsyncEngine` interface the
server uses, with a character-level tokenizer (a token id is a Unicode code
point). A request generates ``max_tokens`` tokens (16 when unset) by echoing
its prompt tokens in order, or in a seeded random order when ``temperature >
0``. Stop strings, stop token ids and logprobs behave as the real engine's do.
Transfer params given in ``extra_args`` come back on the finished output, as a
connector's ``request_finished`` would return them, so their path through the
server is observable; ``vllm_xargs: {"mock_fail_after": k}`` makes the
request fail (``finish_reason="error"``) after ``k`` tokens. Bookkeeping stands
in for the KV blocks and encoder-cache references a real engine holds, so the
idle state is observable on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ec_frontend.engine.groups import RequestGroups
from ec_frontend.engine.outputs import RequestOutput, TokenLogprob
from ec_frontend.engine.stats import EngineStats

if TYPE_CHECKING:
    from ec_frontend.config import EngineConfig
    from ec_frontend.engine.core import EngineCore
    from ec_frontend.engine.outputs import EngineCoreOutput, ModelRunnerOutput
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.engine.scheduler import Scheduler
    from ec_frontend.engine.scheduler_output import SchedulerOutput
    from ec_frontend.model.interface import KVCacheSpec
    from ec_frontend.model.processor import InputProcessor
    from ec_frontend.types import JSONObject

#: Prompt characters that stand for one image in a mock chat prompt.
IMAGE_PLACEHOLDER = "\ufffc"
IMAGE_TOKENS = 4
BLOCK_SIZE = 16
DEFAULT_MAX_TOKENS = 16


#: Token ids of the character tokenizer: the Unicode code points.
VOCAB_SIZE = 0x110000


def check_token_ids(token_ids: Sequence[int]) -> list[int]:
    """``token_ids`` as a list; ``ValueError`` (a 400) for an id that is not a Unicode
    scalar value, which the character tokenizer could not decode."""
    ids = list(token_ids)
    for i, t in enumerate(ids):
        if not 0 <= t < VOCAB_SIZE or 0xD800 <= t <= 0xDFFF:
            raise ValueError(
                f"token {i} ({t}) is not in the mock vocabulary (Unicode scalar values)"
            )
    return ids


def _char_or_nothing(token_id: int) -> str:
    return chr(token_id) if token_id > 0 else ""


class CharTokenizer:
    """Token id = Unicode code point; id 0 is the end-of-sequence token."""

    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids if t > 0 or not skip_special_tokens)

    def piece_decoder(self, skip_special_tokens: bool = True) -> Callable[[int], str]:
        """Token -> text, one at a time: a character needs no context."""
        if not skip_special_tokens:
            return chr
        return _char_or_nothing


@dataclass(slots=True)
class MockFeature:
    mm_hash: str
    offset: int
    length: int


@dataclass(slots=True)
class MockInputs:
    """The mock counterpart of ``ProcessedInputs``."""

    prompt_token_ids: list[int]
    mm_features: list[MockFeature] = field(default_factory=list)
    prompt: str | None = None
    cache_salt: str | None = None


#: A checkpoint directory whose image processor the mock runs on every inline image
#: (for benchmarks of the preprocessing path); unset: images are not preprocessed.
MOCK_IMAGE_MODEL_ENV = "EC_FRONTEND_MOCK_IMAGE_MODEL"


class MockProcessor:
    """Flattens chat messages to ``role: text`` lines; an image becomes placeholders."""

    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()
        image_model = os.environ.get(MOCK_IMAGE_MODEL_ENV)
        self.images: InputProcessor | None = None
        if image_model:
            from ec_frontend.model.loader import load_processor

            self.images = load_processor(image_model)

    def process_chat(
        self,
        messages: list[dict[str, Any]],
        media: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        media_io_kwargs: dict[str, Any] | None = None,
    ) -> MockInputs:
        if self.images is not None:
            order = [
                p["media_index"] for m in messages for p in m["content"] if p["type"] == "image"
            ]
            self.images._images(media, order, None)
        # Tools open the prompt as one line of their JSON (as templates put them first).
        pieces: list[str] = [f"tools: {json.dumps(tools)}\n"] if tools else []
        features: list[MockFeature] = []
        offset = len(pieces[0]) if pieces else 0
        for message in messages:
            head = f"{message['role']}: "
            pieces.append(head)
            offset += len(head)
            for part in message["content"]:
                if part["type"] == "text":
                    pieces.append(part["text"])
                    offset += len(part["text"])
                else:
                    item = media[part["media_index"]]
                    features.append(MockFeature(item.mm_hash, offset, IMAGE_TOKENS))
                    pieces.append(IMAGE_PLACEHOLDER * IMAGE_TOKENS)
                    offset += IMAGE_TOKENS
            pieces.append("\n")
            offset += 1
        if continue_final_message and pieces:
            pieces.pop()  # the last message stays open
        if add_generation_prompt:
            pieces.append("assistant: ")
        prompt = "".join(pieces)
        return MockInputs(self.tokenizer.encode(prompt), features, prompt)

    def process_prompt(self, prompt: str | list[int]) -> MockInputs:
        if isinstance(prompt, str):
            return MockInputs(self.tokenizer.encode(prompt), [], prompt)
        return MockInputs(check_token_ids(prompt), [], None)

    def process_generate(self, token_ids: list[int], features: dict[str, Any] | None) -> MockInputs:
        mm: list[MockFeature] = []
        if features:
            for h, ph in zip(features["mm_hashes"], features["mm_placeholders"], strict=True):
                mm.append(MockFeature(h, ph["offset"], ph["length"]))
        return MockInputs(check_token_ids(token_ids), mm, None)


@dataclass(frozen=True, slots=True)
class MockEngineConfig:
    model: str = "mock"
    max_model_len: int = 4096
    max_num_seqs: int = 256
    token_latency_s: float = 0.0


@dataclass(slots=True)
class _MockCounters:
    """The engine counters the mock moves (named as :class:`EngineStats`' fields)."""

    encoder_items_computed_total: int = 0
    encoder_cache_hits_total: int = 0
    prompt_tokens_computed_total: int = 0
    generation_tokens_total: int = 0


def _get(params: Any, name: str, default: Any = None) -> Any:
    value = getattr(params, name, default)
    return default if value is None else value


class MockEngine:
    """Echoes tokens without a model; see the module docstring for the contract."""

    KV_BLOCKS = 65536

    def __init__(self, config: MockEngineConfig | None = None) -> None:
        self.config = config or MockEngineConfig()
        self.processor = MockProcessor()
        self._running: dict[str, int] = {}
        self._aborted: set[str] = set()
        self._refs: dict[str, int] = {}
        self._stats = _MockCounters()
        self._groups: RequestGroups[str] = RequestGroups()

    def stats(self) -> EngineStats:
        blocks = sum(self._running.values())
        c = self._stats
        return EngineStats(
            encoder_items_computed_total=c.encoder_items_computed_total,
            encoder_cache_hits_total=c.encoder_cache_hits_total,
            prompt_tokens_computed_total=c.prompt_tokens_computed_total,
            generation_tokens_total=c.generation_tokens_total,
            num_requests_running=len(self._running),
            kv_blocks_used=blocks,
            kv_cache_usage=blocks / self.KV_BLOCKS,
            encoder_cache_refs=sum(self._refs.values()),
            encoder_cache_usage=len(self._refs) / 1024,
        )

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)

    async def abort_groups(self, groups: Sequence[str]) -> None:
        """Abort every request of ``groups`` (exact names; see ``engine/groups.py``)."""
        for request_id in self._groups.members(groups):
            await self.abort(request_id)

    def holds_request(self, request_id: str) -> bool:
        """In flight (the mock holds nothing for a connector after a request ends)."""
        return request_id in self._running

    @property
    def is_running(self) -> bool:
        return True

    def shutdown(self) -> None:
        self._running.clear()
        self._refs.clear()

    def _acquire(self, request_id: str, inputs: MockInputs) -> None:
        if request_id in self._running:
            raise ValueError(f"request id {request_id!r} is already running")
        self._running[request_id] = math.ceil(len(inputs.prompt_token_ids) / BLOCK_SIZE)
        for f in inputs.mm_features:
            if f.mm_hash in self._refs:
                self._stats.encoder_cache_hits_total += 1
            else:
                self._stats.encoder_items_computed_total += 1
            self._refs[f.mm_hash] = self._refs.get(f.mm_hash, 0) + 1
        self._stats.prompt_tokens_computed_total += len(inputs.prompt_token_ids)

    def _release(self, request_id: str, inputs: MockInputs) -> None:
        self._running.pop(request_id, None)
        self._aborted.discard(request_id)
        for f in inputs.mm_features:
            left = self._refs.get(f.mm_hash, 0) - 1
            if left > 0:
                self._refs[f.mm_hash] = left
            else:
                self._refs.pop(f.mm_hash, None)

    async def add_request(
        self,
        request_id: str,
        inputs: MockInputs,
        params: SamplingParams,
        group: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield one delta per generated token; the last one has ``finished=True``.

        With no token latency the deltas come without yielding to the event loop.
        ``group``: the client request it belongs to, for :meth:`abort_groups`.
        """
        self._acquire(request_id, inputs)
        self._groups.add(group, request_id)
        try:
            for out in self._generate(request_id, inputs, params):
                if out is None:
                    await asyncio.sleep(self.config.token_latency_s)
                    continue
                yield out
        finally:
            self._groups.discard(request_id)
            self._release(request_id, inputs)

    def _generate(
        self, request_id: str, inputs: MockInputs, params: SamplingParams
    ) -> Iterator[RequestOutput | None]:
        """The token loop; yields ``None`` where the caller should wait one token latency."""
        prompt = inputs.prompt_token_ids or [ord(" ")]
        plen = len(inputs.prompt_token_ids)
        limit = self.config.max_model_len - plen
        max_tokens = min(_get(params, "max_tokens", DEFAULT_MAX_TOKENS), max(limit, 0))
        stops: list[str] = list(_get(params, "stop", []))
        stop_ids: set[int] = set(_get(params, "stop_token_ids", []))
        n_logprobs = getattr(params, "logprobs", None)
        sampled = _get(params, "temperature", 1.0) > 0
        rng = random.Random(_get(params, "seed", 0)) if sampled else None
        extra = getattr(params, "extra_args", None) or {}
        kv = extra.get("kv_transfer_params")
        ec = extra.get("ec_transfer_params")
        fail_after = extra.get("mock_fail_after")
        wait = self.config.token_latency_s > 0
        if not (stops or stop_ids or n_logprobs is not None or wait or fail_after is not None):
            yield from self._plain(request_id, prompt, plen, max_tokens, rng, kv, ec)
            return
        text = ""
        sent = 0
        hold = max((len(s) for s in stops), default=1) - 1
        for i in range(max_tokens):
            if wait:
                yield None
            if fail_after is not None and i == fail_after:
                yield RequestOutput(request_id, prompt, [], "", True, "error", error="mock failure")
                return
            if request_id in self._aborted:
                yield RequestOutput(request_id, prompt, [], text[sent:], True, "abort")
                return
            tok = rng.choice(prompt) if rng is not None else prompt[i % len(prompt)]
            finish: str | None = None
            stop_reason: str | int | None = None
            end = len(text)
            if tok in stop_ids:
                finish, stop_reason = "stop", tok
            else:
                before = len(text)
                text += chr(tok)
                end = len(text)
                for s in stops:
                    at = text.find(s, max(0, before - len(s) + 1))
                    if at >= 0:
                        finish, stop_reason, end = "stop", s, at
                        break
            if finish is None and i == max_tokens - 1:
                finish = "length"
            if finish is None:
                end = max(sent, len(text) - hold)
            piece, sent = text[sent:end], end
            self._stats.generation_tokens_total += 1
            self._running[request_id] = math.ceil((plen + i + 1) / BLOCK_SIZE)
            out = RequestOutput(request_id, prompt, [tok], piece, finish is not None, finish)
            out.stop_reason = stop_reason
            if n_logprobs is not None:
                k = max(1, n_logprobs)
                top = [(tok + j, -0.5 * (j + 1)) for j in range(k)]
                out.logprobs = [TokenLogprob(tok, -0.5, 1, top)]
            if finish is not None:
                out.kv_transfer_params, out.ec_transfer_params = kv, ec
                yield out
                return
            yield out
        yield RequestOutput(request_id, prompt, [], "", True, "length", None, None, 0, kv, ec)

    def _plain(
        self,
        request_id: str,
        prompt: list[int],
        plen: int,
        max_tokens: int,
        rng: random.Random | None,
        kv: dict[str, Any] | None,
        ec: dict[str, Any] | None,
    ) -> Iterator[RequestOutput]:
        """The token loop without stops, logprobs or delays (the benchmark's case)."""
        running = self._running
        stats = self._stats
        n = len(prompt)
        for i in range(max_tokens):
            if request_id in self._aborted:
                yield RequestOutput(request_id, prompt, [], "", True, "abort")
                return
            tok = rng.choice(prompt) if rng is not None else prompt[i % n]
            stats.generation_tokens_total += 1
            running[request_id] = (plen + i + BLOCK_SIZE) // BLOCK_SIZE
            if i == max_tokens - 1:
                yield RequestOutput(
                    request_id, prompt, [tok], chr(tok), True, "length", None, None, 0, kv, ec
                )
                return
            yield RequestOutput(request_id, prompt, [tok], chr(tok))
        yield RequestOutput(request_id, prompt, [], "", True, "length", None, None, 0, kv, ec)


# ---- the mock model behind the engine core (``--mock-engine`` in its own process) ----


@dataclass(frozen=True, slots=True)
class _NoTensors:
    """The mock's KV element type and device: what sizing reads of torch's, without
    importing torch (the mock engine process never does)."""

    itemsize: int = 4
    type: str = "cpu"


class MockModel:
    """What the engine core asks of a model, without weights: the vocabulary of the
    character tokenizer and a KV cache spec of no bytes (the blocks are bookkeeping)."""

    vocab_size = VOCAB_SIZE
    device: Any = _NoTensors()

    def kv_cache_spec(self) -> KVCacheSpec:
        from ec_frontend.model.interface import KVCacheSpec

        # Sizing reads only the element size; the mock never allocates a tensor.
        no_tensors = _NoTensors()
        return KVCacheSpec(num_layers=0, num_kv_heads=1, head_dim=1, dtype=no_tensors)  # type: ignore[arg-type]


class MockRunner:
    """Stands in for the model runner: "encodes" scheduled images (counted) and samples
    the token :class:`MockEngine` would, for every request that samples this step.

    It reads the scheduler's requests (same thread) for their prompt and output
    tokens, so a preempted request resumes where it was.
    """

    def __init__(self, scheduler: Scheduler, token_latency_s: float = 0.0) -> None:
        from ec_frontend.engine.stats import RunnerCounters

        self.scheduler = scheduler
        self.token_latency_s = token_latency_s
        self.counters = RunnerCounters()
        self._rngs: dict[str, random.Random] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        from ec_frontend.engine.outputs import ModelRunnerOutput

        out = ModelRunnerOutput()
        for rid in so.finished_req_ids:
            self._rngs.pop(rid, None)
        requests = self.scheduler.requests
        encoded = 0
        for item in so.scheduled:
            encoded += len(item.encoder_inputs)
            request = requests.get(item.request_id)
            if not item.sample or request is None:
                continue
            params = request.sampling_params
            extra = params.extra_args or {}
            i = len(request.output_token_ids)
            if extra.get("mock_fail_after") == i:
                out.failed[item.request_id] = "mock failure"
                continue
            prompt = request.prompt_token_ids
            if params.temperature > 0:
                rng = self._rngs.get(item.request_id)
                if rng is None:
                    rng = self._rngs[item.request_id] = random.Random(params.seed or 0)
                tok = rng.choice(prompt)
            else:
                tok = prompt[i % len(prompt)]
            out.sampled_token_ids[item.request_id] = [tok]
            if params.logprobs is not None:
                top = [(tok + j, -0.5 * (j + 1)) for j in range(max(1, params.logprobs))]
                out.logprobs[item.request_id] = [TokenLogprob(tok, -0.5, 1, top)]
        if encoded:
            self.counters.encoder_items_computed += encoded
            self.counters.encoder_forward_calls += 1
        if out.sampled_token_ids:
            self.counters.lm_forward_calls += 1
            if self.token_latency_s > 0:
                time.sleep(self.token_latency_s)
        return out


@dataclass(slots=True)
class _CoreFeature:
    """A mock image as the engine core sees it (``MultiModalFeature``'s fields that
    the scheduler reads); pixel values that are not ``None`` mean "encode locally"."""

    mm_hash: str
    offset: int
    length: int
    image_grid_thw: tuple[int, int, int] = (1, 1, 1)
    pixel_values: Any = ()


@dataclass(slots=True)
class _CoreInputs:
    """A mock prompt as the engine core sees it (``ProcessedInputs``' fields)."""

    prompt_token_ids: list[int]
    mm_features: list[_CoreFeature]
    mrope_positions: Any = None
    mrope_position_delta: int = 0
    prompt: str | None = None
    cache_salt: str | None = None


def _mock_core_class() -> type:
    from ec_frontend.engine.core import EngineCore

    class MockCore(EngineCore):
        """The engine core with :class:`MockModel` and :class:`MockRunner`; transfer
        params given in ``extra_args`` come back on the finished output, as a
        connector's ``request_finished`` would return them."""

        def __init__(self, config: EngineConfig, token_latency_s: float) -> None:
            self._token_latency_s = token_latency_s
            # The core itself reads only vocab_size, device and kv_cache_spec(); the rest
            # of a VisionLanguageModel is the runner's, which MockRunner replaces.
            model = MockModel()
            super().__init__(config, model, eos_token_id=CharTokenizer.eos_token_id)  # type: ignore[arg-type]
            self._echo: dict[str, tuple[JSONObject | None, JSONObject | None]] = {}

        def _make_runner(self, *args: Any) -> Any:
            return MockRunner(self.scheduler, self._token_latency_s)

        def build_inputs(self, data: dict[str, Any]) -> _CoreInputs:
            """Engine inputs from a packed :class:`MockInputs`."""
            features = [
                _CoreFeature(f["mm_hash"], f["offset"], f["length"])
                for f in data.get("mm_features") or []
            ]
            return _CoreInputs(data["prompt_token_ids"], features, None, 0, data.get("prompt"),
                               cache_salt=data.get("cache_salt"))  # fmt: skip

        def add_request(self, request_id: str, inputs: Any, params: Any) -> None:
            limit = max(self.max_model_len - len(inputs.prompt_token_ids), 1)
            params.max_tokens = min(_get(params, "max_tokens", DEFAULT_MAX_TOKENS), limit)
            extra = params.extra_args or {}
            kv, ec = extra.get("kv_transfer_params"), extra.get("ec_transfer_params")
            if isinstance(kv, dict) or isinstance(ec, dict):
                self._echo[request_id] = (
                    kv if isinstance(kv, dict) else None,
                    ec if isinstance(ec, dict) else None,
                )
            super().add_request(request_id, inputs, params)

        def _to_request_output(self, co: EngineCoreOutput) -> RequestOutput:
            out = super()._to_request_output(co)
            if out.finished:
                echo = self._echo.pop(co.request_id, None)
                if echo is not None and out.finish_reason in ("stop", "length"):
                    out.kv_transfer_params, out.ec_transfer_params = echo
            return out

    return MockCore


def build_mock_core(config: MockEngineConfig) -> EngineCore:
    """In the engine process: the engine core around the mock model (``--mock-engine``
    with the multiprocess engine)."""
    from ec_frontend.config import CacheConfig, EngineConfig, SchedulerConfig

    max_len = config.max_model_len
    engine_config = EngineConfig(
        model=None,
        model_id=config.model,
        device="cpu",
        scheduler=SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_len,
            max_num_batched_tokens=max(8192, max_len),
        ),
        cache=CacheConfig(
            block_size=BLOCK_SIZE,
            num_kv_blocks=MockEngine.KV_BLOCKS,
            encoder_cache_size=max(8192, max_len),
            enable_prefix_caching=False,
        ),
    )
    core: EngineCore = _mock_core_class()(engine_config, config.token_latency_s)
    return core
