"""Continuous-batching scheduler of the paged-attention serving engine (host side, plain Python).

Shaped like vllm/v1/core/sched/scheduler.py: no prefill or decode phase, only num_computed_tokens per request.
One engine step is schedule() -> the model runs the SchedulerOutput -> update_from_output(sampled tokens).
Modes (EngineConfig.mode):
- core: one request at a time; its whole prompt in one step, then one token per step.
- ragged: up to max_num_seqs requests decode together; a waiting prompt is prefilled whole when it fits.
- chunked: a token budget per step; prompts are cut into chunks to fill the remaining budget.
One scheduling pass, as vLLM v1's: running requests first, in queue order, whatever they need next (a decode,
a prefill chunk, a recompute), then waiting requests FCFS. When blocks run out, the last running request (the
lowest priority) is preempted by recompute: its blocks are freed, its num_computed_tokens is reset to 0 and it
goes back to the front of the waiting queue. Once the request being scheduled preempts itself, the running
pass stops; after any preemption no waiting request is admitted in that step.
Images (vLLM's multimodal encoder scheduling): an image's encoder runs, whole, in the step whose chunk first reaches
its placeholder, within an encoder compute budget per step, and its output stays in the encoder cache
(encoder_cache_manager.py) until the placeholder is fully computed. When the budget or the cache cannot take an
image, the chunk stops just before its placeholder (a running request with nothing left to schedule is skipped).

This is the original in torch_sources/serving/; serving_engine/scheduler.py is the JAX engine's own copy.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .config import EngineConfig
from .encoder_cache_manager import EncoderCacheManager
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus

__all__ = ["SchedulerOutput", "StepTrace", "Scheduler"]


@dataclass(frozen=True)
class SchedulerOutput:
    # One entry per scheduled request, in schedule order (running requests in queue order, then new ones).
    scheduled_req_ids: list[str]
    num_scheduled_tokens: list[int]  # query length of each request this step
    num_computed_tokens: list[int]  # tokens already in the KV cache before this step (context length)
    is_prefill: list[bool]  # False only for a decode: the single token fed is the last sampled one
    will_sample: list[bool]  # False for a partial prefill chunk: the token sampled for it is discarded
    new_block_ids: list[list[int]]  # blocks allocated to the request this step
    block_tables: list[list[int]]  # the request's whole block table after this step's allocation
    preempted_req_ids: list[str]  # preempted in this step (not scheduled)
    finished_req_ids: list[str]  # finished since the previous schedule(); the runner can drop their state
    # request id -> indices of its images whose encoder runs this step (its outputs go to the encoder cache)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)  # evicted from the encoder cache: drop them

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled_req_ids)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass(frozen=True)
class StepTrace:
    """What one engine step did to the schedule and the KV cache (EngineConfig.record_trace)."""
    scheduled_req_ids: list[str]  # in schedule order
    num_scheduled_tokens: list[int]
    preempted_req_ids: list[str]
    block_tables: list[list[int]]  # of each scheduled request, after this step's allocation
    freed_block_ids: list[int]  # back in the free list this step (preemptions, finished requests), in order
    evicted_block_ids: list[int]  # cached blocks whose hash was dropped on reuse this step, in order
    scheduled_encoder_inputs: list[tuple[str, int]] = field(default_factory=list)  # (request id, image), in order
    freed_mm_hashes: list[str] = field(default_factory=list)  # evicted from the encoder cache this step


class Scheduler:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.kv_cache_manager = KVCacheManager(config.block_size, config.num_blocks, config.enable_prefix_caching)
        self.encoder_cache_manager = EncoderCacheManager(config.encoder_cache_slots)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one has the lowest priority
        self.finished_req_ids: list[str] = []
        self._num_arrivals = 0
        self.trace: list[StepTrace] = []  # one entry per update_from_output when config.record_trace

    def add_request(self, request: Request) -> None:
        cfg, rid, n = self.config, request.request_id, request.num_prompt_tokens
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING or request.output_token_ids or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} is not fresh (status {request.status.name})")
        if n == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if n > cfg.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {n} tokens is longer than max_model_len={cfg.max_model_len}")
        # Most KV the request can ever hold: the whole prompt, or everything but the last sampled token.
        max_kv_tokens = max(n, min(n + request.sampling_params.max_tokens, cfg.max_model_len) - 1)
        blocks_needed = -(-max_kv_tokens // cfg.block_size)
        if blocks_needed > cfg.num_blocks - 1:
            # Alone in the cache it would still run out of blocks, so it would preempt itself forever.
            raise ValueError(
                f"request {rid!r} can never fit in the KV cache: up to {max_kv_tokens} tokens need {blocks_needed} "
                f"blocks of {cfg.block_size}, the cache has num_blocks={cfg.num_blocks} (one is the null block)")
        self._check_encoder_inputs_fit(request)
        request.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        self.requests[rid] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        cfg, kv = self.config, self.kv_cache_manager
        budget = cfg.max_num_batched_tokens
        encoder_budget = cfg.encoder_compute_budget  # image-embedding rows the encoder may still produce
        scheduled: dict[str, int] = {}  # request id -> tokens; insertion order is schedule order
        new_blocks: dict[str, list[int]] = {}
        scheduled_encoder_inputs: dict[str, list[int]] = {}  # request id -> images whose encoder runs this step
        preempted: list[Request] = []

        # 1. Running requests, in queue order (vLLM v1 has no prefill or decode phase).
        req_index = 0
        while req_index < len(self.running) and budget > 0:
            req = self.running[req_index]
            num_new = self._cap(req.num_tokens - req.num_computed_tokens, budget)
            inputs, new_encoder_budget = [], encoder_budget
            if req.has_encoder_inputs:
                inputs, num_new, new_encoder_budget = self._try_schedule_encoder_inputs(
                    req, req.num_computed_tokens, num_new, encoder_budget)
                if num_new == 0:
                    # Its next image does not fit this step. vLLM skips it rather than stopping, so the requests
                    # behind it still get the budget.
                    req_index += 1
                    continue
            while (blocks := kv.allocate_slots(req, num_new)) is None:
                victim = self.running.pop()  # the lowest priority: the last admitted
                num_tokens, num_encoder_tokens = self._preempt(victim, scheduled, new_blocks, scheduled_encoder_inputs)
                budget += num_tokens
                new_encoder_budget += num_encoder_tokens
                preempted.append(victim)
                if victim is req:
                    break
            if blocks is None:
                break  # it preempted itself: the cache cannot hold even the request being scheduled
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = [b.block_id for b in blocks]
            budget -= num_new
            encoder_budget = new_encoder_budget
            self._allocate_encoder_inputs(req, inputs, scheduled_encoder_inputs)
            req_index += 1

        # 2. Waiting requests, FCFS; none after a preemption (the cache is full) and none past max_num_seqs.
        while not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_running:
            req = self.waiting[0]
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if not cfg.chunked_prefill and num_new > budget:
                break  # a whole prefill must fit the remaining budget; wait for the next step
            num_new = self._cap(num_new, budget)
            inputs, new_encoder_budget = [], encoder_budget
            if req.has_encoder_inputs:
                inputs, num_new, new_encoder_budget = self._try_schedule_encoder_inputs(
                    req, num_hit_tokens, num_new, encoder_budget)
                if num_new == 0:
                    break
            blocks = kv.allocate_slots(req, num_new, hit_blocks)
            if blocks is None:
                self.encoder_cache_manager.free(req)  # drop the references check_and_update_cache took
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = [b.block_id for b in blocks]
            budget -= num_new
            encoder_budget = new_encoder_budget
            self._allocate_encoder_inputs(req, inputs, scheduled_encoder_inputs)

        # 3. Record the step, then advance num_computed_tokens at once (vLLM does the same): the tokens count as
        # computed for the next schedule() even before update_from_output.
        ids = list(scheduled)
        out = SchedulerOutput(
            scheduled_req_ids=ids,
            num_scheduled_tokens=[scheduled[r] for r in ids],
            num_computed_tokens=[self.requests[r].num_computed_tokens for r in ids],
            is_prefill=[not self._is_decode(self.requests[r]) for r in ids],
            will_sample=[self.requests[r].num_computed_tokens + scheduled[r] >= self.requests[r].num_tokens
                         for r in ids],
            new_block_ids=[new_blocks[r] for r in ids],
            block_tables=[kv.get_block_ids(self.requests[r]) for r in ids],
            preempted_req_ids=[r.request_id for r in preempted],
            finished_req_ids=self.finished_req_ids,
            scheduled_encoder_inputs=scheduled_encoder_inputs,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
        )
        for r in ids:
            req = self.requests[r]
            req.num_computed_tokens += scheduled[r]
            if req.has_encoder_inputs:
                self._free_encoder_inputs(req)
        self.finished_req_ids = []
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, int]) -> list[Request]:
        """Append each scheduled request's sampled token and stop finished ones -> the requests finished now.
        Partial prefill chunks need no entry in sampled_token_ids (any entry for them is ignored)."""
        finished = []
        for rid in scheduler_output.scheduled_req_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue  # aborted after schedule()
            if req.num_computed_tokens < req.num_tokens:
                continue  # mid-prefill: the model's sample at a non-final position means nothing
            if rid not in sampled_token_ids:
                raise ValueError(f"no sampled token for request {rid!r}")
            req.append_output_token_ids(sampled_token_ids[rid])
            status = self._check_stop(req)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        # Every block event since the previous step ended belongs to this one (schedule and update alternate).
        freed, evicted = self.kv_cache_manager.block_pool.take_block_events()
        if self.config.record_trace:
            out = scheduler_output
            self.trace.append(StepTrace(list(out.scheduled_req_ids), list(out.num_scheduled_tokens),
                                        list(out.preempted_req_ids), [list(t) for t in out.block_tables],
                                        freed, evicted,
                                        [(rid, i) for rid, inputs in out.scheduled_encoder_inputs.items()
                                         for i in inputs],
                                        list(out.free_encoder_mm_hashes)))
        return finished

    # -- helpers ---------------------------------------------------------------------------------------------
    @staticmethod
    def _is_decode(req: Request) -> bool:
        # Exactly the last sampled token is left to compute; a prompt or a recompute is a prefill.
        return req.num_computed_tokens >= req.num_prompt_tokens and req.num_tokens - req.num_computed_tokens == 1

    def _cap(self, num_new: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _check_encoder_inputs_fit(self, request: Request) -> None:
        # The encoder runs an image whole, so one larger than the compute budget or the cache never runs. vLLM
        # raises both limits to the largest image at startup; the engine refuses the request instead.
        cfg = self.config
        for i in range(len(request.mm_placeholders)):
            n = request.get_num_encoder_tokens(i)
            if n > cfg.encoder_compute_budget or n > cfg.encoder_cache_slots:
                raise ValueError(
                    f"request {request.request_id!r}: image {i} has {n} placeholder tokens, more than the encoder "
                    f"compute budget ({cfg.encoder_compute_budget}, max_num_encoder_input_tokens) or the encoder "
                    f"cache ({cfg.encoder_cache_slots}, encoder_cache_size) can take, so it could never be scheduled")

    def _try_schedule_encoder_inputs(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                                     encoder_budget: int) -> tuple[list[int], int, int]:
        """The images whose encoder must run for tokens [num_computed_tokens, +num_new_tokens) of the request ->
        (their indices, num_new_tokens, encoder budget left). An image already in the KV cache or in the encoder
        cache needs no run. When the budget or the cache cannot take an image, the chunk stops just before its
        placeholder (0 tokens when the chunk starts inside it). Nothing is allocated here."""
        cache = self.encoder_cache_manager
        inputs: list[int] = []
        hashes: set[str] = set()  # scheduled in this call: a repeated image runs once
        num_embeds_to_schedule = 0
        for i, (start, length, mm_hash) in enumerate(request.mm_placeholders):
            if start >= num_computed_tokens + num_new_tokens:
                break  # this image, and every later one, lies past the chunk
            if start + length <= num_computed_tokens:
                continue  # its embeddings already went into the KV cache
            if mm_hash in hashes or cache.check_and_update_cache(request, i):
                continue
            if not cache.can_allocate(request, i, encoder_budget, num_embeds_to_schedule):
                # The encoder attends over a whole image, so it cannot run on the part this chunk would cover.
                num_new_tokens = start - num_computed_tokens if num_computed_tokens < start else 0
                break
            num_embeds = request.get_num_encoder_tokens(i)
            num_embeds_to_schedule += num_embeds
            encoder_budget -= num_embeds
            hashes.add(mm_hash)
            inputs.append(i)
        return inputs, num_new_tokens, encoder_budget

    def _allocate_encoder_inputs(self, req: Request, inputs: list[int], encoder_inputs: dict[str, list[int]]) -> None:
        # The request is scheduled: its images' encoder outputs take their cache rows now.
        if not inputs:
            return
        encoder_inputs[req.request_id] = inputs
        for i in inputs:
            self.encoder_cache_manager.allocate(req, i)

    def _free_encoder_inputs(self, req: Request) -> None:
        # An image whose placeholder is fully computed lives on in the KV cache: drop the request's reference.
        cache = self.encoder_cache_manager
        for i in sorted(cache.get_cached_input_ids(req)):
            start, length, _ = req.mm_placeholders[i]
            if start + length <= req.num_computed_tokens:
                cache.free_encoder_input(req, i)

    def _preempt(self, req: Request, scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                 encoder_inputs: dict[str, list[int]]) -> tuple[int, int]:
        """Recompute preemption -> (tokens, encoder rows) it had been scheduled this step (back to the budgets).
        Its encoder outputs stay cached, unreferenced: resumed before they are evicted, it reuses them."""
        self.kv_cache_manager.free(req)
        self.encoder_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        new_blocks.pop(req.request_id, None)
        num_encoder_tokens = sum(req.get_num_encoder_tokens(i) for i in encoder_inputs.pop(req.request_id, []))
        return scheduled.pop(req.request_id, 0), num_encoder_tokens

    def _check_stop(self, req: Request) -> RequestStatus | None:
        # Same order as vllm/v1/core/sched/utils.py::check_stop: eos, then stop tokens, then the length caps, so a
        # stop token sampled as the last allowed token finishes as "stop", not "length".
        params, last = req.sampling_params, req.output_token_ids[-1]
        if not params.ignore_eos and req.eos_token_id is not None and last == req.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= self.config.max_model_len or req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        self.kv_cache_manager.free(req)
        self.encoder_cache_manager.free(req)
        self.finished_req_ids.append(req.request_id)
        del self.requests[req.request_id]
