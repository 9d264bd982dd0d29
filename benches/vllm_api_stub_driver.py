"""vLLM's own OpenAI API server layer over a stub engine (run by the vLLM venv's Python).

Usage: ``python vllm_api_stub_driver.py [vllm serve args...] [--stub-token-latency-ms MS]``,
for example ``--model DIR --served-model-name tiny --port 8000 --max-model-len 1024``.

The arguments are parsed by vLLM's ``vllm serve`` parser, the ``VllmConfig`` is built
by vLLM's ``AsyncEngineArgs``, and the app is built, initialised and served by vLLM's
``build_and_serve`` (``build_app`` + ``init_app_state`` + ``serve_http``), all
unmodified. Only the engine client is replaced: :class:`StubEngineClient` holds
the renderer and input processor that ``AsyncLLM`` would (so chat templates,
tokenization and the Hugging Face image processor run for real in this process,
as they do in vLLM's API server) and, in place of the engine core, echoes tokens
the way ec-frontend's ``--mock-engine`` does: ``max_tokens`` tokens, one output
per token, the prompt's token ids in order (greedy) or in a seeded random order
(``temperature > 0``), end of sequence never sampled, and with no token latency
no yield to the event loop between tokens.

This host has no GPU, and the PyPI wheel of vLLM is its CUDA build, whose
platform detection finds no device; ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own
setting for an explicit CPU target) is set before vLLM is imported, which makes
the config resolve to vLLM's ``CpuPlatform``. No model weights are loaded.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import asyncio
import random
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import uvloop
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.protocol import EngineClient
from vllm.entrypoints.common.cli_args import (
    make_arg_parser,
    validate_parsed_serve_args,
)
from vllm.entrypoints.launchers.api_server.entry import build_and_serve
from vllm.entrypoints.launchers.launcher import setup_server
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.renderers import renderer_from_config
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.input_processor import InputProcessor

TASKS = ("generate",)


class StubEngineClient(EngineClient):
    """vLLM's ``EngineClient`` with ``AsyncLLM``'s input side and an echoing engine.

    ``generate`` turns the rendered prompt into an ``EngineCoreRequest`` with the
    same ``InputProcessor`` call ``AsyncLLM.add_request`` makes (parameter checks,
    multimodal features, request id), then yields ``RequestOutput`` objects shaped
    by the request's ``output_kind`` (one per token for streams, one at the end
    otherwise). Token text comes from the tokenizer, decoded once per token id and
    cached: cheaper than vLLM's incremental detokenizer, so the stub, if anything,
    flatters vLLM's layer.
    """

    def __init__(self, vllm_config: VllmConfig, token_latency_s: float = 0.0) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.token_latency_s = token_latency_s
        self._pieces: dict[int, str] = {}
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._stopped = False
        self.renderer.start_mm_warmup_in_background()

    @property
    def is_running(self) -> bool:
        return not self._stopped

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    async def get_supported_tasks(self) -> tuple[Any, ...]:
        return TASKS

    def _piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            tokenizer = self.renderer.get_tokenizer()
            piece = tokenizer.decode([token_id], skip_special_tokens=True)
            self._pieces[token_id] = piece
        return piece

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        kwargs = {
            "supported_tasks": TASKS,
            "lora_request": lora_request,
            "tokenization_kwargs": tokenization_kwargs,
            "trace_headers": trace_headers,
            "priority": priority,
            "data_parallel_rank": data_parallel_rank,
            "session_id": session_id,
            "kv_hints": kv_hints,
        }
        if isinstance(prompt, dict) and "type" in prompt:
            request = self.input_processor.process_inputs(
                request_id, prompt, sampling_params, **kwargs
            )
        else:
            request = await self.input_processor.process_inputs_async(
                request_id, prompt, sampling_params, **kwargs
            )
        self.input_processor.assign_request_id(request)
        params = request.params
        if params.n != 1:
            raise VLLMValidationError("the stub engine generates one sequence", parameter="n")
        prompt_ids = list(request.prompt_token_ids or [])
        self._running.add(request_id)
        try:
            async for out in self._echo(request_id, prompt_text, prompt_ids, params):
                yield out
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)

    async def _echo(
        self, request_id: str, prompt_text: str | None, prompt_ids: list[int], params: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        source = prompt_ids or [0]
        limit = max(self.model_config.max_model_len - len(prompt_ids), 0)
        max_tokens = min(params.max_tokens if params.max_tokens is not None else limit, limit)
        rng = random.Random(params.seed or 0) if params.temperature > 0 else None
        kind = params.output_kind
        text: list[str] = []
        ids: list[int] = []
        wait = self.token_latency_s
        finish: str | None = None
        for i in range(max_tokens):
            if wait > 0:
                await asyncio.sleep(wait)
            if request_id in self._aborted:
                finish = "abort"
                break
            tok = rng.choice(source) if rng is not None else source[i % len(source)]
            piece = self._piece(tok)
            ids.append(tok)
            text.append(piece)
            last = i == max_tokens - 1
            if kind is RequestOutputKind.DELTA:
                yield self._output(
                    request_id, prompt_text, prompt_ids, piece, [tok], "length" if last else None
                )
            elif kind is RequestOutputKind.CUMULATIVE or last:
                yield self._output(
                    request_id,
                    prompt_text,
                    prompt_ids,
                    "".join(text),
                    list(ids),
                    "length" if last else None,
                )
            if last:
                return
        if finish is None:
            finish = "length"
        if kind is RequestOutputKind.DELTA:
            yield self._output(request_id, prompt_text, prompt_ids, "", [], finish)
        else:
            yield self._output(request_id, prompt_text, prompt_ids, "".join(text), ids, finish)

    @staticmethod
    def _output(
        request_id: str,
        prompt_text: str | None,
        prompt_ids: list[int],
        text: str,
        token_ids: list[int],
        finish: str | None,
    ) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=None,
            logprobs=None,
            finish_reason=finish,
        )
        return RequestOutput(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=None,
            outputs=[completion],
            finished=finish is not None,
            num_cached_tokens=0,
        )

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the stub engine only generates")

    async def abort(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._aborted.update(i for i in ids if i in self._running)

    async def notify_kv_transfer_request_rejected(
        self,
        request_id: str,
        kv_transfer_params: dict[str, Any],
        *,
        data_parallel_rank: int | None = None,
    ) -> None:
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    async def start_profile(self, profile_prefix: str | None = None, **kwargs: Any) -> None:
        raise NotImplementedError("the stub engine has no profiler")

    async def stop_profile(self) -> None:
        raise NotImplementedError("the stub engine has no profiler")

    async def reset_mm_cache(self) -> None:
        self.renderer._join_mm_warmup()
        await self.renderer.clear_mm_cache_async()

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return True

    async def sleep(self, level: int = 1, mode: Any = "abort") -> None:
        raise NotImplementedError("the stub engine does not sleep")

    async def release_kv_cache_memory(self) -> None:
        return None

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return True

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request: Any) -> bool:
        raise NotImplementedError("the stub engine has no LoRA")

    async def pause_generation(self, *, mode: Any = "abort", clear_cache: bool = True) -> None:
        raise NotImplementedError("the stub engine does not pause")

    async def resume_generation(self) -> None:
        return None

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        self._stopped = True
        self.renderer.shutdown()


def parse_args(argv: list[str] | None = None) -> Any:
    parser = make_arg_parser(FlexibleArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument(
        "--stub-token-latency-ms",
        type=float,
        default=0.0,
        help="delay before each generated token (as ec-frontend's --mock-token-latency-ms)",
    )
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    return args


async def serve(args: Any) -> None:
    listen_address, sock = setup_server(args, reuse_port=False)
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    client = StubEngineClient(vllm_config, args.stub_token_latency_ms / 1000.0)
    try:
        await client.reset_mm_cache()
        shutdown_task = await build_and_serve(client, listen_address, sock, args)
        await shutdown_task
    finally:
        client.shutdown()
        sock.close()


if __name__ == "__main__":
    uvloop.run(serve(parse_args()))
