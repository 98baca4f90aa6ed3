"""Triton block-sparse flash attention over the (query block, key block) pairs XAttention selected.

One program owns BLOCK_M query rows of one query block and one query head; it walks only the key blocks
listed for that (block, head), in ascending order, with an online softmax in the exp2 domain and both
GEMMs on tensor cores. Every listed block but the last lies wholly before the query block (or, without
causality, before the last key block), so only the last one pays for masking. K/V are read either from
dense ``[B, H_kv, L, D]`` tensors or straight from the paged cache through the block table (fp8 caches
dequantized in registers); query heads index their kv head, so GQA never copies K/V.

A small kernel first turns each mask row into its list of visible selected key blocks. Work is described
by "items" (one per query block of a sequence), listed heaviest (latest block) first so the long causal
rows start early; the head is the fastest grid index, so the query heads sharing a kv head run side by side
and share its K/V through L2.
"""
import math

import torch
import triton
import triton.language as tl

from pagedllm.ops.reference import as_vllm_layout
from pagedllm.ops.triton._host import cache_layout
from pagedllm.ops.triton.paged_tile import cache_offsets

from . import reference as ref
from .estimate import _dot_precision, _head_pad, _last_dim_dense, _pow2, xattn_estimate

NEG_INF = tl.constexpr(float("-inf"))
_FP8 = {"auto": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2}
# Query rows x keys per tile and launch shape (capped by the sparse block size). The interpreter (CPU tests)
# uses small tiles so small test shapes still cover several tiles per block.
GPU_CONFIG = dict(block_m=128, block_n=128, num_warps=8, num_stages=3)
CPU_CONFIG = dict(block_m=64, block_n=32, num_warps=4, num_stages=1)


@triton.jit
def _load_kv(K, V, kvh, k_base, v_base, bt_row, offs_n, n_ok, offs_d, d_ok,
             stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, DTYPE: tl.constexpr,
             PAGED: tl.constexpr, PAGE: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr, FP8: tl.constexpr,
             MASKED: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """K as [D, N] and V as [N, D] for key positions offs_n, in DTYPE (fp8 bits are bitcast, not scaled).
    Unmasked tiles lie wholly inside the sequence, so they load without token masks (and without any mask
    when the head size is a power of two)."""
    if PAGED:
        if MASKED:
            page = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
        slot = offs_n % PAGE
        k_off = cache_offsets(page[None, :], slot[None, :], offs_d[:, None], kvh, stride_k0, stride_k1, stride_k2,
                              X, LAYOUT, True)
        v_off = cache_offsets(page[:, None], slot[:, None], offs_d[None, :], kvh, stride_v0, stride_v1, stride_v2,
                              X, LAYOUT, False)
    else:
        k_off = k_base + offs_n[None, :] * stride_k2 + offs_d[:, None]
        v_off = v_base + offs_n[:, None] * stride_v2 + offs_d[None, :]
    if MASKED:
        k = tl.load(K + k_off, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        v = tl.load(V + v_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    elif HEAD < HEAD_PAD:
        k = tl.load(K + k_off, mask=d_ok[:, None], other=0.0)
        v = tl.load(V + v_off, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(K + k_off)
        v = tl.load(V + v_off)
    if FP8 == 1:
        k = k.to(tl.float8e4nv, bitcast=True)
        v = v.to(tl.float8e4nv, bitcast=True)
    elif FP8 == 2:
        k = k.to(tl.float8e5, bitcast=True)
        v = v.to(tl.float8e5, bitcast=True)
    return k.to(DTYPE), v.to(DTYPE)


@triton.jit
def _attend(q, m_i, l_i, acc, start, q_pos, seq_len, K, V, kvh, k_base, v_base, bt_row, offs_d, d_ok, qk_scale,
            stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2,
            BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr,
            FP8: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
            HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """One BLOCK_N key tile of the online softmax (m_i in log2 units, s left unscaled)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seq_len
    k, v = _load_kv(K, V, kvh, k_base, v_base, bt_row, offs_n, n_ok, offs_d, d_ok, stride_k0, stride_k1,
                    stride_k2, stride_v0, stride_v1, stride_v2, q.dtype, PAGED, PAGE, X, LAYOUT, FP8, MASKED,
                    HEAD, HEAD_PAD)
    s = tl.dot(q, k, input_precision=DOT_PREC)
    if MASKED:
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(ok, s, NEG_INF)
        v = tl.where(n_ok[:, None], v, 0.0)  # unwritten cache slots may hold NaN; 0 * NaN is not 0
    # The scale is positive (the softmax scale is checked on the host, an fp8 k_scale is positive), so it
    # commutes with the max and folds into one FMA before the exp2 instead of a multiply of the whole tile.
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    m_ref = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


# Strides that follow each batch's block-table width and mask shape: not specialised on, so a new batch does
# not compile a new variant.
@triton.jit(do_not_specialize=["stride_bt", "stride_ip", "stride_ih", "stride_iq", "stride_cp", "stride_ch"])
def _sparse_attn_kernel(
    Q, O, K, V, BLOCK_TABLES, SCALES, ITEM_P, ITEM_J, P_SEQ, P_QSTART, P_LEN, P_QOFF, P_OOFF,
    KV_IDX, KV_CNT, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, stride_bt,
    stride_ip, stride_ih, stride_iq, stride_cp, stride_ch, H, GROUP, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr,
    FP8: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    h = pid % H
    tile = pid // H
    M_TILES: tl.constexpr = BLOCK_SIZE // BLOCK_M
    item = tile // M_TILES
    p = tl.load(ITEM_P + item)  # which mask (sequence) and which of its query blocks
    j = tl.load(ITEM_J + item)
    seq = tl.load(P_SEQ + p)
    q_start = tl.load(P_QSTART + p)
    seq_len = tl.load(P_LEN + p)
    q_pos = (q_start // BLOCK_SIZE + j) * BLOCK_SIZE + (tile % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (q_pos >= q_start) & (q_pos < seq_len)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD
    q_rows = (q_pos - q_start).to(tl.int64)
    q = tl.load(Q + tl.load(P_QOFF + p) + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    kvh = h // GROUP
    if PAGED:  # cache_offsets adds the kv head
        k_base = 0
        v_base = 0
    else:
        k_base = seq.to(tl.int64) * stride_k0 + kvh * stride_k1
        v_base = seq.to(tl.int64) * stride_v0 + kvh * stride_v1
    bt_row = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    qk_scale = qk_scale * tl.load(SCALES)
    idx = KV_IDX + p.to(tl.int64) * stride_ip + h * stride_ih + j.to(tl.int64) * stride_iq
    count = tl.load(KV_CNT + p * stride_cp + h * stride_ch + j)

    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for i in range(0, count - 1):  # wholly visible blocks: no masks
        kb_start = tl.load(idx + i) * BLOCK_SIZE
        for n in tl.static_range(0, BLOCK_SIZE, BLOCK_N):
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, kb_start + n, q_pos, seq_len, K, V, kvh, k_base, v_base,
                                    bt_row, offs_d, d_ok, qk_scale, stride_k0, stride_k1, stride_k2, stride_v0,
                                    stride_v1, stride_v2, BLOCK_N, PAGED, PAGE, X, LAYOUT, FP8, False, CAUSAL,
                                    DOT_PREC, HEAD, HEAD_PAD)
    if count > 0:  # the last listed block: diagonal and/or ragged end
        kb_start = tl.load(idx + count - 1) * BLOCK_SIZE
        end = kb_start + BLOCK_SIZE
        if CAUSAL:
            end = tl.minimum(end, tl.max(q_pos) + 1)
        for n in range(kb_start, end, BLOCK_N):
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, n, q_pos, seq_len, K, V, kvh, k_base, v_base,
                                    bt_row, offs_d, d_ok, qk_scale, stride_k0, stride_k1, stride_k2, stride_v0,
                                    stride_v1, stride_v2, BLOCK_N, PAGED, PAGE, X, LAYOUT, FP8, True, CAUSAL,
                                    DOT_PREC, HEAD, HEAD_PAD)
    o = acc * (tl.load(SCALES + 1) / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(O + tl.load(P_OOFF + p) + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _compact_kernel(MASK, P_QSTART, IDX, CNT, stride_mp, stride_mh, stride_mq, stride_ip, stride_ih, stride_iq,
                    stride_cp, stride_ch, H, k_blocks, BLOCK_SIZE: tl.constexpr, KB_PAD: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """One mask row -> its visible selected key blocks, ascending, and their count."""
    j, ph = tl.program_id(0), tl.program_id(1)
    p, h = ph // H, ph % H
    kb = tl.arange(0, KB_PAD)
    ok = kb < k_blocks
    if CAUSAL:
        # blocks past the diagonal are dropped: the attention kernel masks only the last listed block
        ok = ok & (kb <= tl.load(P_QSTART + p) // BLOCK_SIZE + j)
    keep = tl.load(MASK + p * stride_mp + h * stride_mh + j * stride_mq + kb, mask=ok, other=0) != 0
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(IDX + p * stride_ip + h * stride_ih + j * stride_iq + pos, kb, mask=keep)
    tl.store(CNT + p * stride_cp + h * stride_ch + j, tl.sum(keep.to(tl.int32), axis=0))


def _launch(out, query, k, v, block_tables, scales, masks, plan, q_strides, o_strides, k_strides, v_strides,
            group, scale, block_size, causal, paged, fp8):
    """Run the sparse kernel. ``masks`` is bool [P, H, q_blocks, k_blocks], entry p zero-padded past its own
    shape; ``plan`` lists per entry (sequence, query start, seq len, query element offset, output element
    offset), the queries being positions query start .. seq len - 1."""
    if not scale > 0:
        raise ValueError(f"scale must be positive (the kernel applies it after the row max), got {scale!r}")
    num_p, num_heads, q_blocks, k_blocks = masks.shape
    dev = query.device
    idx = torch.empty(num_p, num_heads, q_blocks, k_blocks, dtype=torch.int32, device=dev)
    count = torch.empty(num_p, num_heads, q_blocks, dtype=torch.int32, device=dev)
    cols = [torch.tensor(c, dtype=torch.int64, device=dev) for c in zip(*plan)]
    m8 = masks.view(torch.int8)
    _compact_kernel[(q_blocks, num_p * num_heads)](
        m8, cols[1], idx, count, *m8.stride()[:3], *idx.stride()[:3], *count.stride()[:2], num_heads, k_blocks,
        BLOCK_SIZE=block_size, KB_PAD=_pow2(k_blocks), CAUSAL=causal)
    # one item per (entry, query block), heaviest (latest block) first
    first = [q_start // block_size for _, q_start, _, _, _ in plan]
    items = sorted(((p, j) for p, (_, _, seq_len, _, _) in enumerate(plan)
                    for j in range(-(-seq_len // block_size) - first[p])), key=lambda it: -(first[it[0]] + it[1]))
    item_p = torch.tensor([p for p, _ in items], dtype=torch.int32, device=dev)
    item_j = torch.tensor([j for _, j in items], dtype=torch.int32, device=dev)
    d = query.shape[-1]
    cfg = GPU_CONFIG if query.is_cuda else CPU_CONFIG
    block_m, block_n = min(cfg["block_m"], block_size), min(cfg["block_n"], block_size)
    layout, page, x = cache_layout(k, v) if paged else (0, 1, 1)
    grid = (len(items) * (block_size // block_m) * num_heads,)
    _sparse_attn_kernel[grid](
        query, out, k, v, block_tables, scales, item_p, item_j, *cols, idx, count, *q_strides, *o_strides,
        *k_strides, *v_strides, block_tables.stride(0), *idx.stride()[:3], *count.stride()[:2], num_heads,
        group, scale * ref.LOG2E, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, HEAD=d,
        HEAD_PAD=_head_pad(d), PAGED=paged, PAGE=page, X=x, LAYOUT=layout, FP8=fp8, CAUSAL=causal,
        DOT_PREC=_dot_precision(query.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _check_block_size(block_size):
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}")


def block_sparse_attention(q, k, v, block_mask, block_size=128, causal=True, scale=None):
    b, h, hkv, q_len, k_len, d = ref.check_qkv(q, k, v)
    _check_block_size(block_size)
    ref.check_mask(block_mask, b, h, q_len, k_len, block_size)
    q, k, v = _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    plan = [(i, k_len - q_len, k_len, i * q.stride(0), i * out.stride(0)) for i in range(b)]
    ones = torch.ones(2, dtype=torch.float32, device=q.device)
    no_table = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
    _launch(out, q, k, v, no_table, ones, block_mask, plan, (q.stride(2), q.stride(1)),
            (out.stride(2), out.stride(1)), k.stride()[:3], v.stride()[:3], h // hkv, scale, block_size, causal,
            False, 0)
    return out


def _scales(k_scale, v_scale, device):
    """[k_scale, v_scale] as a device fp32 tensor (tensor scales stay on the device: no sync)."""
    return torch.stack([torch.as_tensor(s, dtype=torch.float32, device=device).reshape(())
                        for s in (k_scale, v_scale)])


def _prefill_masks(query, key_cache, block_tables, plan, kv_cache_dtype, k_scale, threshold, stride, block_size):
    """bool [P, H, q_blocks, k_blocks]: each sequence's estimated mask of its new tokens against its whole
    context (K gathered from the cache), zero-padded to the largest shape."""
    layouts = [ref.block_layout(q_len, seq_len, block_size) for _, _, q_len, seq_len in plan]
    shape = (len(plan), query.shape[1], max(lay[1] for lay in layouts), max(lay[2] for lay in layouts))
    if isinstance(threshold, (int, float)) and threshold >= 1.0:  # dense: nothing to estimate
        return torch.ones(shape, dtype=torch.bool, device=query.device)
    masks = torch.zeros(shape, dtype=torch.bool, device=query.device)
    for i, (seq, q0, q_len, seq_len) in enumerate(plan):
        k = ref.gather_sequence(key_cache, block_tables[seq], seq_len, kv_cache_dtype, k_scale, query.dtype,
                                True)
        q = query[q0:q0 + q_len].transpose(0, 1)[None]  # [1, H, q_len, D] view
        mask = xattn_estimate(q, k[None], block_size, stride, threshold)[0][0]
        masks[i, :, :mask.shape[1], :mask.shape[2]] = mask
    return masks


def xattention_paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                             query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype,
                             k_scale, v_scale, threshold=0.9, stride=8, block_size=128):
    plan = ref.prefill_plan(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                            query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype)
    if not plan:
        return
    _check_block_size(block_size)
    masks = _prefill_masks(query, as_vllm_layout(key_cache, value_cache)[0], block_tables, plan, kv_cache_dtype,
                           k_scale, threshold, stride, block_size)
    fp8 = _FP8[kv_cache_dtype]
    kc = key_cache.view(torch.uint8) if fp8 and key_cache.dtype != torch.uint8 else key_cache
    vc = value_cache.view(torch.uint8) if fp8 and value_cache.dtype != torch.uint8 else value_cache
    scales = _scales(k_scale, v_scale, query.device) if fp8 else torch.ones(2, device=query.device)
    entries = [(seq, seq_len - q_len, seq_len, q0 * query.stride(0), q0 * out.stride(0))
               for seq, q0, q_len, seq_len in plan]
    _launch(out, query, kc, vc, block_tables, scales, masks, entries, (query.stride(0), query.stride(1)),
            (out.stride(0), out.stride(1)), kc.stride()[:3], vc.stride()[:3], query.shape[1] // num_kv_heads,
            scale, block_size, True, True, fp8)
