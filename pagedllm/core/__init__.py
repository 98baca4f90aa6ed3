"""KV cache bookkeeping: block pool, prefix-cache hashing and the per-request KV cache manager."""
from pagedllm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedllm.core.hashing import hash_block_tokens, update_block_hashes
from pagedllm.core.kv_cache_manager import KVCacheManager

__all__ = ["BlockPool", "FreeBlockQueue", "KVCacheBlock", "KVCacheManager", "hash_block_tokens",
           "update_block_hashes"]
