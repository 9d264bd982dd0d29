"""Continuous batching with chunked prefill, an encoder budget and preemption.

Each step, running requests are scheduled first (decodes and unfinished
prefill chunks), then waiting ones, within a token budget, an encoder compute
budget and ``max_num_seqs``. Every request is "``num_computed_tokens`` of
``num_tokens``": prefill and decode are the same loop. Media items are served
in this order (DESIGN 3): a hit in the encoder cache, else a load through the
EC connector, else a local encode. When the KV cache is full the
lowest-priority running request is preempted (its KV freed, recomputed later);
nothing crashes. A constrained request whose grammar is still being built (on a
compile thread, see ``structured_output``) waits aside, outside the queue, and
fails once the build fails or outlasts ``grammar_compile_timeout_s``: no step
waits for a grammar.

The scheduler does bookkeeping only: ids, counts, block ids, hashes.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ec_frontend.connectors.ec_item_params import group_video_patches
from ec_frontend.engine.encoder_planner import EncoderInputPlanner, EncoderPlan
from ec_frontend.engine.outputs import EngineCoreOutput, ModelRunnerOutput
from ec_frontend.engine.request import Request, RequestStatus
from ec_frontend.engine.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from ec_frontend.errors import GRAMMAR_FAILURE_PREFIX
from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    from ec_frontend.config import SchedulerConfig
    from ec_frontend.connectors.base import ECConnectorBase
    from ec_frontend.connectors.kv_base import KVConnectorBase, KVLoadResult
    from ec_frontend.engine.encoder_cache import EncoderCacheManager
    from ec_frontend.engine.kv_cache import KVCacheManager

__all__ = ["Scheduler", "SchedulerCounters", "SchedulerOutput"]


@dataclass(slots=True)
class SchedulerCounters:
    prompt_tokens_computed: int = 0
    kv_tokens_received: int = 0
    encoder_cache_hits: int = 0
    #: Items an encoder found in the shared store and did not compute.
    encoder_items_found_stored: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    #: Prompt tokens of requests looked up in the prefix cache, and how many it held
    #: (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Scheduler:
    """Decides what each step computes and tracks requests until they are freed.

    ``kv_cache`` is ``None`` on an encoder-only instance: there a request's
    prompt is passed over (no language model), its media are encoded, and it
    finishes once every item is encoded and saved.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        kv_cache: KVCacheManager | None,
        encoder_cache: EncoderCacheManager,
        ec_connector: ECConnectorBase | None = None,
        kv_connector: KVConnectorBase | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.encoder_cache = encoder_cache
        self.ec_connector = ec_connector
        self.kv_connector = kv_connector
        self.encoder_only = kv_cache is None
        self._planner = EncoderInputPlanner(
            encoder_cache, ec_connector, config.encoder_budget, encoder_only=self.encoder_only
        )

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        #: Items of this step an encoder found in the shared store (not to be encoded).
        self._step_stored: set[str] = set()
        self.running: list[Request] = []
        self._remote_kv: dict[str, tuple[Request, int]] = {}
        self._ec_fetching: list[Request] = []
        self._grammar_building: list[Request] = []
        self._kv_delayed: dict[str, Request] = {}
        self._ec_delayed: dict[str, Request] = {}
        self._finished_req_ids: set[str] = set()
        # The requests of the last schedule() by id (the output carries plain data),
        # and how many blocks of each request's table the runner has been sent.
        self._scheduled_requests: dict[str, Request] = {}
        self._blocks_sent: dict[str, int] = {}
        self._pending_outputs: list[EngineCoreOutput] = []
        self.counters = SchedulerCounters()
        # Prefix-cache blocks keyed during the current step, by the request computing
        # them, and the requests admitted this step on such blocks (their readers).
        self._step_keyed: dict[int, str] = {}
        self._step_keyed_by: dict[str, list[int]] = {}
        self._step_readers: dict[str, set[str]] = {}

    # ---- requests in and out ------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        grammar = request.grammar
        if grammar is not None and not grammar.grammar.ready:
            request.status = RequestStatus.WAITING_FOR_FSM
            grammar.start()
            self._grammar_building.append(request)
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_requests(
        self,
        request_ids: str | list[str],
        status: RequestStatus,
        *,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> list[EngineCoreOutput]:
        """End live requests (abort, stop string, error); returns their final outputs."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        outputs = []
        for rid in ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self._remote_kv.pop(rid, None)
            if request in self._ec_fetching:
                self._ec_fetching.remove(request)
            self._stop_building(request)
            request.status = status
            request.stop_reason = stop_reason
            request.error = error
            outputs.append(self._final_output(request, []))
        return outputs

    def _final_output(self, request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        kv_params, ec_params = self._free_request(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            kv_transfer_params=kv_params,
            ec_transfer_params=ec_params,
            error=request.error,
        )

    def _free_request(self, request: Request) -> tuple[JSONObject | None, JSONObject | None]:
        """Ask the connectors for the request's transfer params, then free what they allow.

        Returns ``(kv_transfer_params, ec_transfer_params)``; ``None`` for an
        absent connector. A connector that asks to delay freeing keeps the KV
        blocks (or encoder references) until it reports the request sent.
        """
        rid = request.request_id
        kv_delay, kv_params = False, None
        if self.kv_connector is not None:
            blocks = list(self.kv_cache.block_table(rid)) if self.kv_cache is not None else []
            kv_delay, kv_params = self.kv_connector.request_finished(request, blocks)
        ec_delay, ec_params = False, None
        if self.ec_connector is not None:
            ec_delay, ec_params = self.ec_connector.request_finished(request)
            if isinstance(ec_params, dict):
                ec_params = group_video_patches(ec_params, request.mm_features)

        if kv_delay:
            self._kv_delayed[rid] = request
        elif self.kv_cache is not None:
            self.kv_cache.free(rid)
        if ec_delay and self.ec_connector is not None and self.ec_connector.pins_encoder_outputs:
            # Pin the request's encoder outputs (also those its prompt has passed)
            # until the connector reports them sent.
            for i, feature in enumerate(request.mm_features):
                if self.encoder_cache.contains(feature.mm_hash):
                    self.encoder_cache.check_and_update_cache(request, i)
        else:
            self.encoder_cache.free(request)
        if ec_delay:
            self._ec_delayed[rid] = request
        if not kv_delay and not ec_delay:
            self._release(request)
        return kv_params, ec_params

    def _release(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self._blocks_sent.pop(request.request_id, None)
        self._finished_req_ids.add(request.request_id)

    def _fail(self, request: Request, message: str) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
        self._stop_building(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        self._pending_outputs.append(self._final_output(request, []))

    # ---- scheduling ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        token_budget = sys.maxsize if self.encoder_only else cfg.max_num_batched_tokens
        encoder_budget = cfg.encoder_budget
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._step_keyed.clear()
        self._step_keyed_by.clear()
        self._step_readers.clear()
        if self._grammar_building:
            self._check_grammars()

        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            plan = self._planner.plan(request, request.num_computed_tokens, num_new, encoder_budget)
            if plan.error is not None:
                self._fail(request, plan.error)
                continue
            if plan.num_new_tokens == 0:
                index += 1
                continue
            blocks_ok = True
            while not self._allocate(request, request.num_computed_tokens + plan.num_new_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    blocks_ok = False
                    break
            if not blocks_ok:
                break
            self._commit(request, plan)
            self._cache_blocks(request, request.num_computed_tokens + plan.num_new_tokens)
            encoder_budget = plan.encoder_budget
            token_budget -= plan.num_new_tokens
            scheduled.append(self._scheduled(request, plan, is_new=False))
            index += 1

        if not preempted:
            self._schedule_waiting(scheduled, token_budget, encoder_budget)

        self._scheduled_requests = {}
        for item in scheduled:
            request = self.requests[item.request_id]
            request.num_computed_tokens += item.num_scheduled_tokens
            self._scheduled_requests[item.request_id] = request

        out = SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=sum(s.num_scheduled_tokens for s in scheduled),
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted,
            free_encoder_mm_hashes=self.encoder_cache.take_freed_mm_hashes(),
            stored_mm_hashes=self._step_stored,
        )
        self._step_stored = set()
        self._finished_req_ids = set()
        if self.ec_connector is not None:
            out.ec_connector_metadata = self.ec_connector.build_connector_meta(out)
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return out

    def _schedule_waiting(
        self, scheduled: list[ScheduledRequest], token_budget: int, encoder_budget: int
    ) -> None:
        cfg = self.config
        self._readmit_ec_fetched()
        while self.waiting and token_budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            if self._ec_still_fetching(request):
                self.waiting.popleft()
                self._ec_fetching.append(request)
                continue
            num_external = 0
            load_async = False
            if self.kv_connector is not None and request.num_computed_tokens == 0:
                num_external, load_async = self.kv_connector.get_num_new_matched_tokens(
                    request, request.num_computed_tokens
                )
                # Only an asynchronous load whose connector hands over the sampled
                # token may cover the whole prompt; otherwise the last is computed.
                whole = load_async and self.kv_connector.hands_over_sampled_token
                limit = request.num_tokens if whole else request.num_tokens - 1
                num_external = max(0, min(num_external, limit))
            if load_async and num_external > 0:
                if not self._allocate(request, num_external):
                    break
                self._kv_after_alloc(request, num_external)
                self.waiting.popleft()
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self._remote_kv[request.request_id] = (request, num_external)
                continue
            cached: list[int] = []
            if num_external == 0 and request.num_computed_tokens == 0 and self.kv_cache:
                cached = self.kv_cache.find_cached_prefix(request)
            num_hit = len(cached) * self.kv_cache.block_size if cached and self.kv_cache else 0
            start = request.num_computed_tokens + num_external + num_hit
            num_new = request.num_tokens - start
            if not cfg.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            plan = self._planner.plan(request, start, num_new, encoder_budget)
            if plan.error is not None:
                self._fail(request, plan.error)
                continue
            if plan.num_new_tokens == 0 or not self._allocate(
                request, start + plan.num_new_tokens, cached
            ):
                # Not admitted: keep no cache hits pinned while it waits.
                self.encoder_cache.free(request)
                break
            self.waiting.popleft()
            if self.kv_connector is not None:
                self._kv_after_alloc(request, num_external)
            if num_external:
                request.num_computed_tokens = start
                request.num_cached_tokens = num_external
                self.counters.kv_tokens_received += num_external
            elif (
                self.kv_cache is not None
                and self.kv_cache.enable_prefix_caching
                and request.num_computed_tokens == 0
            ):
                # Looked up above; a request resuming with received KV keeps its tokens.
                self._admit_prefix_hit(request, cached, num_hit)
            self._commit(request, plan)
            self._cache_blocks(request, start + plan.num_new_tokens)
            encoder_budget = plan.encoder_budget
            token_budget -= plan.num_new_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, plan, is_new=True))

    def _scheduled(self, request: Request, plan: EncoderPlan, *, is_new: bool) -> ScheduledRequest:
        """The runner's view of ``request``'s share of this step. ``is_new``: admitted
        from the waiting queue, so the runner has no state for it (new, resumed after
        preemption, or continuing from received KV)."""
        rid = request.request_id
        end = request.num_computed_tokens + plan.num_new_tokens
        table = self.kv_cache.block_table(rid) if self.kv_cache else []
        sent = 0 if is_new else self._blocks_sent.get(rid, 0)
        self._blocks_sent[rid] = len(table)
        new_request = None
        if is_new:
            new_request = NewRequestData(
                request_id=rid,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                mm_features=request.mm_features,
                eos_token_ids=request.eos_token_ids,
                mrope_positions=request.mrope_positions,
                mrope_position_delta=request.mrope_position_delta,
                grammar=request.grammar,
            )
        return ScheduledRequest(
            request_id=rid,
            num_computed_tokens=request.num_computed_tokens,
            num_scheduled_tokens=plan.num_new_tokens,
            new_block_ids=list(table[sent:]),
            encoder_inputs=plan.encode,
            ec_loads=plan.load,
            sample=not self.encoder_only and end >= request.num_tokens,
            new_request=new_request,
        )

    def _allocate(self, request: Request, num_tokens: int, cached: list[int] | None = None) -> bool:
        if self.kv_cache is None:
            return True
        return self.kv_cache.allocate(request.request_id, num_tokens, cached or ()) is not None

    def _admit_prefix_hit(self, request: Request, cached: list[int], num_hit: int) -> None:
        """Count a prefix-cache lookup of an admitted request and start it after its hit."""
        self.counters.prefix_cache_queries += request.num_tokens
        self.counters.prefix_cache_hits += num_hit
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        writers = {self._step_keyed[b] for b in cached if b in self._step_keyed}
        if writers:
            self._step_readers[request.request_id] = writers

    def _cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Key the request's full blocks this step computes; remember them until the
        step's results show whether their KV was written."""
        if self.kv_cache is None:
            return
        keyed = self.kv_cache.cache_blocks(request, num_computed_tokens)
        if keyed:
            self._step_keyed_by.setdefault(request.request_id, []).extend(keyed)
            for block in keyed:
                self._step_keyed[block] = request.request_id

    def _drop_unwritten_blocks(self, so: SchedulerOutput, failed: dict[str, str]) -> None:
        """A request that failed this step wrote no KV: unkey the blocks it keyed this
        step, and fail the requests admitted this step on them (in schedule order, so
        a reader's own readers follow)."""
        for item in so.scheduled:
            rid = item.request_id
            if rid not in failed:
                writer = next((w for w in self._step_readers.get(rid, ()) if w in failed), None)
                if writer is None:
                    continue
                failed[rid] = f"the request computing its cached prefix failed: {failed[writer]}"
            if self.kv_cache is not None:
                self.kv_cache.uncache(self._step_keyed_by.get(rid, ()))

    def _kv_after_alloc(self, request: Request, num_external: int) -> None:
        if self.kv_connector is not None and self.kv_cache is not None:
            blocks = list(self.kv_cache.block_table(request.request_id))
            self.kv_connector.update_state_after_alloc(request, blocks, num_external)

    def _preempt(self, request: Request) -> None:
        self._blocks_sent.pop(request.request_id, None)
        if self.kv_cache is not None:
            self.kv_cache.free(request.request_id)
        self.encoder_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(request)

    def _commit(self, request: Request, plan: EncoderPlan) -> None:
        self._planner.commit(request, plan)
        self.counters.encoder_cache_hits += plan.hits
        self.counters.encoder_items_found_stored += len(plan.stored)
        self._step_stored.update(plan.stored)

    # ---- results ------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply a step's results; returns one output per request with news."""
        self._handle_finished_transfers(runner_output)
        if runner_output.failed and self._step_keyed_by:
            self._drop_unwritten_blocks(scheduler_output, runner_output.failed)
        outputs = self._pending_outputs
        self._pending_outputs = []
        for item in scheduler_output.scheduled:
            request = self._scheduled_requests.get(item.request_id)
            if request is None or request.is_finished:
                continue
            error = runner_output.failed.get(request.request_id)
            if error is not None:
                self._fail(request, error)
                outputs.extend(self._pending_outputs)
                self._pending_outputs = []
                continue
            if not self.encoder_only and item.num_computed_tokens < request.num_prompt_tokens:
                prompt_end = min(
                    item.num_computed_tokens + item.num_scheduled_tokens, request.num_prompt_tokens
                )
                self.counters.prompt_tokens_computed += prompt_end - item.num_computed_tokens
            new_ids: list[int] = []
            for token in runner_output.sampled_token_ids.get(request.request_id, ()):
                request.output_token_ids.append(token)
                new_ids.append(token)
                self.counters.generation_tokens += 1
                if self._check_stop(request, token):
                    break
            self._free_passed_encoder_inputs(request)
            if self.encoder_only and request.num_computed_tokens >= request.num_prompt_tokens:
                request.status = RequestStatus.FINISHED_STOPPED
            if request.is_finished:
                self.running.remove(request)
                final = self._final_output(request, new_ids)
                final.new_logprobs = runner_output.logprobs.get(request.request_id)
                outputs.append(final)
            elif new_ids:
                outputs.append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=new_ids,
                        new_logprobs=runner_output.logprobs.get(request.request_id),
                        num_cached_tokens=request.num_cached_tokens,
                    )
                )
        for mm_hash in runner_output.failed_mm_hashes:
            self.encoder_cache.discard(mm_hash)
        return outputs

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.sampling_params
        if not params.ignore_eos and token in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
        elif (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ) or request.num_tokens >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return request.is_finished

    def _free_passed_encoder_inputs(self, request: Request) -> None:
        """Drop references to items the prompt has moved past (all copies of a hash)."""
        if not request.mm_features:
            return
        pending = {
            f.mm_hash
            for f in request.mm_features
            if f.offset + f.length > request.num_computed_tokens
        }
        for i, feature in enumerate(request.mm_features):
            if feature.mm_hash not in pending:
                self.encoder_cache.free_encoder_input(request, i)

    def _handle_finished_transfers(self, out: ModelRunnerOutput) -> None:
        for rid in out.kv_finished_recving or ():
            entry = self._remote_kv.pop(rid, None)
            if entry is None:
                continue
            request, num_external = entry
            result = self.kv_connector.get_load_result(request) if self.kv_connector else None
            if result is not None and result.error is not None:
                self._fail(request, result.error)
                continue
            request.num_computed_tokens = num_external
            request.num_cached_tokens = num_external
            self.counters.kv_tokens_received += num_external
            if num_external >= request.num_tokens and not self._take_remote_token(request, result):
                continue
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        for rid in out.kv_finished_sending or ():
            sent = self._kv_delayed.pop(rid, None)
            if sent is not None:
                if self.kv_cache is not None:
                    self.kv_cache.free(rid)
                if rid not in self._ec_delayed:
                    self._release(sent)
        for rid in out.ec_finished_sending or ():
            sent = self._ec_delayed.pop(rid, None)
            if sent is not None:
                self.encoder_cache.free(sent)
                if rid not in self._kv_delayed:
                    self._release(sent)

    def _take_remote_token(self, request: Request, result: KVLoadResult | None) -> bool:
        """The whole prompt's KV arrived: continue from the token the remote prefill
        sampled (or recompute the last prompt token when none came). False when
        that token finished the request."""
        token = result.first_token_id if result is not None else None
        if token is None:
            request.num_computed_tokens = request.num_tokens - 1
            return True
        request.output_token_ids.append(token)
        self.counters.generation_tokens += 1
        if self._check_stop(request, token):
            self._pending_outputs.append(self._final_output(request, [token]))
            return False
        self._pending_outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[token],
                num_cached_tokens=request.num_cached_tokens,
            )
        )
        return True

    # ---- grammars being built -----------------------------------------------

    def _check_grammars(self) -> None:
        """Queue the requests whose grammar is built; fail those whose build failed or
        outlasted ``grammar_compile_timeout_s``."""
        timeout = self.config.grammar_compile_timeout_s
        now = time.monotonic()
        for request in list(self._grammar_building):
            state = request.grammar
            if state is None or state.grammar.ready:
                self._grammar_building.remove(request)
                request.status = RequestStatus.WAITING
                self.waiting.append(request)
            elif state.grammar.error is not None:
                refused = state.grammar.error
                self._fail(request, f"{GRAMMAR_FAILURE_PREFIX}the grammar was refused: {refused}")
            elif state.since is not None and now - state.since > timeout:
                self._fail(
                    request,
                    f"{GRAMMAR_FAILURE_PREFIX}the grammar took longer than this server's limit of "
                    f"{timeout:g} s to build (--structured-outputs-compile-timeout)",
                )

    def _stop_building(self, request: Request) -> None:
        if request in self._grammar_building:
            self._grammar_building.remove(request)
            if request.grammar is not None:
                request.grammar.release()

    # ---- introspection ------------------------------------------------------

    def _ec_still_fetching(self, request: Request) -> bool:
        """The EC connector is still fetching the request's items in the background:
        it waits aside (not at the head of the queue) while others run."""
        ec = self.ec_connector
        return (
            ec is not None and request.num_computed_tokens == 0 and not ec.is_request_ready(request)
        )

    def _readmit_ec_fetched(self) -> None:
        if not self._ec_fetching or self.ec_connector is None:
            return
        ready = [r for r in self._ec_fetching if self.ec_connector.is_request_ready(r)]
        for request in reversed(ready):
            self._ec_fetching.remove(request)
            self.waiting.appendleft(request)

    def has_unfinished_requests(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self._remote_kv
            or self._ec_fetching
            or self._grammar_building
            or self._pending_outputs
        )

    def has_pending_work(self) -> bool:
        """Anything a step would do, including freeing delayed requests."""
        return self.has_unfinished_requests() or bool(
            self._kv_delayed or self._ec_delayed or self._finished_req_ids
        )

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return (
            len(self.waiting)
            + len(self._remote_kv)
            + len(self._ec_fetching)
            + len(self._grammar_building)
        )
