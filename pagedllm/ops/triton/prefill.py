"""Paged prefill attention: a varlen batch of new tokens attends causally to its sequence's cache
(prefix-cache hits, chunked prefill and plain prefill are the same case: the new tokens of sequence i sit
at positions seq_len - q_len .. seq_len - 1 and are already in the cache).

Flash-attention style. A program owns BLOCK_M rows = TOKENS consecutive query tokens x the GROUP query
heads of one kv head (row r is token r // GROUP, head r % GROUP), so each K/V tile fetched through the
block table feeds every query head of its group. Grid: (num_kv_heads, num_seqs, query tiles), tiles
issued last-first so the long causal rows start early and the tail of the launch is short work.
"""
import torch
import triton
import triton.language as tl

from pagedllm.ops import reference

from . import _host
from .paged_tile import LOG2E, attend_range, load_scale


@triton.jit(do_not_specialize=["stride_bt"])  # the table's width changes per step (see decode.py)
def _prefill_kernel(
    out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, alibi_slopes, k_scale, v_scale,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_bt, stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, X: tl.constexpr,
    LAYOUT: tl.constexpr, FP8: tl.constexpr, SCALE_PTR: tl.constexpr, ALIBI: tl.constexpr, DOT_PREC: tl.constexpr,
):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    tile = tl.cdiv(q_len, TOKENS) - 1 - tl.program_id(2)
    if tile < 0:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # tokens already cached before this batch's new tokens

    rows = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS + rows // GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
    head = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(query + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    q_pos = context + tok

    qk_scale = scale * LOG2E
    out_scale = 1.0
    if FP8 != 0:
        qk_scale = qk_scale * load_scale(k_scale, SCALE_PTR)
        out_scale = load_scale(v_scale, SCALE_PTR)
    alibi = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI:
        alibi = tl.load(alibi_slopes + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    no_sparse = tl.zeros([BLOCK_M], tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    block_table = block_tables + seq * stride_bt
    first_pos = context + tile * TOKENS
    end = tl.minimum(seq_len, context + tl.minimum((tile + 1) * TOKENS, q_len))
    # Keys at or before the tile's first query are visible to every row: those tiles skip masking.
    masked_from = (first_pos + 1) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = attend_range(
        q, m_i, l_i, acc, 0, masked_from, end, seq_len, q_pos, alibi, qk_scale,
        k_cache, v_cache, block_table, kv_head,
        stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
        no_sparse, 0, 0, 1, 1,
        HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, X, LAYOUT, FP8, False, ALIBI, DOT_PREC)

    o = acc * (out_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    tl.store(out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out.dtype.element_ty), mask=io_mask)


def _config(query: torch.Tensor, head_pad: int, group: int, block_size: int, max_seq_len: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); on CPU (interpreter) small tiles exercise the masking."""
    if not query.is_cuda:
        block_m, block_n, warps, stages = 16, 16, 4, 1
    elif head_pad <= 128 and max_seq_len <= 1024:
        # Short sequences (the throughput workload's prompts) waste less of a smaller tile on the causal
        # diagonal and the last rows: 8192 new tokens of 100-1024-token prompts run at 205 TFLOP/s against 160
        # with the tile below (H100, Qwen3-0.6B heads; benchmarks/triton_tuning.py --workload). For 1000-4000
        # tokens the two were within 3% in two draws, each winning one, and at 16K the tile below is the
        # swept optimum: the switch stays where the gain was measured.
        block_m, block_n, warps, stages = 64, 32, 4, 3
    elif head_pad <= 128:
        # Best of benchmarks/triton_tuning.py on the H100 at 16K ("hnd" cache). With 4 warps the 128 x 128
        # tile spilled registers (ncu: 255 per thread plus local-memory traffic). fp32 queries (tests,
        # debugging) halve BLOCK_N: three stages of 128-key fp32 K/V tiles exceed shared memory.
        block_m, block_n, warps, stages = 128, 256 // query.element_size(), 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    return max(block_m, triton.next_power_of_2(group)), max(block_n, block_size), warps, stages


def paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                  query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                  config=None):
    """``config``: (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of `_config`'s (for sweeps)."""
    # the kernel indexes with these shapes unchecked: a wrong one would read or write out of bounds
    reference.check_prefill_shapes(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                                   query_start_loc, alibi_slopes, kv_cache_dtype)
    layout, block_size, x = _host.cache_layout(key_cache, value_cache)
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    head_pad = _host.pow2_at_least(head_size, 16)
    block_m, block_n, warps, stages = config or _config(query, head_pad, group, block_size, max_seq_len)
    tokens = block_m // group
    k_scale, v_scale, scale_ptr = _host.scale_args(k_scale, v_scale)
    grid = (num_kv_heads, num_seqs, triton.cdiv(max_query_len, tokens))
    _prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, alibi_slopes, k_scale,
        v_scale, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        GROUP=group, TOKENS=tokens, BLOCK_M=block_m, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, X=x, LAYOUT=layout, FP8=_host.fp8_kind(kv_cache_dtype),
        SCALE_PTR=scale_ptr, ALIBI=alibi_slopes is not None, DOT_PREC=_host.dot_precision(query.dtype),
        num_warps=warps, num_stages=stages,
    )
