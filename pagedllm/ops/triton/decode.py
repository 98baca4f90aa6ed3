"""Paged decode attention (one query token per sequence): v1 single pass, v2 split-K over 512-token
partitions plus a reduce, and `paged_attention`, which picks single pass or split-K itself.

One program owns one (sequence, kv head, partition): its query tile holds every query head of the kv
group (padded to 16 rows for tl.dot), so K/V are streamed from memory exactly once per kv head; vLLM's
CUDA kernel re-reads them once per query head. Grid: (num_kv_heads, num_seqs, num_partitions).
"""
import torch
import triton
import triton.language as tl

from pagedllm.ops import reference
from pagedllm.ops.reference import PARTITION_SIZE  # v2 partitions; the v2 workspace shapes depend on it

from . import _host, pdl
from .paged_tile import LN2, LOG2E, attend_range, load_scale

# Split-K choice, from sweeps on the H100 ("hnd" cache, bf16, head 128, tile 64/2 warps; benchmarks/results,
# decode_split_sweep_h100_20261124.log, 68 shapes). From 1.25 (sequence, kv head) programs per SM one pass is
# within 3% of the best split up to 4K tokens and 5-7% under it at 16-32K (24 x 8 pairs at 1K: 2.44 TB/s in one
# pass, 2.18 in two; at 32K 2.80 against 3.01). Below that, splitting up to 4 programs per SM pays, and not past
# it (16 x 4K: 2.74 with 4 x 1024 tokens; 5 x 832, a second wave, was 12% slower). Partitions have a floor that
# grows with the work (programs x context, in head-tokens; one token of floor per 512) up to 512 tokens: shorter
# ones lose more to their fixed cost and the reduce than they gain (1 x 32K: 2.31 with 512, 1.86 with 256), a
# 1024-token floor kept 8 x 4K / 4 x 8K / 2 x 16K at 2.25-2.31 where 512 gives 2.45-2.51, and small decodes want
# them short (8 x 1K: 2.46 with 128 tokens, 1.81 with 256; 1 x 1K: 9 us with 128, 22 us in one pass). Against one
# token per 256 (decode_split_floor_h100_20261124.log), 17 of the 24 shapes whose plan changed got 7-36% faster
# and 4 lost 2-4% (1 x 8-16K, 3 x 8K, 6 x 4K); the engine's batch-8 step at 1K context 1.655 -> 1.524 ms.
_SINGLE_PASS_PROGRAMS_PER_SM = 1.25
_TARGET_PROGRAMS_PER_SM = 4
_SPLIT_FLOOR_TOKENS = (128, 512)
_SPLIT_FLOOR_WORK = 512  # head-tokens of work per token of floor


# The block table's row stride is its width, which changes from step to step in eager mode; specialising on
# it (== 1, divisible by 16) would compile new variants mid-run (seconds each) for no gain.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    out, part_max, part_sum, part_out,
    query, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, k_scale, v_scale, scale, part_tokens,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_ms, stride_mh,  # part_max / part_sum [seqs, heads, parts]
    stride_ts, stride_th, stride_tp,  # part_out [seqs, heads, parts, head_size]
    stride_bt, stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
    tp_rank, num_heads, num_kv_heads, sparse_local, sparse_vert, sparse_block, sparse_step,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_PTR: tl.constexpr, ALIBI: tl.constexpr, SPARSE: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        pdl.gdc_wait()
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    if SPLIT:
        start = part * part_tokens
        if start >= seq_len:
            return  # the reduce only reads the partitions this sequence has
        end = tl.minimum(start + part_tokens, seq_len)
    else:
        start = 0
        end = seq_len

    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    q = tl.load(query + seq * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # Padding rows see no key (q_pos -1), so they never widen the set of block-sparse pages loaded.
    q_pos = tl.where(row_ok, seq_len - 1, -1)

    qk_scale = scale * LOG2E
    out_scale = 1.0
    if FP8 != 0:
        qk_scale = qk_scale * load_scale(k_scale, SCALE_PTR)
        out_scale = load_scale(v_scale, SCALE_PTR)
    alibi = tl.zeros([GROUP_PAD], tl.float32)
    if ALIBI:
        alibi = tl.load(alibi_slopes + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    sparse_off = tl.zeros([GROUP_PAD], tl.int32)
    sparse_q_block = 0
    if SPARSE:
        sparse_q_block = (seq_len - 1) // sparse_block
        if sparse_step >= 0:  # sliding over query heads
            sparse_off = (tp_rank * num_heads + head) * sparse_step + 1
        else:  # sliding over kv heads
            sparse_off += (tp_rank * num_kv_heads + kv_head) * (-sparse_step) + 1

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    block_table = block_tables + seq * stride_bt
    # Whole tiles before the ragged end need no masking (sparse tiles always do).
    masked_from = start + (end - start) // BLOCK_N * BLOCK_N
    if SPARSE:
        masked_from = start
    m_i, l_i, acc = attend_range(
        q, m_i, l_i, acc, start, masked_from, end, seq_len, q_pos, alibi, qk_scale,
        k_cache, v_cache, block_table, kv_head,
        stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
        sparse_off, sparse_q_block, sparse_local, sparse_vert, sparse_block,
        HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, X, LAYOUT, FP8, SPARSE, ALIBI, DOT_PREC)
    # The next kernel launches only once every program is past its K/V stream: with its programs resident and
    # waiting from this kernel's start (pdl.start), 1 x 32K ran at 2.13 TB/s instead of 2.31 on the H100.
    if PDL:
        pdl.gdc_launch_dependents()

    o = acc * (out_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        o_ptr = part_out + seq * stride_ts + head[:, None] * stride_th + part * stride_tp + offs_d[None, :]
        tl.store(o_ptr, o.to(part_out.dtype.element_ty), mask=mask)
        stat = seq * stride_ms + head * stride_mh + part
        tl.store(part_max + stat, m_i * LN2, mask=row_ok)  # natural-log units, as vLLM's max_logits
        tl.store(part_sum + stat, l_i, mask=row_ok)
    else:
        o_ptr = out + seq * stride_os + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, o.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(
    out, part_max, part_sum, part_out, seq_lens, part_tokens,
    stride_os, stride_oh, stride_ms, stride_mh, stride_ts, stride_th, stride_tp,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    """Merge the partition results of one (head, sequence): out = sum_p w_p o_p / sum_p w_p,
    w_p = exp_sum_p * exp(max_p - max). Chunked so any number of partitions fits in registers."""
    pdl.start(PDL)
    head = tl.program_id(0)
    seq = tl.program_id(1)
    num_parts = tl.cdiv(tl.load(seq_lens + seq), part_tokens)
    stats = seq * stride_ms + head * stride_mh
    offs_p = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE

    m = tl.full([], float("-inf"), tl.float32)
    for p0 in range(0, num_parts, CHUNK):
        mp = tl.load(part_max + stats + p0 + offs_p, mask=p0 + offs_p < num_parts, other=float("-inf"))
        m = tl.maximum(m, tl.max(mp, axis=0))
    m_ref = tl.where(m == float("-inf"), 0.0, m)  # no attended token at all: every weight is 0
    acc = tl.zeros([HEAD_PAD], tl.float32)
    den = tl.zeros([], tl.float32)
    for p0 in range(0, num_parts, CHUNK):
        p_ok = p0 + offs_p < num_parts
        mp = tl.load(part_max + stats + p0 + offs_p, mask=p_ok, other=float("-inf"))
        w = tl.load(part_sum + stats + p0 + offs_p, mask=p_ok, other=0.0) * tl.exp(mp - m_ref)
        o_ptr = part_out + seq * stride_ts + head * stride_th + (p0 + offs_p)[:, None] * stride_tp + offs_d[None, :]
        o = tl.load(o_ptr, mask=p_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w[:, None] * o, axis=0)
        den += tl.sum(w, axis=0)
    o = acc / tl.where(den == 0.0, 1.0, den)
    tl.store(out + seq * stride_os + head * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=d_ok)


def _config(query: torch.Tensor, head_pad: int, block_size: int):
    """(BLOCK_N, num_warps, num_stages). On CPU (interpreter) small tiles exercise multi-tile paths.
    GPU: the best tile of benchmarks/triton_tuning.py on nine of the ten H100 shapes at head 128."""
    if not query.is_cuda:
        return max(16, block_size), 4, 1
    if head_pad <= 128:
        return max(64, block_size), 2, 3
    return max(32, block_size), 4, 3


def _launch(out, partials, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
            block_size, alibi_slopes, kv_cache_dtype, k_scale, v_scale, num_parts, part_tokens, block_n,
            num_warps, num_stages, tp_rank=0, sparse_local=0, sparse_vert=0, sparse_block=64, sparse_step=0):
    # the kernels index with these shapes unchecked: a wrong one would read or write out of bounds
    reference.check_attention_args(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                                   block_size, alibi_slopes, kv_cache_dtype, query.shape[0])
    split = partials is not None
    part_max, part_sum, part_out = partials if split else (out, out, out)
    if split and reference.check_split_workspace(part_sum, part_max, part_out, query) < num_parts:
        raise ValueError(f"{num_parts} partitions of {part_tokens} tokens are needed (max_seq_len), the workspace "
                         f"(tmp_out) holds {part_out.shape[2]}")
    layout, block_size, x = _host.cache_layout(key_cache, value_cache)
    num_seqs, num_heads, head_size = query.shape
    group = num_heads // num_kv_heads
    k_scale, v_scale, scale_ptr = _host.scale_args(k_scale, v_scale)
    ms = part_max.stride() if split else (0, 0, 0)
    ts = part_out.stride() if split else (0, 0, 0, 0)
    grid = (num_kv_heads, num_seqs, num_parts)
    dependent = pdl.options(query)
    _decode_kernel[grid](
        out, part_max, part_sum, part_out,
        query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, k_scale, v_scale, scale,
        part_tokens,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        ms[0], ms[1], ts[0], ts[1], ts[2],
        block_tables.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        tp_rank, num_heads, num_kv_heads, sparse_local, sparse_vert, sparse_block, sparse_step,
        GROUP=group, GROUP_PAD=_host.pow2_at_least(group, 16), HEAD_SIZE=head_size,
        HEAD_PAD=_host.pow2_at_least(head_size, 16), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        X=x, LAYOUT=layout, FP8=_host.fp8_kind(kv_cache_dtype), SCALE_PTR=scale_ptr,
        ALIBI=alibi_slopes is not None, SPARSE=sparse_vert > 1, SPLIT=split,
        DOT_PREC=_host.dot_precision(query.dtype), num_warps=num_warps, num_stages=num_stages,
        **dependent,
    )
    if split:
        _reduce_kernel[(num_heads, num_seqs)](
            out, part_max, part_sum, part_out, seq_lens, part_tokens,
            out.stride(0), out.stride(1), ms[0], ms[1], ts[0], ts[1], ts[2],
            HEAD_SIZE=head_size, HEAD_PAD=_host.pow2_at_least(head_size, 16), CHUNK=16, num_warps=4,
            **dependent,
        )


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank=0,
                       blocksparse_local_blocks=0, blocksparse_vert_stride=0, blocksparse_block_size=64,
                       blocksparse_head_sliding_step=0):
    block_n, warps, stages = _config(query, triton.next_power_of_2(query.shape[-1]), block_size)
    _launch(out, None, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
            alibi_slopes, kv_cache_dtype, k_scale, v_scale, 1, 0, block_n, warps, stages, tp_rank,
            blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
            blocksparse_head_sliding_step)


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
                       block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
                       v_scale, tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0):
    block_n, warps, stages = _config(query, triton.next_power_of_2(query.shape[-1]), block_size)
    block_n = min(block_n, PARTITION_SIZE)
    _launch(out, (max_logits, exp_sums, tmp_out), query, key_cache, value_cache, num_kv_heads, scale,
            block_tables, seq_lens, block_size, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
            triton.cdiv(max_seq_len, PARTITION_SIZE), PARTITION_SIZE, block_n, warps, stages, tp_rank,
            blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
            blocksparse_head_sliding_step)


def split_plan(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int):
    """(num_partitions, partition_tokens) for `paged_attention`. Split-K only when (sequence, kv head)
    programs alone cannot fill the GPU; partitions are whole tiles, no shorter than the floor above."""
    programs = num_seqs * num_kv_heads
    tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    if programs >= _SINGLE_PASS_PROGRAMS_PER_SM * num_sms:
        return 1, tiles * block_n
    want = max(1, _TARGET_PROGRAMS_PER_SM * num_sms // programs)
    low, high = _SPLIT_FLOOR_TOKENS
    floor = min(max(programs * max_seq_len // _SPLIT_FLOOR_WORK, low), high)
    parts = max(1, min(want, tiles // triton.cdiv(floor, block_n)))
    part_tokens = triton.cdiv(tiles, parts) * block_n
    return triton.cdiv(max(max_seq_len, 1), part_tokens), part_tokens


def paged_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                    block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale):
    if query.dim() != 3:  # the split plan reads its shape before _launch checks the rest
        raise ValueError(f"query must be [num_seqs, num_heads, head_size], got {tuple(query.shape)}")
    num_seqs, num_heads, head_size = query.shape
    block_n, warps, stages = _config(query, triton.next_power_of_2(head_size), block_size)
    parts, part_tokens = split_plan(num_seqs, num_kv_heads, max_seq_len, block_n, _host.num_sms(query.device))
    partials = None
    if parts > 1:
        # fp32 workspace: partial outputs are merged with weights, keep them at full precision.
        stats = torch.empty((2, num_seqs, num_heads, parts), dtype=torch.float32, device=query.device)
        tmp = torch.empty((num_seqs, num_heads, parts, head_size), dtype=torch.float32, device=query.device)
        partials = (stats[0], stats[1], tmp)
    _launch(out, partials, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
            block_size, alibi_slopes, kv_cache_dtype, k_scale, v_scale, parts, part_tokens, block_n, warps,
            stages)
