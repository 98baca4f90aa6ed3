"""Per-request block tables on top of the block pool, with prefix-cache lookup and registration."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.hashing import update_block_hashes

if TYPE_CHECKING:
    from pagedllm.engine.request import Request


class KVCacheManager:
    """Maps each request to its blocks; knows nothing about batching or priorities.

    Prefix-cache counters are in tokens and are recorded once per request, at its first successful
    allocation: queries += its token count then, hits += tokens served from the cache (also stored as
    request.num_cached_tokens, which is how a request is known to be scheduled before). Lookups for a
    request that then fails to get blocks, and lookups when a preempted request resumes, are not counted,
    so the hit rate describes what users' prompts got rather than how often the scheduler retried.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been offered to the cache, so each full block is
        # registered exactly once.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached run of the request's leading full blocks, and the tokens they cover.

        The last token is never served from the cache: the model must run on at least one token to
        produce the logits of the next one, so a fully cached prompt still recomputes its last block.
        """
        if not self.enable_caching:
            return [], 0
        update_block_hashes(request, self.block_size)
        if request.needs_prompt_logprobs:  # they need every prompt position's hidden state (vLLM skips the cache too)
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Give the request blocks for its next num_new_tokens tokens; None (and no change) if short.

        new_computed_blocks / num_new_computed_tokens are a fresh prefix hit from get_computed_blocks.
        Blocks that become full once this step's tokens are computed are registered in the cache now: a
        request scheduled later in the same step may hit them, which is sound because every layer writes
        the K/V of the whole batch before its attention reads any of it (the runner keeps such a decode step
        off the fused decoder-layer kernel, which reads cached keys before the step's writes land).
        Returns the newly added blocks.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(f"num_new_computed_tokens ({num_new_computed_tokens}) must equal "
                             f"{len(new_computed_blocks)} computed blocks x block_size {self.block_size}")
        request_id = request.request_id
        held = self.req_to_blocks.get(request_id, [])
        if new_computed_blocks and held:
            raise ValueError(f"request {request_id} already holds blocks; prefix hits apply only to a "
                             f"request that holds none")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        if num_total > request.num_scheduled_tokens:
            raise ValueError(f"request {request_id}: {num_computed} computed + {num_new_tokens} new tokens "
                             f"exceed its {request.num_scheduled_tokens} tokens")

        num_required = -(-num_total // self.block_size)
        if not new_computed_blocks and num_required <= len(held) and not (
                self.enable_caching and num_total // self.block_size > self.num_cached_blocks.get(request_id, 0)):
            return []  # most decode steps: the held blocks have room and no block became full
        num_new_blocks = num_required - len(held) - len(new_computed_blocks)
        # Hit blocks sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            return None

        # Touch first: a hit still in the free queue must not be handed out again as a new block.
        self.block_pool.touch(new_computed_blocks)
        new_blocks = list(new_computed_blocks) + self.block_pool.get_new_blocks(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        blocks.extend(new_blocks)

        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_new_computed_tokens
            if self.enable_caching and not request.needs_prompt_logprobs:  # it does not look (get_computed_blocks)
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens

        if self.enable_caching:
            update_block_hashes(request, self.block_size)
            num_cached = self.num_cached_blocks.get(request_id, 0) + len(new_computed_blocks)
            # A block completed by a placeholder token cannot be hashed yet; it is registered at the request's
            # next allocation, once the token is known.
            num_full = min(num_total // self.block_size, len(request.block_hashes))
            self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
            self.num_cached_blocks[request_id] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are the first to be evicted.

        Full blocks whose K/V is computed but which could not be hashed when allocated (a token still on
        its way completed them, with asynchronous scheduling) are registered first, so the prefix cache
        keeps them as it keeps every other full block."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        if self.enable_caching and blocks:
            update_block_hashes(request, self.block_size)
            num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request: Request) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request.request_id, [])

    def get_block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self.get_blocks(request)]

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
