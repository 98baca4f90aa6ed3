"""Physical KV cache blocks: reference counts, the free LRU queue and the prefix-cache hash map."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from pagedllm.core.hashing import BlockHash


class KVCacheBlock:
    """Bookkeeping for one block of KV slots; the tensors live in the model runner."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block holds the KV of a full block known to the prefix cache. It survives the block
        # being freed, so a later request can still hit it until the block is handed out again.
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks in eviction order (head first), as an intrusive doubly linked list.

    A deque cannot drop a block from the middle in O(1), and a prefix-cache hit on a free block must do
    exactly that; links stored in the blocks themselves make popleft, append and remove all O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels at both ends remove every empty-list and end-of-list special case.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def popleft(self) -> KVCacheBlock:
        if self._len == 0:
            raise ValueError("no free blocks left to pop")
        block = self._head.next_free
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_before(self._tail, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_before(self._head.next_free, block)

    def _insert_before(self, successor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        predecessor = successor.prev_free
        predecessor.next_free = block
        block.prev_free = predecessor
        block.next_free = successor
        successor.prev_free = block
        self._len += 1


class BlockPool:
    """Owns every block: hands out free ones, takes them back, and indexes full blocks by hash.

    A block with ref_cnt 0 is always in the free queue, whether or not it still holds cached KV. Cached free
    blocks are evicted lazily: their hash map entry is dropped only when the block is handed out again.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests; cached free blocks count as free (they are evictable)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.ref_cnt != 0:
                raise ValueError(f"free queue held block {block.block_id} with ref_cnt {block.ref_cnt}")
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (the first freed is evicted first).

        Blocks without a hash hold nothing reusable, so they go to the head of the queue and are reused
        before any cached block; cached blocks go to the tail (most recently used).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id} (ref_cnt {block.ref_cnt})")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] of one request under their hashes."""
        if not self.enable_caching:
            return
        if num_full_blocks > min(len(blocks), len(block_hashes)):
            raise ValueError(f"cannot cache {num_full_blocks} full blocks: the request has {len(blocks)} "
                             f"blocks and {len(block_hashes)} block hashes")
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None:
                raise ValueError(f"block {block.block_id} is already cached")
            # Two requests can compute the same block when neither could hit the other's copy in time;
            # the first copy stays the shared one and this duplicate simply stays private.
            if block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after new weights make the cached KV stale)."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
