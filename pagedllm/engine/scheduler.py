"""Continuous batching: which requests run each step, for how many tokens, and who gets preempted."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)."""

    request: Request
    num_new_tokens: int
    # Tokens already in the KV cache before this step (including prefix-cache hits).
    num_computed_tokens: int
    # True when this step reaches the request's last token, so a next token must be sampled. Fixed at
    # construction because the request grows once the sampled token is appended.
    sample: bool = field(init=False)

    def __post_init__(self) -> None:
        self.sample = self.num_computed_tokens + self.num_new_tokens == self.request.num_scheduled_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # batch order
    num_batched_tokens: int
    preempted: list[Request]


class Scheduler:
    """First-come-first-served continuous batching with chunked prefill and preemption by recompute.

    Each step spends a budget of max_num_batched_tokens: running requests first (decodes and the next
    chunk of unfinished prefills), then waiting requests in FIFO order. num_computed_tokens advances when a
    request is scheduled, as in vLLM, so a step's output describes the cache after the step.

    Asynchronous scheduling: schedule() may run again before update_from_output() has delivered the previous
    step's tokens. A request whose token is still on its way carries a placeholder
    (request.num_placeholders): it is scheduled to decode that token (the runner takes its id from the
    device), unless the token is bound to be its last by length. Everything else that depends on the token's
    value (stops, prefix-cache hashes) waits for update_from_output().
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, block_size: int, num_blocks: int) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if (block_size, num_blocks) != (kv_cache_manager.block_size, kv_cache_manager.num_blocks):
            raise ValueError(f"scheduler block_size/num_blocks ({block_size}, {num_blocks}) differ from the KV "
                             f"cache manager's ({kv_cache_manager.block_size}, {kv_cache_manager.num_blocks})")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # Sorted by arrival, so the earliest request is served first and the latest is preempted first.
        # Appending keeps it sorted: everything waiting arrived after everything running (FIFO admission,
        # and a preempted request was the latest running one and goes back to the front of the queue).
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, request: Request) -> None:
        request_id = request.request_id
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if num_prompt > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt of {num_prompt} tokens is longer than "
                             f"max_model_len {self.max_model_len}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # The last sampled token is never fed back, so its K/V is never written.
        max_kv_tokens = max(num_prompt, min(num_prompt + request.max_tokens, self.max_model_len) - 1)
        max_blocks = -(-max_kv_tokens // self.block_size)
        if max_blocks > self.num_blocks:
            # It could never run to completion, even alone: reject now instead of letting it wait forever.
            raise ValueError(f"request {request_id!r} ({num_prompt} prompt tokens, max_tokens "
                             f"{request.max_tokens}) needs up to {max_kv_tokens} tokens of KV cache = "
                             f"{max_blocks} blocks of {self.block_size}, but the pool has {self.num_blocks}")
        self.requests[request_id] = request
        self.waiting.append(request)
        request.stats.queued_ts = time.monotonic()

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._ends_with_placeholder(request):
                index += 1
                continue
            num_new = min(request.num_scheduled_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, preempted):
                break
            scheduled.append(self._schedule_one(request, num_new))
            budget -= num_new
            index += 1

        # After a preemption memory is short: admitting new work would only thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_computed, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks, num_computed) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.stats.scheduled_ts = request.stats.scheduled_ts or time.monotonic()
            request.num_computed_tokens = num_computed
            self.running.append(request)
            scheduled.append(self._schedule_one(request, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted)

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append the sampled tokens and retire finished requests; returns the requests that got a token.

        Tokens sampled for requests still mid-prefill are ignored: their logits came from a partial prompt.
        """
        advanced, finished = [], []
        now = time.monotonic()
        for item in scheduler_output.scheduled:
            request = item.request
            if not item.sample:
                continue
            request.num_placeholders -= 1
            # Finished after it was scheduled (an abort, a stop string, or, when steps overlap, a stop in
            # the step before): its blocks are already gone and the token is dropped.
            if request.is_finished:
                continue
            token = sampled.get(request.request_id)
            if token is None:
                raise ValueError(f"request {request.request_id!r} completed its tokens this step but no "
                                 f"sampled token was given for it")
            # Preempted while this step ran (only when steps overlap): it finishes from the waiting queue.
            waiting = request.status == RequestStatus.PREEMPTED
            request.append_output_token(token)
            request.stats.first_token_ts = request.stats.first_token_ts or now
            request.stats.last_token_ts = now
            advanced.append(request)
            if request.check_stop():
                finished.append(request)
            elif request.num_tokens >= self.max_model_len:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                finished.append(request)
            else:
                continue
            if waiting:
                self.waiting.remove(request)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
            for request in finished:
                self._release(request)
        return advanced

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (stop strings, user aborts); unknown or finished ids are ignored.

        Call it between steps or after the model ran, never between schedule() and the model run: blocks
        registered in the prefix cache at schedule time hold their KV only once the step has run.
        """
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            # By its place, not its status: a step interrupted (Ctrl-C) between the two may leave a finished
            # request in running, or a preemption's victim in neither.
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[Request]) -> bool:
        """Allocate for a running request, preempting the latest arrivals until it fits.

        Returns False when the request had to preempt itself. running is sorted by arrival and everything
        before the request is already scheduled this step, so a victim is never part of this batch.
        """
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_one(self, request: Request, num_new: int) -> ScheduledRequest:
        item = ScheduledRequest(request, num_new, request.num_computed_tokens)
        request.num_computed_tokens += num_new
        request.num_placeholders += item.sample
        return item

    def _ends_with_placeholder(self, request: Request) -> bool:
        """True when the token still on its way will finish the request by length, so decoding it would be
        wasted (a stop token is not known in advance: that case costs one wasted decode)."""
        return request.num_placeholders > 0 and (
            request.num_output_tokens + request.num_placeholders >= request.max_tokens
            or request.num_scheduled_tokens >= self.max_model_len)

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its KV; it resumes with prompt + outputs so far as its prompt."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Front of the queue: it was admitted before everything still waiting.
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        del self.requests[request.request_id]
        self.kv_cache_manager.free(request)
