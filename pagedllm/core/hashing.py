"""Block hashes for the prefix cache: a hash chain over the full blocks of a token sequence.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole prefixes,
not merely equal blocks. xxh3_128 gives 128-bit digests: with at most millions of live cached blocks the
birthday bound puts the chance of any collision below 1e-26, so a hash hit is trusted without comparing
tokens.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from pagedllm.engine.request import Request

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given the hash of the block before it (None for the first block)."""
    h = xxhash.xxh3_128()
    # Every chained block carries a 16-byte parent and the first block none; all blocks have the same
    # token count, so the two kinds of input never have the same length and cannot collide structurally.
    if parent_hash is not None:
        h.update(parent_hash)
    # Token ids are vocabulary indices, well below 2**32: four bytes each is exact and compact.
    h.update(array("I", token_ids).tobytes())
    return h.digest()


def update_block_hashes(request: Request, block_size: int) -> None:
    """Append to request.block_hashes the hashes of blocks that became full since the last call.

    Only new full blocks are hashed, so calling this every step costs O(new tokens).
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
