"""EngineCore: the step loop (schedule -> run the model -> update -> detokenize).

The core is single-threaded; :class:`~ec_frontend.engine.async_engine.AsyncEngine`
drives it from a background thread. Requests that cannot be served (token ids
outside the vocabulary, a prompt too long, an image that cannot be encoded)
finish alone with ``finish_reason="error"`` and a message; the others go on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ec_frontend.config import EngineConfig
from ec_frontend.connectors.base import ECConnectorBase, ECConnectorRole
from ec_frontend.connectors.factory import create_ec_connectors, create_kv_connectors
from ec_frontend.connectors.kv_base import KVConnectorBase
from ec_frontend.connectors.noop import NoOpECConnector
from ec_frontend.engine.detokenizer import (
    Decoder,
    IncrementalDetokenizer,
    make_detokenizer,
    text_token_ids,
)
from ec_frontend.engine.encoder_cache import EncoderCacheManager
from ec_frontend.engine.kv_cache import KVCacheManager, plan_kv_cache
from ec_frontend.engine.outputs import EngineCoreOutput, ModelRunnerOutput, RequestOutput
from ec_frontend.engine.request import Request, RequestStatus
from ec_frontend.engine.scheduler import Scheduler
from ec_frontend.engine.stats import EngineStats

if TYPE_CHECKING:
    from ec_frontend.engine.cuda_graphs import GraphPlan
    from ec_frontend.engine.model_runner import ModelRunner
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.model.interface import VisionLanguageModel
    from ec_frontend.model.processor import InputProcessor, ProcessedInputs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RequestState:
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None


class EngineCore:
    """Owns the scheduler, the caches, the connectors and the model runner."""

    def __init__(
        self,
        config: EngineConfig,
        model: VisionLanguageModel,
        *,
        tokenizer: Decoder | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        ec_connectors: tuple[ECConnectorBase, ECConnectorBase] | None = None,
        kv_connectors: tuple[KVConnectorBase, KVConnectorBase] | None = None,
    ) -> None:
        """``ec_connectors`` / ``kv_connectors`` (scheduler half, worker half) override
        the ones the config names (tests use this to instrument a connector)."""
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.encoder_only = config.is_encoder_only
        self.max_model_len = config.scheduler.max_model_len

        ec_sched: ECConnectorBase | None = None
        ec_worker: ECConnectorBase = NoOpECConnector(None, ECConnectorRole.WORKER)
        if ec_connectors is not None:
            ec_sched, ec_worker = ec_connectors
        elif config.ec_transfer is not None:
            ec_sched, ec_worker = create_ec_connectors(config.ec_transfer)
        kv_sched: KVConnectorBase | None = None
        kv_worker: KVConnectorBase | None = None
        if kv_connectors is not None:
            kv_sched, kv_worker = kv_connectors
        elif config.kv_transfer is not None:
            kv_sched, kv_worker = create_kv_connectors(config.kv_transfer)

        block_size = config.cache.block_size
        kv_cache: KVCacheManager | None = None
        num_blocks: int | None = None
        self.kv_plan = None if self.encoder_only else plan_kv_cache(model, config)
        if self.kv_plan is not None:
            num_blocks = self.kv_plan.num_blocks
            kv_cache = KVCacheManager(
                num_blocks, block_size, enable_prefix_caching=config.cache.enable_prefix_caching
            )
        self.kv_cache = kv_cache
        self.encoder_cache = EncoderCacheManager(config.cache.encoder_cache_size)
        self.scheduler = Scheduler(
            config.scheduler,
            kv_cache=kv_cache,
            encoder_cache=self.encoder_cache,
            ec_connector=ec_sched,
            kv_connector=kv_sched,
        )
        self.runner = self._make_runner(model, ec_worker, kv_worker, num_blocks, block_size)
        self._states: dict[str, _RequestState] = {}
        self._immediate: list[RequestOutput] = []
        self.num_steps = 0
        #: Requests the last step computed anything for (0: it only polled transfers).
        self.last_num_scheduled = 0
        self.requests_finished = 0
        self.requests_failed = 0

    def _make_runner(
        self,
        model: VisionLanguageModel,
        ec_connector: ECConnectorBase,
        kv_connector: KVConnectorBase | None,
        num_kv_blocks: int | None,
        block_size: int,
    ) -> ModelRunner:
        """The model runner, imported here: a core around the mock model overrides
        this, and its engine process never loads torch."""
        from ec_frontend.engine.model_runner import ModelRunner

        return ModelRunner(
            model,
            ec_connector=ec_connector,
            kv_connector=kv_connector,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            graph_plan=self._graph_plan(model),
        )

    def _graph_plan(self, model: VisionLanguageModel) -> GraphPlan | None:
        """CUDA graphs of decode steps on a CUDA device, unless ``--enforce-eager``."""
        from ec_frontend.engine.cuda_graphs import GraphPlan

        if self.config.cache.enforce_eager or model.device.type != "cuda":
            return None
        sched = self.config.scheduler
        return GraphPlan(sched.max_num_seqs, sched.max_model_len)

    @classmethod
    def from_config(cls, config: EngineConfig) -> tuple[EngineCore, InputProcessor]:
        """Load the checkpoint ``config.model`` (or the built-in model) and build a core."""
        from ec_frontend.model.loader import load_processor

        path, model_id = cls.checkpoint(config)
        model = cls.load_model(config, path)
        processor = load_processor(path, model_id=config.model_id or model_id)
        eos = _generation_eos(path) or processor.eos_token_id
        core = cls(config, model, tokenizer=processor.tokenizer, eos_token_id=eos)
        return core, processor

    @staticmethod
    def checkpoint(config: EngineConfig) -> tuple[Path, str]:
        """The checkpoint directory of ``config.model`` (or the built-in one) and its id."""
        if config.model is None:
            from ec_frontend.model.builtin import BUILTIN_MODEL_ID, ensure_builtin_checkpoint

            return ensure_builtin_checkpoint(), BUILTIN_MODEL_ID
        return Path(config.model), Path(config.model).resolve().name

    @staticmethod
    def load_model(config: EngineConfig, path: Path) -> VisionLanguageModel:
        """The model of the checkpoint at ``path`` as ``config`` asks for it."""
        import torch

        from ec_frontend.model.loader import load_model

        # --seed: unseeded sampling and dummy weights draw from this state.
        torch.manual_seed(config.seed)
        return load_model(
            path,
            device=config.device,
            dtype=config.dtype,
            load_vision=config.load_vision,
            load_language=not config.is_encoder_only,
            load_format=config.load_format,
            attention_backend=config.attention_backend,
        )

    # ---- requests -----------------------------------------------------------

    def add_request(self, request_id: str, inputs: ProcessedInputs, params: SamplingParams) -> None:
        """Queue a request. Unservable input finishes it with an error output
        (returned by the next :meth:`step`); a duplicate id raises ``ValueError``."""
        if request_id in self._states or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request.from_inputs(request_id, inputs, params, eos_token_id=self.eos_token_id)
        error = self._validate(request)
        if error is not None:
            self.requests_failed += 1
            self._immediate.append(
                RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    finished=True,
                    finish_reason="error",
                    error=error,
                )
            )
            return
        detok = None
        if self.tokenizer is not None and not self.encoder_only:
            detok = make_detokenizer(self.tokenizer, request.prompt_token_ids, params)
        self._states[request_id] = _RequestState(request.prompt_token_ids, detok)
        self.scheduler.add_request(request)

    def _validate(self, request: Request) -> str | None:
        vocab = self.model.vocab_size
        ids = request.prompt_token_ids
        if not ids:
            return "the prompt is empty"
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t < vocab), None)  # fmt: skip
        if bad is not None:
            return f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})"
        limit = self.max_model_len if self.encoder_only else self.max_model_len - 1
        if len(ids) > limit:
            return (
                f"the prompt has {len(ids)} tokens; this instance allows at most {limit} "
                f"(max_model_len {self.max_model_len})"
            )
        if request.sampling_params.n != 1:
            return "the engine serves one sequence per request (n must be 1)"
        positions = request.mrope_positions
        if positions is not None and tuple(positions.shape) != (3, len(ids)):
            return f"mrope_positions has shape {tuple(positions.shape)}, expected (3, {len(ids)})"
        end = 0
        for feature in request.mm_features:
            if feature.offset < end or feature.offset + feature.length > len(ids):
                return f"media item {feature.mm_hash} has an invalid placeholder range"
            if feature.length > self.encoder_cache.cache_size:
                return (
                    f"media item {feature.mm_hash} needs {feature.length} encoder cache rows; "
                    f"the cache holds {self.encoder_cache.cache_size} (--encoder-cache-size)"
                )
            end = feature.offset + feature.length
        return None

    def abort(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for co in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
            self._immediate.append(self._to_request_output(co))

    def stop(self, request_id: str, stop_reason: str) -> None:
        """Finish a request as stopped by ``stop_reason`` (a stop string its client found
        in the text); its final output comes with the next :meth:`step`."""
        for co in self.scheduler.finish_requests(
            request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop_reason
        ):
            self._immediate.append(self._to_request_output(co))

    def has_work(self) -> bool:
        return bool(self._immediate) or self.scheduler.has_pending_work()

    # ---- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._immediate = self._immediate, []
        if not self.scheduler.has_pending_work():
            return outputs
        so = self.scheduler.schedule()
        self.last_num_scheduled = len(so.scheduled)
        try:
            ro = self.runner.execute(so)
        except Exception as exc:
            logger.exception("engine step failed")
            ro = ModelRunnerOutput(
                failed={s.request_id: f"engine step failed: {exc}" for s in so.scheduled}
            )
        self.num_steps += 1
        for co in self.scheduler.update_from_output(so, ro):
            outputs.append(self._to_request_output(co))
        return outputs

    def _to_request_output(self, co: EngineCoreOutput) -> RequestOutput:
        state = self._states.get(co.request_id)
        text = ""
        if state is not None and state.detokenizer is not None:
            new_ids = text_token_ids(co.new_token_ids, co.finish_reason, co.stop_reason)
            stop = state.detokenizer.update(new_ids, co.finished)
            if stop is not None:
                if not co.finished:
                    for final in self.scheduler.finish_requests(
                        co.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop
                    ):
                        co.kv_transfer_params = final.kv_transfer_params
                        co.ec_transfer_params = final.ec_transfer_params
                co.finish_reason = "stop"
                co.stop_reason = stop
            text = state.detokenizer.take_delta(co.finished)
        if co.finished:
            self._states.pop(co.request_id, None)
            if co.finish_reason == "error":
                self.requests_failed += 1
            else:
                self.requests_finished += 1
        return RequestOutput(
            request_id=co.request_id,
            prompt_token_ids=state.prompt_token_ids if state is not None else None,
            token_ids=list(co.new_token_ids),
            text=text,
            finished=co.finished,
            finish_reason=co.finish_reason,
            stop_reason=co.stop_reason,
            logprobs=co.new_logprobs,
            num_cached_tokens=co.num_cached_tokens,
            kv_transfer_params=co.kv_transfer_params,
            ec_transfer_params=co.ec_transfer_params,
            error=co.error,
        )

    # ---- observability ------------------------------------------------------

    def stats(self) -> EngineStats:
        sc = self.scheduler.counters
        rc = self.runner.counters
        return EngineStats(
            encoder_items_computed_total=rc.encoder_items_computed,
            encoder_cache_hits_total=sc.encoder_cache_hits,
            encoder_items_found_stored_total=sc.encoder_items_found_stored,
            ec_items_loaded_total=rc.ec_items_loaded,
            ec_items_saved_total=rc.ec_items_saved,
            ec_load_fallbacks_total=rc.ec_load_fallbacks,
            prompt_tokens_computed_total=sc.prompt_tokens_computed,
            kv_tokens_received_total=sc.kv_tokens_received,
            generation_tokens_total=sc.generation_tokens,
            preemptions_total=sc.num_preemptions,
            prefix_cache_queries_total=sc.prefix_cache_queries,
            prefix_cache_hits_total=sc.prefix_cache_hits,
            engine_steps_total=self.num_steps,
            lm_forward_calls_total=rc.lm_forward_calls,
            lm_graph_replays_total=rc.lm_graph_replays,
            encoder_forward_calls_total=rc.encoder_forward_calls,
            requests_finished_total=self.requests_finished,
            requests_failed_total=self.requests_failed,
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage if self.kv_cache is not None else 0.0,
            encoder_cache_usage=self.encoder_cache.usage,
            kv_blocks_used=self.kv_cache.num_used_blocks if self.kv_cache is not None else 0,
            kv_blocks_cached=self.kv_cache.num_cached_blocks if self.kv_cache is not None else 0,
            encoder_cache_refs=self.encoder_cache.num_references(),
            **_connector_stats(self.scheduler.kv_connector, self.scheduler.ec_connector),
        )


def _connector_stats(kv: KVConnectorBase | None, ec: ECConnectorBase | None) -> dict[str, int]:
    """What side-channel connectors report beyond the runner's counters (0 for others)."""
    return {
        "kv_tokens_sent_total": int(getattr(kv, "num_tokens_sent", 0)),
        "kv_local_prefill_fallbacks_total": int(getattr(kv, "local_prefill_fallbacks", 0)),
        "transfer_params_rejected_total": int(getattr(kv, "params_rejected", 0))
        + int(getattr(ec, "params_rejected", 0)),
        "kv_holds_refused_total": int(getattr(kv, "num_holds_refused", 0)),
        "kv_requests_held": int(getattr(kv, "num_requests_held", 0)),
        "ec_items_held": (
            int(ec.num_items_held()) if ec is not None and hasattr(ec, "num_items_held") else 0
        ),
    }


def _generation_eos(path: object) -> list[int] | None:
    """EOS ids from the checkpoint's ``generation_config.json``, if it names any."""
    file = Path(str(path)) / "generation_config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    eos = data.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        return [eos]
    if isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        return list(eos) or None
    return None
