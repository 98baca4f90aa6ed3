"""Paged attention layer: writes the step's K/V into the cache, then routes decodes and prefills to their ops.

The step's metadata is built once by the model runner and published through `set_forward_context`; every
layer reads the same object, so no layer builds tensors or synchronises with the host.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm import ops
from pagedllm.ops import xattention


@dataclass(frozen=True)
class SparsePrefill:
    """XAttention settings for a step whose prefills are long enough to pay for the estimate."""
    threshold: float
    stride: int
    block_size: int


@dataclass
class AttentionMetadata:
    """Flat description of one step. Decode tokens (one new token per sequence) come first in the batch."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    num_decode_tokens: int
    # Decode part: the first num_decode_tokens tokens, one per sequence.
    decode_block_tables: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    decode_max_seq_len: int
    # Prefill part: the remaining tokens, grouped by sequence.
    prefill_block_tables: torch.Tensor | None
    prefill_seq_lens: torch.Tensor | None
    prefill_query_start_loc: torch.Tensor | None  # [num_prefills + 1], relative to the prefill part
    prefill_max_query_len: int
    prefill_max_seq_len: int
    sparse_prefill: SparsePrefill | None = None


_forward_context: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata):
    global _forward_context
    previous, _forward_context = _forward_context, metadata
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention called outside set_forward_context(): the model runner builds the metadata")
    return _forward_context


class Attention(nn.Module):
    """Takes q [T, H*D], k/v [T, H_kv*D] and returns [T, H*D]. The runner binds the cache to each layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 alibi_slopes: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.alibi_slopes = alibi_slopes
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.kv_cache_dtype = "auto"
        self.k_scale = 1.0
        self.v_scale = 1.0

    def bind_cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor, kv_cache_dtype: str,
                   k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
        self.key_cache, self.value_cache = key_cache, value_cache
        self.block_size = ops.reference.as_vllm_layout(key_cache, value_cache)[1].shape[-1]  # either layout
        self.kv_cache_dtype, self.k_scale, self.v_scale = kv_cache_dtype, k_scale, v_scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        ops.reshape_and_cache(k, v, self.key_cache, self.value_cache, meta.slot_mapping,
                              self.kv_cache_dtype, self.k_scale, self.v_scale)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd > 0:
            ops.paged_attention(out[:nd], q[:nd], self.key_cache, self.value_cache, self.num_kv_heads,
                                self.scale, meta.decode_block_tables, meta.decode_seq_lens, self.block_size,
                                meta.decode_max_seq_len, self.alibi_slopes, self.kv_cache_dtype,
                                self.k_scale, self.v_scale)
        if nd < num_tokens:
            args = (out[nd:], q[nd:], self.key_cache, self.value_cache, self.num_kv_heads, self.scale,
                    meta.prefill_block_tables, meta.prefill_seq_lens, meta.prefill_query_start_loc,
                    meta.prefill_max_query_len, meta.prefill_max_seq_len, self.alibi_slopes,
                    self.kv_cache_dtype, self.k_scale, self.v_scale)
            sparse = meta.sparse_prefill
            if sparse is None:
                ops.paged_prefill(*args)
            else:
                xattention.xattention_paged_prefill(*args, threshold=sparse.threshold, stride=sparse.stride,
                                                    block_size=sparse.block_size)
        return out.view(num_tokens, self.num_heads * self.head_size)
