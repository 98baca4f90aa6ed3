"""XAttention block-sparse prefill ops (antidiagonal block estimation + block-sparse flash attention).

Public ops (semantics and block geometry in ``reference.py``):
``flat_group_gemm_fuse_reshape``, ``softmax_fuse_block_sum`` (the seed's two estimation stages),
``xattn_estimate`` (fused estimation + block selection), ``block_sparse_attention`` (dense K/V) and
``xattention_paged_prefill`` (``paged_prefill``'s arguments plus threshold/stride/block_size/share_kv_heads/
fp8_estimate), and ``prefill_workspace_bytes``, the memory the engine reserves for the last.

Backend per call, the same choice as every other op in ``pagedllm.ops``: the reference backend runs the
PyTorch references, any other (Triton, CUDA) runs the Triton kernels; ``PAGEDLLM_OPS_BACKEND=triton`` runs
them on CPU tensors too (under ``TRITON_INTERPRET=1``, for tests). Triton is imported only when used.
"""
from __future__ import annotations

from pagedllm import ops as _ops
from pagedllm.ops.xattention import reference

__all__ = ["flat_group_gemm_fuse_reshape", "softmax_fuse_block_sum", "xattn_estimate", "block_sparse_attention",
           "xattention_paged_prefill", "prefill_workspace_bytes", "reference"]


def _use_triton(tensor) -> bool:
    return _ops.get_backend(tensor.device) is not _ops.reference


def flat_group_gemm_fuse_reshape(query_states, key_states, stride, chunk_start, chunk_end, is_causal=True):
    if _use_triton(query_states):
        from pagedllm.ops.xattention.estimate import flat_group_gemm_fuse_reshape as fn
    else:
        fn = reference.flat_group_gemm_fuse_reshape
    return fn(query_states, key_states, stride, chunk_start, chunk_end, is_causal)


def softmax_fuse_block_sum(attn_weights_slice, reshaped_block_size, segment_size, chunk_start, chunk_end,
                           real_q_len, scale, is_causal=True):
    if _use_triton(attn_weights_slice):
        from pagedllm.ops.xattention.estimate import softmax_fuse_block_sum as fn
    else:
        fn = reference.softmax_fuse_block_sum
    return fn(attn_weights_slice, reshaped_block_size, segment_size, chunk_start, chunk_end, real_q_len,
              scale, is_causal)


def xattn_estimate(query, key, block_size=128, stride=8, threshold=0.9, chunk_size=16384, causal=True,
                   share_kv_heads=False, fp8_estimate=False):
    """``(block_mask, density)``; see ``reference.xattn_estimate``."""
    if _use_triton(query):
        from pagedllm.ops.xattention.estimate import xattn_estimate as fn
    else:
        fn = reference.xattn_estimate
    return fn(query, key, block_size, stride, threshold, chunk_size, causal, share_kv_heads, fp8_estimate)


def block_sparse_attention(q, k, v, block_mask, block_size=128, causal=True, scale=None):
    if _use_triton(q):
        from pagedllm.ops.xattention.sparse_attention import block_sparse_attention as fn
    else:
        fn = reference.block_sparse_attention
    return fn(q, k, v, block_mask, block_size, causal, scale)


def xattention_paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                             query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype,
                             k_scale, v_scale, threshold=0.9, stride=8, block_size=128,
                             share_kv_heads=False, fp8_estimate=False) -> None:
    if _use_triton(query):
        from pagedllm.ops.xattention.sparse_attention import xattention_paged_prefill as fn
    else:
        fn = reference.xattention_paged_prefill
    fn(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, query_start_loc,
       max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, threshold, stride,
       block_size, share_kv_heads, fp8_estimate)


def prefill_workspace_bytes(seq_len: int, query_len: int, num_heads: int, num_kv_heads: int, head_size: int,
                            itemsize: int, block_size: int = 128, stride: int = 8) -> int:
    """An upper bound of the memory one GPU ``xattention_paged_prefill`` call holds at once besides its output,
    for a sequence of ``seq_len`` tokens whose last ``query_len`` are new: the sequence's K and V gathered out of
    the cache; the estimate's token-aligned and fp8 copies of Q and K (with a scale per reshaped row); its
    per-row partial sums and tile maxima; and the block sums (twice more shared by kv heads), mask and key-block
    lists."""
    q_blocks, k_blocks = -(-query_len // block_size) + 1, -(-seq_len // block_size) + 1
    tokens = num_heads * query_len + num_kv_heads * seq_len
    copies = 2 * num_kv_heads * seq_len * head_size * itemsize + tokens * (head_size * (itemsize + 1) + 4)
    rows = q_blocks * (block_size // stride) + 256
    partials = num_heads * rows * (k_blocks + 64 + -(-seq_len // (256 * stride))) * 4  # and each tile's row max
    return copies + partials + num_heads * q_blocks * k_blocks * 17
