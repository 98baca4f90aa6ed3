"""Paged attention layer: writes the step's K/V into the cache (rotating q and k first when given a Rope),
then routes decodes and prefills to their ops.

The step's metadata is built once by the model runner and published through `set_forward_context`; every
layer reads the same object, so no layer builds tensors or synchronises with the host.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm import ops
from pagedllm.layers.norm import RMSNorm, fused_kernels
from pagedllm.layers.rotary import RotaryEmbedding, qk_norm_args
from pagedllm.ops import xattention

if TYPE_CHECKING:
    from pagedllm.worker.cuda_graph import PiecewiseGraphs


@dataclass(frozen=True)
class SparsePrefill:
    """XAttention settings for a step whose prefills are long enough to pay for the estimate."""
    threshold: float
    stride: int
    block_size: int
    share_kv_heads: bool = False  # one selection per kv head (ops.xattention.reference.kv_head_sums)
    fp8_estimate: bool = False  # fp8 Q and K in the estimate (ops.xattention.reference.fp8_rows)


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
    # A decode row reads a KV block that another row writes in this step: a prefix-cache hit, by a request scheduled
    # later in the step, on the block an earlier one's token completes (KVCacheManager registers a block when the
    # step that fills it is scheduled). Kernels that read a row's cached keys before the step's writes land (the
    # fused decoder-layer kernel, models/fused_decode.py) must leave such a step to the layers.
    decode_rows_share_blocks: bool = False
    # Set while piecewise CUDA graphs are captured (worker/cuda_graph.py): each layer rotates its q into
    # graph_split.q, then graph_split.split(layer) ends the graph there and returns where the attention
    # output will be.
    graph_split: PiecewiseGraphs | None = None


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


@dataclass
class Rope:
    """The rotary embedding Attention applies to q and k (after Qwen3's per-head norms, when given)."""
    positions: torch.Tensor
    rotary: RotaryEmbedding
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None


class Attention(nn.Module):
    """Takes q [T, H*D], k/v [T, H_kv*D] and returns [T, H*D]. The runner binds the cache to each layer.

    With a Rope and the fused kernels (CUDA), one kernel rotates q in place and writes the rotated k and v
    into the cache: the separate cache write and its second pass over k and v are gone (~2 us a layer at
    decode sizes on the H100, and one of the few Triton launches an eager prefill step pays per layer).
    """

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """rope: rotate q and k first. The fused kernels rotate q in place: pass a q whose old values are
        not needed."""
        meta = get_forward_context()
        split = meta.graph_split
        q = self.store(meta, q, k, v, rope, None if split is None else split.q[:q.shape[0]])
        if split is not None:
            return split.split(self)
        out = torch.empty_like(q)
        self.attend(meta, q, out)
        return out.view(q.shape[0], self.num_heads * self.head_size)

    def store(self, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rope: Rope | None, q_out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotates q and k when given a Rope, writes k and v into the cache; returns q as [T, H, D], in q_out
        when given."""
        num_tokens = q.shape[0]
        kernels = fused_kernels(q) if rope is not None else None
        if kernels is not None:
            kernels.rope_and_cache(rope.positions, q, k, v, self.head_size, rope.rotary.cos_sin_cache,
                                   qk_norm_args(rope.qk_norm), self.key_cache, self.value_cache,
                                   meta.slot_mapping, self.kv_cache_dtype, self.k_scale, self.v_scale, q_out)
            q = q if q_out is None else q_out
        else:
            if rope is not None:
                q, k = rope.rotary(rope.positions, q, k, rope.qk_norm)
            ops.reshape_and_cache(k.view(num_tokens, self.num_kv_heads, self.head_size),
                                  v.view(num_tokens, self.num_kv_heads, self.head_size), self.key_cache,
                                  self.value_cache, meta.slot_mapping, self.kv_cache_dtype, self.k_scale,
                                  self.v_scale)
            if q_out is not None:
                q = q_out.copy_(q.view(q_out.shape))
        return q.view(num_tokens, self.num_heads, self.head_size)

    def attend(self, meta: AttentionMetadata, q: torch.Tensor, out: torch.Tensor) -> None:
        """out[T, H, D] = attention of q [T, H, D] over the cache, decodes and prefills as meta says."""
        nd, num_tokens = meta.num_decode_tokens, q.shape[0]
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
                                                    block_size=sparse.block_size,
                                                    share_kv_heads=sparse.share_kv_heads,
                                                    fp8_estimate=sparse.fp8_estimate)
