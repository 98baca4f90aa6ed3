"""Block pool, free LRU queue, block hashing and the KV cache manager."""
import pytest

from pagedllm.core import BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager
from pagedllm.core.hashing import hash_block_tokens, update_block_hashes
from pagedllm.engine.request import Request
from pagedllm.sampling_params import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def make_request(request_id, prompt, max_tokens=8):
    return Request(request_id, prompt, SamplingParams(), max_tokens)


def fake_hash(i):
    return i.to_bytes(16, "little")


# ---- free queue ----------------------------------------------------------------------------------------

def test_free_queue_fifo_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3] and len(queue) == 2
    queue.append(blocks[2])
    queue.appendleft(blocks[4])
    assert ids(queue) == [4, 1, 3, 2]
    assert queue.popleft() is blocks[4]
    assert ids(queue) == [1, 3, 2]


def test_free_queue_rejects_double_insert_and_foreign_remove():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeBlockQueue(blocks[:1])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    queue.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


# ---- block pool ----------------------------------------------------------------------------------------

def test_pool_lru_order_of_freed_blocks():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [0, 1, 2] and ids(b) == [3, 4]
    pool.cache_full_blocks(a, [fake_hash(i) for i in range(3)], 0, 3)
    pool.cache_full_blocks(b, [fake_hash(10 + i) for i in range(2)], 0, 2)
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    # Never-used block 5 first, then request a tail first, then request b tail first.
    assert ids(pool.free_block_queue) == [5, 2, 1, 0, 4, 3]
    assert ids(pool.get_new_blocks(3)) == [5, 2, 1]


def test_pool_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [fake_hash(0), fake_hash(1)], 0, 2)
    pool.free_blocks(reversed(blocks))
    # Blocks 2 and 3 hold no reusable KV, so they go before the cached 0 and 1.
    assert ids(pool.free_block_queue) == [2, 3, 1, 0]


def test_pool_lazy_eviction_keeps_hash_until_block_is_reused():
    pool = BlockPool(2, enable_caching=True)
    block, other = pool.get_new_blocks(2)
    pool.cache_full_blocks([block], [fake_hash(7)], 0, 1)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1
    assert pool.get_cached_block(fake_hash(7)) is block and block.block_hash == fake_hash(7)
    assert pool.get_new_blocks(1) == [block]
    assert pool.get_cached_block(fake_hash(7)) is None and block.block_hash is None
    assert pool.cached_blocks == {}
    pool.free_blocks([block, other])


def test_pool_touch_revives_a_cached_free_block():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [fake_hash(i) for i in range(3)], 0, 3)
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(fake_hash(0))
    pool.touch([hit])
    assert hit.ref_cnt == 1 and ids(pool.free_block_queue) == [1, 2]
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 2
    # Reusing the other blocks never evicts the touched one.
    pool.get_new_blocks(2)
    assert pool.get_cached_block(fake_hash(0)) is hit


def test_pool_usage_ignores_cached_free_blocks():
    pool = BlockPool(4, enable_caching=True)
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.usage == 0.5
    pool.cache_full_blocks(blocks, [fake_hash(0), fake_hash(1)], 0, 2)
    pool.free_blocks(blocks)
    assert pool.usage == 0.0 and len(pool.cached_blocks) == 2


def test_pool_rejects_double_free_and_overdraw():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)


def test_pool_duplicate_content_stays_private_and_disabled_cache_keeps_nothing():
    pool = BlockPool(3, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [fake_hash(1)], 0, 1)
    pool.cache_full_blocks([second], [fake_hash(1)], 0, 1)
    assert pool.get_cached_block(fake_hash(1)) is first and second.block_hash is None

    off = BlockPool(2, enable_caching=False)
    blocks = off.get_new_blocks(2)
    off.cache_full_blocks(blocks, [fake_hash(0), fake_hash(1)], 0, 2)
    assert off.cached_blocks == {} and all(b.block_hash is None for b in blocks)


def test_pool_reset_prefix_cache():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [fake_hash(0), fake_hash(1)], 0, 2)
    pool.free_blocks(blocks[:1])
    pool.reset_prefix_cache()
    assert pool.cached_blocks == {} and all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(fake_hash(0)) is None


# ---- hashing -------------------------------------------------------------------------------------------

def test_block_hash_chains_over_the_whole_prefix():
    a = hash_block_tokens(None, [1, 2])
    assert len(a) == 16 and a == hash_block_tokens(None, [1, 2])
    assert a != hash_block_tokens(None, [2, 1])
    # Same block tokens under different parents must differ: a hash names the whole prefix.
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(None, [3, 4])


def test_update_block_hashes_is_incremental_over_full_blocks():
    request = make_request("r", [1, 2, 3, 4, 5])
    update_block_hashes(request, 2)
    first = list(request.block_hashes)
    assert len(first) == 2
    request.append_output_token(6)
    request.append_output_token(7)
    update_block_hashes(request, 2)
    assert request.block_hashes[:2] == first and len(request.block_hashes) == 3
    expected, parent = [], None
    for i in range(0, 6, 2):
        parent = hash_block_tokens(parent, request.all_token_ids[i:i + 2])
        expected.append(parent)
    assert request.block_hashes == expected


# ---- KV cache manager ----------------------------------------------------------------------------------

def test_manager_shares_prefix_blocks_and_computes_last_token():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(10)))
    assert manager.get_computed_blocks(first) == ([], 0)
    manager.allocate_slots(first, 10)
    assert len(manager.get_block_ids(first)) == 3

    second = make_request("b", list(range(10)) + [99, 98])
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8 and hits == manager.get_blocks(first)[:2]
    manager.allocate_slots(second, 4, hits, num_hit)
    assert manager.get_block_ids(second)[:2] == manager.get_block_ids(first)[:2]
    assert manager.get_block_ids(second)[2] != manager.get_block_ids(first)[2]
    assert [b.ref_cnt for b in manager.get_blocks(second)] == [2, 2, 1]
    assert second.num_cached_tokens == 8
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (22, 8)

    # A prompt of exactly two cached blocks may hit only the first: its last token must be computed.
    exact = make_request("c", list(range(8)))
    hits, num_hit = manager.get_computed_blocks(exact)
    assert num_hit == 4 and len(hits) == 1


def test_manager_counts_stats_once_per_request():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    holder = make_request("holder", list(range(10)))
    manager.allocate_slots(holder, 10)
    big = make_request("big", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 8
    # Needs 2 more blocks but only 1 is free: nothing changes, nothing is counted.
    before = [b.ref_cnt for b in manager.block_pool.blocks]
    assert manager.allocate_slots(big, 5, hits, num_hit) is None
    assert [b.ref_cnt for b in manager.block_pool.blocks] == before
    assert big.num_cached_tokens == -1 and manager.prefix_cache_queries == 10
    manager.free(holder)
    hits, num_hit = manager.get_computed_blocks(big)
    assert manager.allocate_slots(big, 5, hits, num_hit) is not None
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (23, 8)


def test_manager_free_hits_count_against_free_blocks():
    manager = KVCacheManager(num_blocks=3, block_size=2)
    first = make_request("a", [1, 2, 3, 4, 5])
    manager.allocate_slots(first, 5)
    manager.free(first)
    assert manager.num_free_blocks == 3
    # Hits on the 2 cached free blocks leave 1 free block, enough for the one new block needed.
    second = make_request("b", [1, 2, 3, 4, 5, 6])
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 4
    assert manager.allocate_slots(second, 2, hits, num_hit) is not None
    assert manager.num_free_blocks == 0
    assert manager.get_blocks(second)[:2] == hits


def test_manager_without_caching_shares_nothing():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    first, second = make_request("a", list(range(10))), make_request("b", list(range(10)))
    manager.allocate_slots(first, 10)
    assert manager.get_computed_blocks(second) == ([], 0)
    manager.allocate_slots(second, 10)
    assert set(manager.get_block_ids(first)).isdisjoint(manager.get_block_ids(second))
    assert first.block_hashes == [] and manager.block_pool.cached_blocks == {}
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    assert second.num_cached_tokens == 0


def test_manager_free_returns_every_block_tail_first():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first, second = make_request("a", list(range(12))), make_request("b", list(range(12)))
    manager.allocate_slots(first, 12)
    hits, num_hit = manager.get_computed_blocks(second)
    manager.allocate_slots(second, 12 - num_hit, hits, num_hit)
    assert manager.usage == 4 / 8
    manager.free(first)
    assert manager.num_free_blocks == 5  # the two shared blocks are still held by the second request
    manager.free(second)
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)
    assert manager.req_to_blocks == {} and manager.num_cached_blocks == {}
    # Tail blocks are evicted first; the second request's private copy of block 2 holds no cache entry
    # (block 2 already owns that hash), so it goes to the head.
    assert ids(manager.block_pool.free_block_queue) == [3, 4, 5, 6, 7, 2, 1, 0]


def test_manager_caches_blocks_as_decode_fills_them():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    request = make_request("a", [1, 2, 3])
    manager.allocate_slots(request, 3)
    request.num_computed_tokens = 3
    assert len(manager.block_pool.cached_blocks) == 1
    request.append_output_token(4)
    manager.allocate_slots(request, 1)
    assert len(manager.block_pool.cached_blocks) == 2
    assert manager.get_blocks(request)[1].block_hash == request.block_hashes[1]


def test_manager_rejects_bad_arguments():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    request = make_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1"):
        manager.allocate_slots(request, 0)
    with pytest.raises(ValueError, match="exceed its 3 tokens"):
        manager.allocate_slots(request, 4)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        manager.allocate_slots(request, 1, (), 2)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        KVCacheManager(num_blocks=4, block_size=0)
