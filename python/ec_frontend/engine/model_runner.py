"""One engine step on the model: EC loads, batched encode, batched LM forward, sampling.

Per step, with the EC connector bound to the step's metadata:

1. load the scheduled external encoder outputs; ``start_load_caches`` returns
   only once they are complete, so nothing is gathered from a half-loaded item;
2. encode, in one vision-tower call, every needed item not already in the
   encoder cache (including loads that failed: the local fallback); a producer
   saves each new output;
3. run one language-model forward over all scheduled tokens of all requests
   (prefill chunks and decodes together), with image placeholder embeddings
   replaced by encoder outputs and M-RoPE positions from the processor;
4. sample the requests whose step reaches their last token;
5. collect finished transfers; the metadata is cleared even on error.

The runner keeps its own state per request (:class:`CachedRequest`), created
from the scheduler's :class:`~ec_frontend.engine.scheduler_output.NewRequestData`
and updated incrementally: its row of token ids and block table in the
persistent :class:`~ec_frontend.engine.model_inputs.InputBatch`, its output
tokens (appended as it samples them) and, for a request with penalties, its
token counts. It never holds the scheduler's ``Request`` objects.

Failures stay with their requests: an image that cannot be encoded fails the
requests that need it; an error in the forward fails the requests of that
forward. Neither stops the engine.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ec_frontend.connectors.base import ECConnectorBase, ECConnectorMetadata
from ec_frontend.engine.cuda_graphs import DecodeGraphs, GraphPlan
from ec_frontend.engine.encoder_planner import decode_deferred_image
from ec_frontend.engine.model_inputs import InputBatch, ModelInputs, StepRequest
from ec_frontend.engine.outputs import ModelRunnerOutput
from ec_frontend.engine.sampler import PenaltyState, Sampler, SamplingRow, make_generator
from ec_frontend.engine.stats import RunnerCounters
from ec_frontend.engine.structured_output import BitmaskFiller, grammar_violations
from ec_frontend.model.interface import VisionLanguageModel

if TYPE_CHECKING:
    from ec_frontend.connectors.kv_base import KVConnectorBase
    from ec_frontend.engine.scheduler_output import (
        NewRequestData,
        ScheduledRequest,
        SchedulerOutput,
    )
    from ec_frontend.model.processor import MultiModalFeature

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CachedRequest:
    """The runner's state of one request in the batch."""

    data: NewRequestData
    row: int
    output_token_ids: list[int]
    penalties: PenaltyState | None

    @property
    def request_id(self) -> str:
        return self.data.request_id


@dataclass(slots=True)
class _EncodeJob:
    mm_hash: str
    feature: MultiModalFeature
    request_ids: list[str]


class ModelRunner:
    """Owns the model, the KV cache tensors and the encoder outputs of one instance.

    ``num_kv_blocks`` is ``None`` for an encoder-only instance: no KV cache is
    allocated and the language model is never called. With ``graph_plan`` (and a
    model whose decode step can be captured) decode-only steps replay graphs
    (:mod:`~ec_frontend.engine.cuda_graphs`); the caches then hold one more block,
    the padding rows' scratch block, which the scheduler never hands out.
    """

    def __init__(
        self,
        model: VisionLanguageModel,
        *,
        ec_connector: ECConnectorBase,
        kv_connector: KVConnectorBase | None = None,
        num_kv_blocks: int | None,
        block_size: int,
        graph_plan: GraphPlan | None = None,
    ) -> None:
        self.model = model
        self.ec_connector = ec_connector
        self.kv_connector = kv_connector
        self.block_size = block_size
        self.encoder_only = num_kv_blocks is None
        self.kv_caches: list[torch.Tensor] = []
        if graph_plan is not None and not (num_kv_blocks and model.decode_graphs_supported()):
            graph_plan = None
        if num_kv_blocks is not None:
            spec = model.kv_cache_spec()
            physical = num_kv_blocks + 1 if graph_plan is not None else num_kv_blocks
            shape = (2, physical, block_size, spec.num_kv_heads, spec.head_dim)
            self.kv_caches = [
                torch.zeros(shape, dtype=spec.dtype, device=model.device)
                for _ in range(spec.num_layers)
            ]
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.sampler = Sampler()
        self.bitmask_filler = BitmaskFiller()
        self.counters = RunnerCounters()
        # Seeded generators outlive a preemption (the resumed request draws on).
        self._generators: dict[str, torch.Generator] = {}
        self.requests: dict[str, CachedRequest] = {}
        self.input_batch = InputBatch(block_size, model.device)
        self.decode_graphs: DecodeGraphs | None = None
        if graph_plan is not None and num_kv_blocks is not None:
            self.decode_graphs = self._capture_graphs(graph_plan, num_kv_blocks)

    def _capture_graphs(self, plan: GraphPlan, scratch_block: int) -> DecodeGraphs | None:
        """The captured decode graphs, or ``None`` (every step eager) when capture fails:
        serving slower beats not serving."""
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            block_size=self.block_size,
            plan=plan,
            scratch_block=scratch_block,
        )
        try:
            graphs.capture()
        except Exception as exc:
            logger.warning(
                "capturing decode graphs failed (%s: %s); every step runs eagerly "
                "(--enforce-eager skips the capture)",
                type(exc).__name__,
                exc,
            )
            return None
        return graphs

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for rid in so.finished_req_ids:
            self._generators.pop(rid, None)
            self._drop(rid)
        for rid in so.preempted_req_ids:
            self._drop(rid)
        for item in so.scheduled:
            self._update_state(item, out)
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        meta = so.ec_connector_metadata or ECConnectorMetadata()
        with self.ec_connector.bound(meta):
            try:
                self._prepare_encoder_outputs(so, meta, out)
                if not self.encoder_only:
                    self._run_language_model(so, out)
            finally:
                sending, recving = self.ec_connector.get_finished(so.finished_req_ids)
        out.ec_finished_sending, out.ec_finished_recving = sending, recving
        if self.kv_connector is not None:
            kv_sending, kv_recving = self.kv_connector.get_finished(so.finished_req_ids)
            out.kv_finished_sending, out.kv_finished_recving = kv_sending, kv_recving
        return out

    # ---- per-request state ----------------------------------------------

    def _drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.input_batch.free_row(state.row)

    def _update_state(self, item: ScheduledRequest, out: ModelRunnerOutput) -> None:
        """Apply the step's news about one request. A request entering the batch has
        its token ids checked against the vocabulary here, once: the ids of later
        steps are the ones the runner sampled, so no step checks them on the device."""
        data = item.new_request
        if data is None:
            state = self.requests.get(item.request_id)
            if state is None:
                raise KeyError(f"the runner has no state for request {item.request_id!r}")
            self.input_batch.append_blocks(state.row, item.new_block_ids)
            return
        self._drop(data.request_id)
        outputs = list(data.output_token_ids)
        row = self.input_batch.add_row(
            list(data.prompt_token_ids) + outputs if outputs else data.prompt_token_ids,
            item.new_block_ids,
        )
        penalties = None
        if data.sampling_params.has_penalties and not self.encoder_only:
            penalties = PenaltyState(
                self.model.vocab_size, self.model.device, data.prompt_token_ids, outputs
            )
        self.requests[data.request_id] = CachedRequest(data, row, outputs, penalties)
        if not self.encoder_only:
            vocab = self.model.vocab_size
            for name, ids in (("prompt", data.prompt_token_ids), ("output", outputs)):
                if ids and not (min(ids) >= 0 and max(ids) < vocab):
                    out.failed[data.request_id] = (
                        f"{name} token ids must lie in the vocabulary [0, {vocab})"
                    )

    def _record_sampled(self, state: CachedRequest, token: int) -> None:
        state.output_token_ids.append(token)
        self.input_batch.append_tokens(state.row, [token])
        if state.penalties is not None:
            state.penalties.add(token)

    # ---- encoder outputs ------------------------------------------------

    def _prepare_encoder_outputs(
        self, so: SchedulerOutput, meta: ECConnectorMetadata, out: ModelRunnerOutput
    ) -> None:
        requested = {spec.mm_hash for spec in meta.loads if spec.mm_hash not in self.encoder_cache}
        if requested:
            try:
                self.ec_connector.start_load_caches(self.encoder_cache)
            except Exception:
                logger.exception("EC connector load failed; encoding locally")
            for mm_hash in requested:
                if mm_hash in self.encoder_cache and self._accept_loaded(mm_hash):
                    self.counters.ec_items_loaded += 1

        jobs: dict[str, _EncodeJob] = {}
        for item in so.scheduled:
            for feature in self._needed_features(item):
                if feature.mm_hash in self.encoder_cache or feature.mm_hash in so.stored_mm_hashes:
                    continue
                job = jobs.get(feature.mm_hash)
                if job is None:
                    jobs[feature.mm_hash] = _EncodeJob(feature.mm_hash, feature, [item.request_id])
                elif item.request_id not in job.request_ids:
                    job.request_ids.append(item.request_id)
        if not jobs:
            return
        self.counters.ec_load_fallbacks += sum(1 for h in jobs if h in requested)
        runnable: list[_EncodeJob] = []
        for job in jobs.values():
            # An image whose decoding was deferred (its output was to be loaded or was
            # cached) is decoded now; a reference without bytes cannot be.
            if job.feature.pixel_values is None and not decode_deferred_image(job.feature):
                reason = (
                    f"EC transfer of media item {job.mm_hash} failed"
                    if job.mm_hash in requested
                    else f"media reference {job.mm_hash} is no longer cached"
                )
                self._fail(job, f"{reason}, and the request carries no image to encode", out)
            else:
                runnable.append(job)
        for job, result in self._encode(runnable):
            if isinstance(result, Exception):
                self._fail_job(job, f"could not be encoded: {result}", out)
                continue
            self.encoder_cache[job.mm_hash] = result
            self.counters.encoder_items_computed += 1
            if self.ec_connector.is_producer:
                try:
                    self.ec_connector.save_caches(self.encoder_cache, job.mm_hash)
                    self.counters.ec_items_saved += 1
                except Exception as exc:
                    logger.warning("EC save of %s failed: %s", job.mm_hash, exc)

    def _accept_loaded(self, mm_hash: str) -> bool:
        tensor = self.encoder_cache[mm_hash]
        if tensor.dim() != 2 or tensor.shape[1] != self.model.encoder_output_size:
            logger.warning("loaded encoder output %s has shape %s", mm_hash, tuple(tensor.shape))
            del self.encoder_cache[mm_hash]
            return False
        self.encoder_cache[mm_hash] = tensor.to(device=self.model.device, dtype=self.model.dtype)
        return True

    def _needed_features(self, item: ScheduledRequest) -> list[MultiModalFeature]:
        start = item.num_computed_tokens
        end = start + item.num_scheduled_tokens
        features = self.requests[item.request_id].data.mm_features
        return [f for f in features if f.offset < end and f.offset + f.length > start]

    def _encode(self, jobs: list[_EncodeJob]) -> list[tuple[_EncodeJob, torch.Tensor | Exception]]:
        """All jobs in one vision-tower call; on failure, one call per job to isolate it."""
        if not jobs:
            return []
        try:
            return list(zip(jobs, self._encode_batch(jobs), strict=True))
        except Exception as exc:
            if len(jobs) == 1:
                return [(jobs[0], exc)]
        results: list[tuple[_EncodeJob, torch.Tensor | Exception]] = []
        for job in jobs:
            try:
                results.append((job, self._encode_batch([job])[0]))
            except Exception as exc:
                results.append((job, exc))
        return results

    def _encode_batch(self, jobs: list[_EncodeJob]) -> list[torch.Tensor]:
        self.counters.encoder_forward_calls += 1
        pixels = torch.cat([_pixels(job.feature) for job in jobs])
        grid = torch.tensor([list(job.feature.image_grid_thw) for job in jobs], dtype=torch.int64)
        outputs = self.model.encode_images(pixels, grid)
        if len(outputs) != len(jobs):
            raise ValueError(f"vision tower returned {len(outputs)} outputs for {len(jobs)} images")
        for job, tensor in zip(jobs, outputs, strict=True):
            if tensor.shape[0] != job.feature.length:
                raise ValueError(
                    f"image {job.mm_hash} gives {tensor.shape[0]} embeddings for "
                    f"{job.feature.length} placeholder tokens"
                )
        return list(outputs)

    def _fail_job(self, job: _EncodeJob, reason: str, out: ModelRunnerOutput) -> None:
        self._fail(job, f"media item {job.mm_hash} {reason}", out)

    def _fail(self, job: _EncodeJob, message: str, out: ModelRunnerOutput) -> None:
        out.failed_mm_hashes.add(job.mm_hash)
        for rid in job.request_ids:
            out.failed.setdefault(rid, message)

    # ---- language model -------------------------------------------------

    def _run_language_model(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        batch = [
            s for s in so.scheduled if s.num_scheduled_tokens > 0 and s.request_id not in out.failed
        ]
        kv = self.kv_connector
        if kv is not None and so.kv_connector_metadata is not None:
            kv.bind_connector_metadata(so.kv_connector_metadata)
        try:
            if kv is not None:
                kv.start_load_kv(self.kv_caches)
                kv.wait_for_load()
            if not batch:
                return
            try:
                self._forward_and_sample(batch, out)
            except Exception as exc:
                logger.exception("language-model step failed")
                for item in batch:
                    out.failed.setdefault(item.request_id, f"model step failed: {exc}")
                return
            if kv is not None:
                kv.save_kv(self.kv_caches)
        finally:
            if kv is not None:
                kv.clear_connector_metadata()

    def _forward_and_sample(self, batch: list[ScheduledRequest], out: ModelRunnerOutput) -> None:
        model = self.model
        states = [self.requests[item.request_id] for item in batch]
        inputs = self.input_batch.build(
            [
                StepRequest(
                    row=state.row,
                    start=item.num_computed_tokens,
                    num_new=item.num_scheduled_tokens,
                    prompt_len=len(state.data.prompt_token_ids),
                    mrope_positions=state.data.mrope_positions,
                    mrope_position_delta=state.data.mrope_position_delta,
                )
                for item, state in zip(batch, states, strict=True)
            ]
        )
        query_start = inputs.query_start
        embeds = model.embed_tokens(inputs.input_ids)
        for i, item in enumerate(batch):
            self._scatter_encoder_outputs(embeds, item, query_start[i])
        sampling = [i for i, item in enumerate(batch) if item.sample]
        rows = [self._sampling_row(states[i]) for i in sampling]
        # The grammar bitmask of constrained rows is computed while the model runs.
        bitmask = self.bitmask_filler.start(
            [r.grammar for r in rows], [r.output_token_ids for r in rows], model.vocab_size
        )
        hidden = self._forward(embeds, inputs)
        self.counters.lm_forward_calls += 1
        self.counters.lm_tokens += inputs.num_tokens
        self.counters.lm_requests += len(batch)
        self.counters.max_requests_per_forward = max(
            self.counters.max_requests_per_forward, len(batch)
        )

        if not sampling:
            return
        rows_idx = torch.tensor([query_start[i + 1] - 1 for i in sampling], device=model.device)
        logits = model.compute_logits(hidden[rows_idx])
        tokens, logprobs = self.sampler(logits, rows, bitmask, logits_writable=True)
        # A constrained row whose matcher failed, or whose token the grammar does not
        # allow, ends its request with an error and without the token.
        violations: dict[int, str] = {}
        if bitmask is not None:
            mask = bitmask.result() if isinstance(bitmask, Future) else bitmask
            violations = grammar_violations([r.grammar for r in rows], mask, tokens)
        for j, (i, token, lp) in enumerate(zip(sampling, tokens, logprobs, strict=True)):
            rid = batch[i].request_id
            if j in violations:
                out.failed[rid] = violations[j]
                continue
            self._record_sampled(states[i], token)
            out.sampled_token_ids[rid] = [token]
            if lp is not None:
                out.logprobs[rid] = [lp]

    def _forward(self, embeds: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        meta = inputs.attn_metadata
        graphs = self.decode_graphs
        size = graphs.padded_size(meta) if graphs is not None else None
        if graphs is None or size is None:
            return self.model.forward(embeds, inputs.positions, self.kv_caches, meta)
        hidden = graphs.run(embeds, inputs.positions, meta, size)
        self.counters.lm_graph_replays += 1
        return hidden

    def _scatter_encoder_outputs(
        self, embeds: torch.Tensor, item: ScheduledRequest, row0: int
    ) -> None:
        start = item.num_computed_tokens
        end = start + item.num_scheduled_tokens
        for feature in self._needed_features(item):
            lo = max(feature.offset, start)
            hi = min(feature.offset + feature.length, end)
            encoded = self.encoder_cache[feature.mm_hash]
            embeds[row0 + lo - start : row0 + hi - start] = encoded[
                lo - feature.offset : hi - feature.offset
            ].to(embeds.dtype)

    def _sampling_row(self, state: CachedRequest) -> SamplingRow:
        data = state.data
        params = data.sampling_params
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = self._generators.get(data.request_id)
            if generator is None:
                generator = make_generator(params.seed, self.model.device)
                self._generators[data.request_id] = generator
        return SamplingRow(
            params,
            generator,
            data.prompt_token_ids,
            state.output_token_ids,
            data.eos_token_ids,
            data.grammar,
            state.penalties,
        )


def _pixels(feature: MultiModalFeature) -> torch.Tensor:
    """The image's pixel values (every encode job has them: deferred ones are decoded
    before the job is made)."""
    if feature.pixel_values is None:
        raise ValueError(f"image {feature.mm_hash} has no pixel values")
    return feature.pixel_values
