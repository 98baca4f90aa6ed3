"""Triton block-sparse flash attention over the (query block, key block) pairs XAttention selected.

One program owns BLOCK_M query rows of one query block and one query head; it walks only the key blocks
listed for that (block, head), in ascending order, with an online softmax in the exp2 domain and both
GEMMs on tensor cores. Every listed block but the last lies wholly before the query block (or, without
causality, before the last key block), so only the last one pays for masking. K/V are dense
``[B, H_kv, L, D]`` tensors read through TMA descriptors (out-of-range rows and head columns arrive as
zeros); query heads index their kv head, so GQA never copies K/V. The paged prefill first gathers each
sequence's context out of the cache (the estimate needs its K token-major anyway): through the block table
the same kernel ran ~1.5x slower (results README).

A small kernel first turns each mask row into its list of visible selected key blocks. Query blocks are
handed out heaviest (latest block) first, so the long causal rows start early. The grid runs one kv head
after another (its query heads side by side), so the blocks the running programs read are one kv head's and
come from the L2 after their first read.

With the CUDA ops backend (``PAGEDLLM_OPS_BACKEND=cuda``) on Hopper, bf16 with head 128 and 128-token blocks run
a CUDA twin of this kernel on the same lists (``csrc/sparse_attention.cu``: a TMA producer warp, wgmma, and
FA3's overlap of one tile's softmax with the next tile's MMAs; on the H100 at 64K-128K and 5-20% density 14-19%
less time than this kernel, in two visits: results README).
"""
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedllm import ops
from pagedllm.ops.triton.cache import gather_cache

from . import reference as ref
from .estimate import _dot_precision, _head_pad, _pow2, _tma_operand, xattn_estimate

NEG_INF = tl.constexpr(float("-inf"))
# Query rows x keys per tile and launch shape (capped by the sparse block size). On the H100 at 64K (32/8
# heads, head 128), at 11% / 100% density: 128 x 64 with 4 warps and 2 stages 373 / 527 TFLOP/s, 128 x 128
# with 8 warps 335 / 454 (results README). The interpreter (CPU tests) uses small tiles so small test shapes
# still cover several tiles per block.
GPU_CONFIG = dict(block_m=128, block_n=64, num_warps=4, num_stages=2)
CPU_CONFIG = dict(block_m=64, block_n=32, num_warps=4, num_stages=1)


@triton.jit
def _attend(q, m_i, l_i, acc, start, q0, seq, seq_len, K, V, kvh, qk_scale, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
            HEAD_PAD: tl.constexpr):
    """One BLOCK_N key tile of the online softmax for query rows q0.. (m_i in log2 units, s left unscaled).
    m_i starts at a finite -1e30 rather than -inf, so a row that sees nothing yet needs no guard. V is
    loaded after the softmax, so the K and V tiles are never live together (15% faster at 64K, 11% density)."""
    k = K.load([seq, kvh, start, 0]).reshape(BLOCK_N, HEAD_PAD).T
    s = tl.dot(q, k, input_precision=DOT_PREC)
    if MASKED:
        offs_n = start + tl.arange(0, BLOCK_N)
        ok = (offs_n < seq_len)[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= (q0 + tl.arange(0, BLOCK_M))[:, None])
        s = tl.where(ok, s, NEG_INF)
    # The scale is positive (checked on the host), so it commutes with the max and folds into one FMA before
    # the exp2 instead of a multiply of the whole tile.
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = V.load([seq, kvh, start, 0]).reshape(BLOCK_N, HEAD_PAD)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


# Strides that follow each batch's mask shape: not specialised on, so a new batch does not compile a new
# variant. Positions are int32 and per-row values are recomputed after the loops rather than kept live across
# them: the kernel sits at the 255-register limit (a live int64 row index once made it spill).
@triton.jit(do_not_specialize=["q_blocks", "q_start", "seq_len", "stride_ob", "stride_ip", "stride_ih", "stride_iq",
                               "stride_cp", "stride_ch"])
def _sparse_attn_kernel(
    Q, O, K, V, KV_IDX, KV_CNT, stride_ob, stride_ot, stride_oh, stride_ip, stride_ih, stride_iq, stride_cp,
    stride_ch, H, GROUP, num_p, q_blocks, q_start, seq_len, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # kv head slowest, its query heads fastest: the programs running at once read one kv head's K/V (32 MB at
    # 64K tokens), which the L2 then holds for every query block that selects a block of it
    per_kv = tl.num_programs(0) // H * GROUP
    kvh = tl.program_id(0) // per_kv
    tile = tl.program_id(0) % per_kv // GROUP
    h = kvh * GROUP + tl.program_id(0) % GROUP
    M_TILES: tl.constexpr = BLOCK_SIZE // BLOCK_M
    item = tile // M_TILES
    p = item % num_p  # the batch entry; its query blocks run heaviest (latest) first
    j = q_blocks - 1 - item // num_p
    q0 = (q_start // BLOCK_SIZE + j) * BLOCK_SIZE + (tile % M_TILES) * BLOCK_M  # first query row's position
    # Q through its descriptor: it stays in shared memory for the tensor cores instead of ~50 registers.
    q = Q.load([p, h, q0 - q_start, 0]).reshape(BLOCK_M, HEAD_PAD)

    idx = KV_IDX + p.to(tl.int64) * stride_ip + h * stride_ih + j.to(tl.int64) * stride_iq
    count = tl.load(KV_CNT + p * stride_cp + h * stride_ch + j)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # Wholly visible blocks, no masks: one flat loop over their tiles so loads stream across blocks.
    N_TILES: tl.constexpr = BLOCK_SIZE // BLOCK_N
    for it in range(0, (count - 1) * N_TILES):
        start = tl.load(idx + it // N_TILES) * BLOCK_SIZE + (it % N_TILES) * BLOCK_N
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, start, q0, p, seq_len, K, V, kvh, qk_scale, BLOCK_M,
                                BLOCK_N, False, CAUSAL, DOT_PREC, HEAD_PAD)
    if count > 0:  # the last listed block: diagonal and/or ragged end
        kb_start = tl.load(idx + count - 1) * BLOCK_SIZE
        end = kb_start + BLOCK_SIZE
        if CAUSAL:
            end = tl.minimum(end, q0 + BLOCK_M)
        for n in range(kb_start, end, BLOCK_N):
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, n, q0, p, seq_len, K, V, kvh, qk_scale, BLOCK_M,
                                    BLOCK_N, True, CAUSAL, DOT_PREC, HEAD_PAD)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    q_pos = q0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD
    rows = p.to(tl.int64) * stride_ob + (q_pos - q_start).to(tl.int64) * stride_ot
    tl.store(O + rows[:, None] + h * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=((q_pos >= q_start) & (q_pos < seq_len))[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["first"])
def _compact_kernel(MASK, IDX, CNT, stride_mp, stride_mh, stride_mq, stride_ip, stride_ih, stride_iq, stride_cp,
                    stride_ch, H, first, k_blocks, KB_PAD: tl.constexpr, CAUSAL: tl.constexpr):
    """One mask row -> its visible selected key blocks, ascending, and their count."""
    j, ph = tl.program_id(0), tl.program_id(1)
    p, h = ph // H, ph % H
    kb = tl.arange(0, KB_PAD)
    ok = kb < k_blocks
    if CAUSAL:
        ok = ok & (kb <= first + j)  # past the diagonal: dropped, the attention kernel masks only the last block
    keep = tl.load(MASK + p * stride_mp + h * stride_mh + j * stride_mq + kb, mask=ok, other=0) != 0
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(IDX + p * stride_ip + h * stride_ih + j * stride_iq + pos, kb, mask=keep)
    tl.store(CNT + p * stride_cp + h * stride_ch + j, tl.sum(keep.to(tl.int32), axis=0))


def _launch(out, query, k, v, masks, o_strides, group, scale, block_size, causal):
    """Run the sparse kernel. ``query`` is ``[batch, heads, q_len, D]`` (any strides TMA accepts), ``k`` / ``v``
    ``[batch, kv heads, k_len, D]``, the queries being the last q_len of the k_len positions; ``masks`` is bool
    [batch, heads, q_blocks, k_blocks]. ``out`` is written at batch x o_strides[0] + row x o_strides[1] + head x
    o_strides[2]. Everything the kernels need follows from these shapes, so a call copies nothing from the host
    (at 128K tokens the plan's host tensors and their copies had cost ~1 ms before the GPU started)."""
    if not scale > 0:
        raise ValueError(f"scale must be positive (the kernel applies it after the row max), got {scale!r}")
    num_p, num_heads, q_blocks, k_blocks = masks.shape
    q_start, seq_len = k.shape[2] - query.shape[2], k.shape[2]
    dev = query.device
    idx = torch.empty(num_p, num_heads, q_blocks, k_blocks, dtype=torch.int32, device=dev)
    count = torch.empty(num_p, num_heads, q_blocks, dtype=torch.int32, device=dev)
    m8 = masks.view(torch.int8)
    _compact_kernel[(q_blocks, num_p * num_heads)](
        m8, idx, count, *m8.stride()[:3], *idx.stride()[:3], *count.stride()[:2], num_heads, q_start // block_size,
        k_blocks, KB_PAD=_pow2(k_blocks), CAUSAL=causal)
    backend = ops.get_backend(dev)
    if query.is_cuda and hasattr(backend, "xattn_sparse_attention") and backend.xattn_sparse_supported(
            query, k, block_size):
        backend.xattn_sparse_attention(out, _tma_operand(query), _tma_operand(k), _tma_operand(v), idx, count,
                                       *o_strides, group, scale * ref.LOG2E, causal)
        return
    d = query.shape[-1]
    cfg = GPU_CONFIG if query.is_cuda else CPU_CONFIG
    block_m, block_n = min(cfg["block_m"], block_size), min(cfg["block_n"], block_size)
    # unit box dimensions lead: the loaded tile then reshapes to 2-D without a trip through registers
    q_desc = TensorDescriptor.from_tensor(_tma_operand(query), [1, 1, block_m, _head_pad(d)])
    k_desc, v_desc = (TensorDescriptor.from_tensor(_tma_operand(x), [1, 1, block_n, _head_pad(d)]) for x in (k, v))
    grid = (num_p * q_blocks * (block_size // block_m) * num_heads,)
    _sparse_attn_kernel[grid](
        q_desc, out, k_desc, v_desc, idx, count, *o_strides, *idx.stride()[:3], *count.stride()[:2], num_heads,
        group, num_p, q_blocks, q_start, seq_len, scale * ref.LOG2E, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD=d, HEAD_PAD=_head_pad(d), CAUSAL=causal, DOT_PREC=_dot_precision(query.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _check_block_size(block_size):
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}")


def block_sparse_attention(q, k, v, block_mask, block_size=128, causal=True, scale=None):
    b, h, hkv, q_len, k_len, d = ref.check_qkv(q, k, v)
    _check_block_size(block_size)
    ref.check_mask(block_mask, b, h, q_len, k_len, block_size)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    _launch(out, q, k, v, block_mask, (out.stride(0), out.stride(2), out.stride(1)), h // hkv, scale, block_size,
            causal)
    return out


def xattention_paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                             query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype,
                             k_scale, v_scale, threshold=0.9, stride=8, block_size=128, share_kv_heads=False,
                             fp8_estimate=False):
    plan = ref.prefill_plan(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                            query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype)
    _check_block_size(block_size)
    dense = isinstance(threshold, (int, float)) and threshold >= 1.0  # nothing to estimate
    # One sequence at a time, so the memory held is one context's: its K and V gathered out of the cache
    # (dequantized), which the estimate needs token-major anyway and the kernel then reads by TMA.
    for seq, q0, q_len, seq_len in plan:
        k = torch.empty(1, num_kv_heads, seq_len, query.shape[-1], dtype=query.dtype, device=query.device)
        v = torch.empty_like(k)
        gather_cache(key_cache, value_cache, block_tables[seq], seq_len, k[0], v[0], kv_cache_dtype, k_scale,
                     v_scale)
        q = query[q0:q0 + q_len].transpose(0, 1)[None]  # [1, H, q_len, D] view
        if dense:
            _, q_blocks, k_blocks = ref.block_layout(q_len, seq_len, block_size)
            mask = torch.ones(1, query.shape[1], q_blocks, k_blocks, dtype=torch.bool, device=query.device)
        else:
            mask = xattn_estimate(q, k, block_size, stride, threshold, share_kv_heads=share_kv_heads,
                                  fp8_estimate=fp8_estimate)[0]
        _launch(out[q0:q0 + q_len], q, k, v, mask, (0, out.stride(0), out.stride(1)), query.shape[1] // num_kv_heads,
                scale, block_size, True)
        del k, v, mask  # before the next sequence's are allocated
