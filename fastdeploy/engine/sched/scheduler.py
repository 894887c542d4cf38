"""Continuous batching: running requests first, then waiting ones, under one token budget.

Each step mixes decodes and (chunked) prefills. When the KV pool runs dry the
most recently admitted running request is preempted (its blocks freed, to be
recomputed later).

Disaggregated serving (requests carrying vLLM's ``kv_transfer_params``):

- prefill half (``do_remote_decode``): after its first token the request finishes, but its
  blocks are held and handed to the KV connector; they are freed once the decode instance
  has them (or the hand-over failed or expired).
- decode half (``do_remote_prefill``): blocks for the prompt are allocated and the request
  waits (WAITING_FOR_REMOTE_KVS) until the prompt's KV cache has arrived; then it joins the
  waiting queue with all but the last prompt token computed. Recomputing that one token
  gives the first token's logits here, so sampling (seed, logprobs, grammar) is exactly a
  mixed instance's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fastdeploy.config import CacheConfig, SchedulerConfig
from fastdeploy.engine.kv_cache.kv_cache_manager import KVCacheManager
from fastdeploy.engine.request import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
    Request,
    RequestStatus,
    SchedulerStats,
)
from fastdeploy.engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from fastdeploy.logger import init_logger
from fastdeploy.spec_decode.scheduling import SpecDecodingStats, spec_grammar_bitmask, usable_drafts
from fastdeploy.worker.model_runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from fastdeploy.distributed.kv_transfer.pd_engine import PDKVTransfer
    from fastdeploy.model_executor.guided_decoding.manager import StructuredOutputManager
    from fastdeploy.spec_decode.config import SpeculativeConfig

logger = init_logger(__name__)


class Scheduler:
    """vLLM-style scheduler with chunked prefill, prefix caching and preemption by recompute."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        structured_output_manager: StructuredOutputManager | None = None,
        kv_transfer: PDKVTransfer | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.config = scheduler_config
        # Speculative decoding: KV slots a proposer writes past a request's scheduled tokens, and
        # the draft statistics sent with each step's stats.
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config else 0
        self.spec_stats = SpecDecodingStats(speculative_config.num_speculative_tokens) if speculative_config else None
        self.structured_output_manager = structured_output_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner still holds state for but must drop at the next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Outputs of requests that ended without running (a grammar that failed to compile, a
        # KV transfer that failed).
        self._orphan_outputs: list[EngineCoreOutput] = []
        self.kv_transfer = kv_transfer
        # Decode half: requests whose prompt KV is on its way, by id.
        self.waiting_for_kv: dict[str, Request] = {}
        # Prefill half: finished requests whose blocks the connector still hands over, by id.
        self.held_for_transfer: dict[str, Request] = {}

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if (request.do_remote_decode or request.do_remote_prefill) and self.kv_transfer is None:
            raise ValueError(f"Request {request.request_id} carries kv_transfer_params, but this instance runs "
                             "without KV transfer (start it with --splitwise-role or --kv-transfer-config).")
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("Structured outputs need the scheduler's StructuredOutputManager.")
            # Compiles off the loop; the request is not scheduled before its grammar is ready.
            self.structured_output_manager.grammar_init(request)
            request.status = RequestStatus.WAITING_FOR_FSM
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort, stop string seen by the front end)."""
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_kv[req_id]
                assert self.kv_transfer is not None
                self.kv_transfer.abort(req_id)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        # Held blocks keep the loop stepping too: someone has to free them once handed over.
        return bool(self.waiting or self.running or self.waiting_for_kv or self.held_for_transfer)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    def has_pending_kv_transfers(self) -> bool:
        return bool(self.waiting_for_kv or self.held_for_transfer)

    # ---- scheduling --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.kv_transfer is not None:
            self._poll_kv_transfers()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}
        kv = self.kv_cache_manager

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # Draft tokens count against the budget like any other token.
            num_new = min(request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=self._lookahead(request, num_new))
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            num_spec = request.num_computed_tokens + num_new - request.num_tokens
            if num_spec > 0:
                # The budget may cut the drafts short; the ones scheduled are verified this step.
                spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []
            cached_reqs.append(
                CachedRequestData(request.request_id, [b.block_id for b in new_blocks], request.num_computed_tokens)
            )
            i += 1

        # Admit waiting requests only when nothing had to be preempted this step.
        # Requests whose grammar still compiles are stepped over and keep their place.
        not_ready: list[Request] = []
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request):
                self.waiting.popleft()
                if not request.is_finished():
                    not_ready.append(request)
                continue
            if request.do_remote_prefill:
                # Blocks now, data later: no token budget is used until the KV cache arrives.
                if len(self.running) + len(self.waiting_for_kv) >= self.max_num_seqs:
                    break
                if not self._start_remote_prefill(request):
                    break
                self.waiting.popleft()
                continue
            if request.num_computed_tokens > 0:
                # The prompt's KV came from a prefill instance into blocks it already holds.
                computed_blocks, num_computed = [], request.num_computed_tokens
            else:
                cached = kv.get_computed_blocks(request, wait_for_pending=True)
                if cached is None:
                    # A request in this batch is computing the prefix and its prompt logprobs (lm-eval's
                    # choices of one question arrive together): take them from the cache next step.
                    self.waiting.popleft()
                    not_ready.append(request)
                    continue
                computed_blocks, num_computed = cached
            num_new = request.num_tokens - num_computed
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            new_blocks = kv.allocate_slots(request, num_new, computed_blocks,
                                           num_lookahead_tokens=self._lookahead(request, num_new, num_computed))
            if new_blocks is None:
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            if computed_blocks and kv.needs_prompt_logprobs(request) is not None:
                request.cached_prompt_logprobs = kv.cached_prompt_logprobs(computed_blocks,
                                                                           request.num_prompt_logprobs_sent)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_computed,
                    bad_words_token_ids=request.bad_words_token_ids,
                    eos_token_id=request.eos_token_id,
                    mm_features=request.mm_features,
                )
            )

        self.waiting.extendleft(reversed(not_ready))

        # A request preempted after being scheduled earlier in this step must not run.
        for req_id in preempted:
            num_scheduled.pop(req_id, None)
        cached_reqs = [c for c in cached_reqs if c.req_id not in preempted]
        for req_id in preempted:
            spec_tokens.pop(req_id, None)
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        if self.structured_output_manager is not None:
            # Only requests whose chunk reaches their last token sample (and need a mask) this step.
            sampling = [
                request
                for req_id, n in num_scheduled.items()
                if (request := self.requests[req_id]).use_structured_output
                and request.num_computed_tokens + n >= request.num_tokens
            ]
            if sampling:
                output.grammar_bitmask, output.structured_output_request_ids = (
                    spec_grammar_bitmask(self.structured_output_manager, sampling, spec_tokens) if spec_tokens
                    else self.structured_output_manager.grammar_bitmask(sampling)
                )
        return output

    def _lookahead(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """KV slots past this step's tokens for a draft model's proposals, within max_model_len."""
        if not self.num_lookahead_tokens:
            return 0
        end = (request.num_computed_tokens if num_computed is None else num_computed) + num_new
        return max(min(self.num_lookahead_tokens, self.max_model_len - end), 0)

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a WAITING_FOR_FSM request can be admitted; a failed grammar finishes it (abort).

        The caller takes the request out of the waiting queue when this returns False.
        """
        so_request = request.structured_output_request
        assert so_request is not None
        if not so_request.is_ready:
            return False
        if so_request.error is not None:
            logger.error("Grammar of request %s failed to compile: %s", request.request_id, so_request.error)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            self._orphan_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT))
            return False
        request.status = RequestStatus.WAITING
        return True

    # ---- disaggregated serving ------------------------------------------------------------
    def _start_remote_prefill(self, request: Request) -> bool:
        """Allocate the prompt's blocks and start receiving its KV; False when the pool is short."""
        assert self.kv_transfer is not None
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, request.num_prompt_tokens, cache=False) is None:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_kv[request.request_id] = request
        try:
            self.kv_transfer.on_decode_allocated(request.request_id, kv.get_block_ids(request.request_id),
                                                 request.kv_transfer_params or {})
        except Exception as e:
            self._fail_remote_prefill(request, e)
        return True

    def _fail_remote_prefill(self, request: Request, error: BaseException | str) -> None:
        del self.waiting_for_kv[request.request_id]
        logger.warning("KV cache of request %s did not arrive: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        self._orphan_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT,
                                                     error=f"KV cache transfer from the prefill instance failed: "
                                                           f"{error}"))

    def _poll_kv_transfers(self) -> None:
        """Free handed-over blocks; move requests whose KV arrived to the head of the queue."""
        assert self.kv_transfer is not None
        for request_id, _, _ in self.kv_transfer.take_releasable():
            held = self.held_for_transfer.pop(request_id, None)
            if held is not None:
                self.kv_cache_manager.free(held)
        done, failed = self.kv_transfer.take_received()
        for request_id, error in failed.items():
            if (request := self.waiting_for_kv.get(request_id)) is not None:
                self._fail_remote_prefill(request, error)
        for request_id in done:
            request = self.waiting_for_kv.pop(request_id, None)
            if request is None:
                continue
            request.do_remote_prefill = False
            # All but the last prompt token: recomputing it here samples the first token.
            request.num_computed_tokens = request.num_prompt_tokens - 1
            request.num_cached_tokens = 0
            request.status = RequestStatus.WAITING_FOR_FSM if request.use_structured_output else RequestStatus.WAITING
            self.waiting.appendleft(request)

    def _hand_over_kv(self, request: Request) -> tuple[dict | None, str | None]:
        """Prefill half done: hold its prompt blocks for the decode instance; (params, error)."""
        assert self.kv_transfer is not None
        kv = self.kv_cache_manager
        num_blocks = -(-request.num_prompt_tokens // kv.block_size)
        block_ids = kv.get_block_ids(request.request_id)[:num_blocks]
        # The runner forgets the request now; only its blocks stay until handed over.
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        try:
            params = self.kv_transfer.on_prefill_done(request.request_id, block_ids,
                                                      request.all_token_ids[request.num_prompt_tokens],
                                                      request.kv_transfer_params or {},
                                                      num_tokens=request.num_prompt_tokens)
        except Exception as e:
            kv.free(request)
            logger.warning("Cannot hand the KV cache of %s over: %s", request.request_id, e)
            return None, f"KV cache hand-over to the decode instance failed: {e}"
        self.held_for_transfer[request.request_id] = request
        return params, None

    def requests_waiting_for_grammar(self) -> list[Request]:
        """Waiting requests whose grammar is still compiling."""
        return [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_FSM]

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- results -----------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Advance each scheduled request, check stop conditions, and build the step's outputs."""
        outputs, self._orphan_outputs = self._orphan_outputs, []
        sampled = runner_output.sampled_token_ids
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            prompt_lp = self._prompt_logprobs(request, runner_output.prompt_logprobs.get(req_id))
            request.num_computed_tokens += num_tokens
            new_token_ids = sampled.get(req_id)
            if new_token_ids is None:
                if prompt_lp is not None:
                    outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=prompt_lp))
                continue
            num_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            if num_spec:
                # The rejected drafts' KV slots are written again next step.
                request.num_computed_tokens -= num_spec + 1 - len(new_token_ids)
                assert self.spec_stats is not None
                self.spec_stats.observe(num_spec, len(new_token_ids) - 1)
            so_manager = self.structured_output_manager
            # Several tokens come from a verified run of drafts: each is checked in turn and the
            # run ends at the first that finishes the request.
            num_kept = 0
            for token in new_token_ids:
                num_kept += 1
                request.append_output_token_ids([token])
                if request.use_structured_output and so_manager is not None and so_manager.should_advance(request):
                    grammar = request.structured_output_request.grammar
                    grammar.accept_tokens(req_id, [token])
                    self._check_stop(request)
                    if not request.is_finished() and grammar.is_terminated():
                        # The grammar is complete (it accepted its own stop token): the answer is done.
                        request.status = RequestStatus.FINISHED_STOPPED
                        last = request.all_token_ids[-1]
                        request.stop_reason = None if last == request.eos_token_id else last
                else:
                    self._check_stop(request)
                if request.is_finished():
                    break
            logprobs: LogprobsLists | None = runner_output.logprobs.get(req_id)
            if num_kept < len(new_token_ids):
                new_token_ids = new_token_ids[:num_kept]
                if logprobs is not None:
                    logprobs = LogprobsLists(logprobs.token_ids[:num_kept], logprobs.logprobs[:num_kept],
                                             logprobs.ranks[:num_kept], None if logprobs.entry_ranks is None
                                             else logprobs.entry_ranks[:num_kept])
            drafts = runner_output.spec_token_ids.get(req_id)
            if drafts and not request.is_finished():
                request.spec_token_ids = usable_drafts(request, drafts, self.max_model_len, so_manager)
            kv_params = error = None
            if request.is_finished():
                self.running.remove(request)
                if request.do_remote_decode and self.kv_transfer is not None:
                    kv_params, error = self._hand_over_kv(request)
                else:
                    self._free_request(request)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    new_logprobs=logprobs,
                    new_prompt_logprobs=prompt_lp,
                    finish_reason=request.get_finish_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    kv_transfer_params=kv_params,
                    error=error,
                    num_preemptions=request.num_preemptions,
                )
            )
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.time())

    def _prompt_logprobs(self, request: Request, rows: LogprobsLists | None) -> LogprobsLists | None:
        """The prompt logprob rows to send for this step: cache-hit rows first, then the runner's.

        The runner's rows start at the request's ``num_computed_tokens`` (before this step);
        they are kept with the request's full blocks for later hits. Rows already sent (a run
        after a preemption recomputes them) are dropped.
        """
        first = request.num_computed_tokens
        if rows is not None:
            self.kv_cache_manager.store_prompt_logprobs(request, first, rows)
        cached, request.cached_prompt_logprobs = request.cached_prompt_logprobs, None
        if cached is not None and cached.ranks:
            first -= len(cached.ranks)
            rows = cached if rows is None else LogprobsLists(cached.token_ids + rows.token_ids,
                                                             cached.logprobs + rows.logprobs, cached.ranks + rows.ranks)
        if rows is None:
            return None
        skip = request.num_prompt_logprobs_sent - first
        if skip > 0:
            rows = LogprobsLists(rows.token_ids[skip:], rows.logprobs[skip:], rows.ranks[skip:])
        request.num_prompt_logprobs_sent = max(request.num_prompt_logprobs_sent, first + len(rows.ranks) + max(skip, 0))
        return rows if rows.ranks else None

    def _check_stop(self, request: Request) -> None:
        sp = request.sampling_params
        if request.num_tokens >= self.max_model_len or request.num_output_tokens >= request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_output_tokens < sp.min_tokens:
            return
        last = request.all_token_ids[-1]
        if not sp.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
        elif last in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last

    def make_stats(self) -> SchedulerStats:
        queries, hits = self.kv_cache_manager.take_prefix_cache_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_kv),
            num_deferred_reqs=len(self.waiting_for_kv),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_used_blocks=self.kv_cache_manager.num_used_blocks,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=self.num_preemptions,
            spec_decoding_stats=None if self.spec_stats is None else self.spec_stats.take(),
            kv_transfer_events=(self.kv_transfer.connector.metrics.drain_events()
                                if self.kv_transfer is not None else []),
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
