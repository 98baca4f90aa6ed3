"""Scheduler: budgets, chunked prefill, preemption, rejection, aborts, and a random-operation state machine.

A fake model stands in for the runner. The "KV" it writes for a position is a digest of the whole prefix up
to that position (as a real layer's K/V depends on every earlier token), stored in a shadow cache through
the block table; the next token is a function of the KV read back. A wrong block table, a bad prefix hit or
a block overwritten while shared therefore changes the generated tokens, which are compared against a
plain cache-free reference.
"""
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core import KVCacheManager
from pagedllm.core.hashing import hash_block_tokens
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

VOCAB = 12
STOP = 0


def kv_value(tokens, pos):
    return hash(tuple(tokens[:pos + 1]))


def next_token(kv_values):
    return hash(tuple(kv_values)) % VOCAB


def reference_output(prompt, max_tokens, max_model_len, stop=True):
    tokens, out = list(prompt), []
    while True:
        token = next_token([kv_value(tokens, p) for p in range(len(tokens))])
        tokens.append(token)
        out.append(token)
        if (stop and token == STOP) or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


class FakeModel:
    def __init__(self, manager):
        self.manager = manager
        self.block_size = manager.block_size
        self.cache = [None] * (manager.num_blocks * manager.block_size)
        self.last_sampled = {}

    def slots(self, request, end):
        block_ids = self.manager.get_block_ids(request)
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(end)]

    def execute(self, output):
        # Like the real runner: every scheduled token's KV is written before any attention reads.
        for item in output.scheduled:
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            tokens = item.request.all_token_ids
            if end > len(tokens):
                # A token still on its way (steps overlap): like the device, take it from the last samples.
                tokens = tokens + [self.last_sampled[item.request.request_id]]
            slots = self.slots(item.request, end)
            for p in range(start, end):
                self.cache[slots[p]] = kv_value(tokens, p)
        sampled = {}
        for item in output.scheduled:
            if item.sample:
                end = item.num_computed_tokens + item.num_new_tokens
                sampled[item.request.request_id] = next_token([self.cache[s] for s in self.slots(item.request, end)])
        self.last_sampled = sampled
        return sampled

    def assert_holds_prefix(self, request):
        n = min(request.num_computed_tokens, request.num_tokens)
        assert [self.cache[s] for s in self.slots(request, n)] == [kv_value(request.all_token_ids, p)
                                                                   for p in range(n)]


def make_request(request_id, prompt, max_tokens, stop=True):
    return Request(request_id, prompt, SamplingParams(stop_token_ids=[STOP] if stop else []), max_tokens)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=64, caching=True):
    manager = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(manager, max_num_seqs, budget, max_model_len, block_size, num_blocks), manager


def run_to_completion(scheduler, model, max_steps=2000):
    """Steps until nothing is left; returns every step's SchedulerOutput."""
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "scheduler made no progress"
        output = scheduler.schedule()
        scheduler.update_from_output(output, model.execute(output))
        outputs.append(output)
    return outputs


def prompt_of(seed, length):
    return [(seed * 7 + i * 3) % VOCAB or 1 for i in range(length)]


def test_token_budget_and_max_num_seqs_are_respected():
    scheduler, manager = make_scheduler(budget=7, max_num_seqs=3)
    requests = [make_request(f"r{i}", prompt_of(i, 5 + 3 * i), 6) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler, FakeModel(manager))
    for output in outputs:
        assert output.num_batched_tokens == sum(item.num_new_tokens for item in output.scheduled) <= 7
        assert len(output.scheduled) <= 3
    assert max(output.num_batched_tokens for output in outputs) == 7
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, 6, 64)
    assert manager.num_free_blocks == 64


def test_long_prompt_is_chunked_alongside_decodes():
    scheduler, manager = make_scheduler(budget=8)
    model = FakeModel(manager)
    # No stop token: the decoders must outlive the long prompt's prefill.
    decoders = [make_request(f"d{i}", [1 + i, 2, 3], 40, stop=False) for i in range(2)]
    for request in decoders:
        scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler.update_from_output(first, model.execute(first))
    long = make_request("long", prompt_of(5, 30), 3)
    scheduler.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        output = scheduler.schedule()
        by_id = {item.request.request_id: item for item in output.scheduled}
        assert [by_id[d.request_id].num_new_tokens for d in decoders] == [1, 1]
        chunks.append((by_id["long"].num_computed_tokens, by_id["long"].num_new_tokens, by_id["long"].sample))
        scheduler.update_from_output(output, model.execute(output))
    assert chunks == [(0, 6, False), (6, 6, False), (12, 6, False), (18, 6, False), (24, 6, True)]
    run_to_completion(scheduler, model)
    assert long.output_token_ids == reference_output(long.prompt_token_ids, 3, 64)


def test_preemption_by_recompute_in_a_tiny_pool_keeps_outputs():
    prompts = [prompt_of(i, 6) for i in range(3)]
    scheduler, manager = make_scheduler(num_blocks=12, block_size=2)
    model = FakeModel(manager)
    requests = [make_request(f"r{i}", p, 10, stop=False) for i, p in enumerate(prompts)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler, model)
    preempted = [r for output in outputs for r in output.preempted]
    assert preempted and scheduler.num_preemptions == len(preempted)
    # The latest arrival goes first.
    assert preempted[0] is requests[-1]
    assert sum(r.num_preemptions for r in requests) == len(preempted)
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, 10, 64, stop=False)
        assert request.status.finished
    assert manager.num_free_blocks == 12


def test_preempted_request_waits_at_the_front():
    scheduler, manager = make_scheduler(num_blocks=4, block_size=2, budget=64)

    def step():
        output = scheduler.schedule()
        scheduler.update_from_output(output, {item.request.request_id: 1 for item in output.scheduled
                                              if item.sample})
        return output

    old, new, later = (make_request(name, [i, 2, 3], 4, stop=False) for i, name in enumerate(("old", "new", "later")))
    scheduler.add_request(old)
    scheduler.add_request(new)
    step()  # both prefill: 2 blocks each, the pool is full
    scheduler.add_request(later)
    assert step().preempted == [] and later.status == RequestStatus.WAITING
    output = step()  # old needs a third block: the latest running arrival goes
    assert output.preempted == [new] and new.status == RequestStatus.PREEMPTED
    assert [item.request for item in output.scheduled] == [old]
    assert new.num_computed_tokens == 0 and manager.get_block_ids(new) == [] and new.num_preemptions == 1
    assert list(scheduler.waiting) == [new, later]
    while scheduler.has_unfinished_requests():
        step()
    assert [r.output_token_ids for r in (old, new, later)] == [[1] * 4] * 3
    assert manager.num_free_blocks == 4


def test_samples_of_one_prompt_share_prefix_blocks():
    scheduler, manager = make_scheduler(block_size=4)
    prompt = prompt_of(3, 13)
    samples = [make_request(f"s{i}", prompt, 4) for i in range(3)]
    for request in samples:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert [(item.num_computed_tokens, item.num_new_tokens) for item in output.scheduled] == \
        [(0, 13), (12, 1), (12, 1)]
    shared = manager.get_blocks(samples[0])[:3]
    assert all(manager.get_blocks(r)[:3] == shared for r in samples) and [b.ref_cnt for b in shared] == [3] * 3
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (39, 24)
    model = FakeModel(manager)
    scheduler.update_from_output(output, model.execute(output))
    run_to_completion(scheduler, model)
    for request in samples:
        assert request.output_token_ids == reference_output(prompt, 4, 64)


def test_impossible_requests_are_rejected_while_others_run():
    scheduler, manager = make_scheduler(num_blocks=3, block_size=4, max_model_len=20)
    model = FakeModel(manager)
    ok = make_request("ok", prompt_of(1, 10), 3)  # KV for 12 tokens: exactly the 3 blocks
    scheduler.add_request(ok)
    output = scheduler.schedule()
    scheduler.update_from_output(output, model.execute(output))
    with pytest.raises(ValueError, match="prompt of 21 tokens is longer than max_model_len 20"):
        scheduler.add_request(make_request("long", prompt_of(2, 21), 1))
    with pytest.raises(ValueError, match="needs up to 17 tokens of KV cache = 5 blocks of 4, but the pool has 3"):
        scheduler.add_request(make_request("big", prompt_of(3, 10), 8))
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add_request(make_request("empty", [], 4))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("ok", [1], 4))
    other = make_request("other", prompt_of(4, 9), 3)
    scheduler.add_request(other)
    run_to_completion(scheduler, model)
    for request in (ok, other):
        assert request.output_token_ids == reference_output(request.prompt_token_ids, 3, 20)
    assert manager.num_free_blocks == 3


def test_abort_frees_everything():
    scheduler, manager = make_scheduler(num_blocks=16, max_num_seqs=2, budget=16)
    model = FakeModel(manager)
    requests = [make_request(f"r{i}", prompt_of(i, 9), 20) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, model.execute(output))
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2 and manager.num_free_blocks < 16
    # An abort between the model run and the update: the update must skip it.
    output = scheduler.schedule()
    sampled = model.execute(output)
    scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(output, sampled)
    assert requests[0].num_output_tokens == 1
    scheduler.finish_requests(["r1", "r3", "nope"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests(["r2"], RequestStatus.FINISHED_STOPPED)
    assert not scheduler.has_unfinished_requests() and scheduler.requests == {}
    assert manager.num_free_blocks == 16 and manager.usage == 0.0
    assert [r.status for r in requests] == [RequestStatus.FINISHED_ABORTED] * 2 + \
        [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED]
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests(["r0"], RequestStatus.RUNNING)


def test_stop_token_and_length_cap():
    scheduler, _ = make_scheduler(max_model_len=12)
    capped = make_request("capped", [1] * 10, 50)
    stopped = make_request("stopped", [2] * 4, 50)
    scheduler.add_request(capped)
    scheduler.add_request(stopped)
    output = scheduler.schedule()
    assert scheduler.update_from_output(output, {"capped": 1, "stopped": 1}) == [capped, stopped]
    assert not capped.is_finished and not stopped.is_finished
    output = scheduler.schedule()
    assert scheduler.update_from_output(output, {"capped": 1, "stopped": STOP}) == [capped, stopped]
    assert not scheduler.running
    assert capped.status == RequestStatus.FINISHED_LENGTH_CAPPED and capped.num_tokens == 12
    assert stopped.status == RequestStatus.FINISHED_STOPPED and stopped.stop_reason == STOP


def test_block_completed_by_a_token_in_flight_is_cached_once_known():
    """Overlapped steps: the decode that completes a block runs before its token reaches the host, so the
    block cannot be hashed then; when the request finishes without another allocation, freeing it registers
    the block, and a later prompt with that prefix hits it."""
    scheduler, manager = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    model = FakeModel(manager)
    request = make_request("a", [1, 2, 3], 2, stop=False)
    scheduler.add_request(request)
    first = scheduler.schedule()  # prefill; samples token 4 (a placeholder until delivered)
    first_sampled = model.execute(first)
    second = scheduler.schedule()  # decodes position 3 with the placeholder: block 0 is now full
    assert [it.num_new_tokens for it in second.scheduled] == [1] and not manager.block_pool.cached_blocks
    second_sampled = model.execute(second)
    scheduler.update_from_output(first, first_sampled)
    assert scheduler.schedule().scheduled == []  # its next token is its last: nothing left to decode
    scheduler.update_from_output(second, second_sampled)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and manager.num_free_blocks == 8
    follower = make_request("b", request.all_token_ids[:4] + [5], 1, stop=False)
    scheduler.add_request(follower)
    assert manager.get_computed_blocks(follower)[1] == 4


def test_missing_sampled_token_is_an_error():
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2], 4))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token was given"):
        scheduler.update_from_output(output, {})


def test_scheduler_rejects_mismatched_config():
    manager = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="differ from the KV cache manager"):
        Scheduler(manager, 4, 16, 64, block_size=2, num_blocks=8)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        Scheduler(manager, 0, 16, 64, 4, 8)


# ---- random operation sequences --------------------------------------------------------------------------

BASES = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [5, 4, 3, 2, 1, 5, 4, 3], [2] * 10]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans(),
                max_num_seqs=st.integers(1, 4), budget=st.integers(1, 12), max_model_len=st.integers(6, 24))
    def setup(self, num_blocks, block_size, caching, max_num_seqs, budget, max_model_len):
        self.scheduler, self.manager = make_scheduler(num_blocks, block_size, max_num_seqs, budget,
                                                      max_model_len, caching)
        self.model = FakeModel(self.manager)
        self.expected = {}  # request id -> reference output, for requests that end on their own
        self.all_requests = []
        self.hash_prefix = {}  # block hash -> the tokens it names, to check cached blocks' content
        self.in_flight = None  # a step whose tokens are not delivered yet (asynchronous scheduling)

    @rule(base=st.integers(0, 2), keep=st.integers(0, 12), suffix=st.lists(st.integers(1, VOCAB - 1), max_size=8),
          max_tokens=st.integers(1, 10), n=st.integers(1, 3))
    def add(self, base, keep, suffix, max_tokens, n):
        prompt = BASES[base][:keep] + suffix
        scheduler = self.scheduler
        kv_tokens = max(len(prompt), min(len(prompt) + max_tokens, scheduler.max_model_len) - 1)
        fits = 0 < len(prompt) <= scheduler.max_model_len and \
            -(-kv_tokens // scheduler.block_size) <= scheduler.num_blocks
        for _ in range(n):
            request = make_request(f"r{len(self.all_requests)}", prompt, max_tokens)
            self.all_requests.append(request)
            if not fits:
                with pytest.raises(ValueError):
                    scheduler.add_request(request)
                continue
            scheduler.add_request(request)
            self.expected[request.request_id] = reference_output(prompt, max_tokens, scheduler.max_model_len)

    @rule()
    def step(self):
        self._step()

    @rule()
    def step_overlapped(self):
        """Asynchronous scheduling: the next step is scheduled before this one's tokens are delivered."""
        self._step(overlap=True)

    @precondition(lambda self: self.scheduler.running)
    @rule(pick=st.integers(0, 50))
    def step_with_abort_before_update(self, pick):
        self._step(abort_pick=pick)

    @precondition(lambda self: self.scheduler.requests)
    @rule(pick=st.integers(0, 50),
          status=st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]))
    def finish_from_outside(self, pick, status):
        ids = sorted(self.scheduler.requests)
        request_id = ids[pick % len(ids)]
        self.scheduler.finish_requests([request_id], status)
        del self.expected[request_id]

    @rule()
    def reset_prefix_cache(self):
        self.manager.reset_prefix_cache()

    @rule()
    def drain(self):
        for _ in range(2000):
            if not self.scheduler.has_unfinished_requests():
                return
            self._step()
        raise AssertionError("requests never finished")

    def _step(self, abort_pick=None, overlap=False):
        scheduler = self.scheduler
        # Blocks are registered in the cache when scheduled and when freed (preemption, finishing): every
        # prefix a request has reached is recorded before either can happen.
        self._record_hashes(self.all_requests)
        output = scheduler.schedule()
        items = output.scheduled
        assert output.num_batched_tokens == sum(item.num_new_tokens for item in items)
        assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert len(items) <= scheduler.max_num_seqs and all(item.num_new_tokens >= 1 for item in items)
        assert len({id(item.request) for item in items}) == len(items)
        for request in output.preempted:
            assert request.status == RequestStatus.PREEMPTED and request not in [i.request for i in items]
        if output.preempted:
            # Victims are the latest arrivals, and nothing new is admitted in a step that preempts.
            assert max((i.request.arrival for i in items), default=-1) < min(r.arrival for r in output.preempted)
        sampled = self.model.execute(output)
        if abort_pick is not None and items:
            victim = items[abort_pick % len(items)].request
            scheduler.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
            del self.expected[victim.request_id]
        # As LLMEngine.step: the step queued before this one is delivered after this one is scheduled.
        previous, self.in_flight = self.in_flight, (output, sampled) if overlap else None
        for step in [previous] + ([] if overlap else [(output, sampled)]):
            if step is None:
                continue
            for request in scheduler.update_from_output(*step):
                self._record_hashes([request])
                if request.is_finished:
                    assert request.output_token_ids == self.expected.pop(request.request_id)

    def _record_hashes(self, requests):
        bs = self.manager.block_size
        for request in requests:
            parent = None
            for i in range(request.num_tokens // bs):
                parent = hash_block_tokens(parent, request.all_token_ids[i * bs:(i + 1) * bs])
                self.hash_prefix[parent] = tuple(request.all_token_ids[:(i + 1) * bs])

    @invariant()
    def blocks_are_accounted_for(self):
        scheduler, manager = self.scheduler, self.manager
        pool = manager.block_pool
        running_ids = {r.request_id for r in scheduler.running}
        assert set(manager.req_to_blocks) <= running_ids
        held = Counter(b.block_id for blocks in manager.req_to_blocks.values() for b in blocks)
        assert [b.ref_cnt for b in pool.blocks] == [held[b.block_id] for b in pool.blocks]
        free = [b.block_id for b in pool.free_block_queue]
        assert len(free) == len(set(free)) == manager.num_free_blocks
        assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert manager.num_free_blocks + len(held) == manager.num_blocks
        assert len(scheduler.running) <= scheduler.max_num_seqs
        assert [r.arrival for r in scheduler.running] == sorted(r.arrival for r in scheduler.running)
        for request in scheduler.running:
            assert request.status == RequestStatus.RUNNING
            assert len(manager.get_blocks(request)) == -(-request.num_computed_tokens // manager.block_size)
            self.model.assert_holds_prefix(request)
        for request in scheduler.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0 and request.request_id not in manager.req_to_blocks
        assert scheduler.num_preemptions == sum(r.num_preemptions for r in self.all_requests)

    @invariant()
    def placeholders_are_the_tokens_in_flight(self):
        # A live request is one token ahead exactly when it samples in the step not yet delivered.
        in_flight = set()
        if self.in_flight is not None:
            in_flight = {id(item.request) for item in self.in_flight[0].scheduled if item.sample}
        for request in self.all_requests:
            if not request.is_finished:
                assert request.num_placeholders == (id(request) in in_flight)

    @invariant()
    def prefix_cache_is_consistent(self):
        pool, bs = self.manager.block_pool, self.manager.block_size
        if not self.manager.enable_caching:
            assert pool.cached_blocks == {} and all(b.block_hash is None for b in pool.blocks)
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_blocks)
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
            # The block's KV must be exactly what the prefix its hash names would produce.
            prefix = self.hash_prefix[block_hash]
            start = len(prefix) - bs
            assert self.model.cache[block.block_id * bs:(block.block_id + 1) * bs] == \
                [kv_value(prefix, p) for p in range(start, len(prefix))]

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        manager = self.manager
        assert not self.scheduler.has_unfinished_requests()
        assert manager.num_free_blocks == manager.num_blocks and manager.usage == 0.0
        assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks) and manager.req_to_blocks == {}


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
