"""Triton block-sparse flash attention over the (query block, key block) pairs XAttention selected.

One program owns BLOCK_M query rows of one query block and one query head; it walks only the key blocks
listed for that (block, head), in ascending order, with an online softmax in the exp2 domain and both
GEMMs on tensor cores. Every listed block but the last lies wholly before the query block (or, without
causality, before the last key block), so only the last one pays for masking. K/V are read either from
dense ``[B, H_kv, L, D]`` tensors through TMA descriptors (out-of-range rows and head columns arrive as
zeros) or straight from the paged cache through the block table (fp8 caches dequantized in registers);
query heads index their kv head, so GQA never copies K/V.

A small kernel first turns each mask row into its list of visible selected key blocks. Work is described
by "items" (one per query block of a sequence), listed heaviest (latest block) first so the long causal
rows start early. The grid runs one kv head after another (its query heads side by side), so the blocks the
running programs read are one kv head's and come from the L2 after their first read.
"""
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedllm.ops.reference import as_vllm_layout
from pagedllm.ops.triton._host import cache_layout
from pagedllm.ops.triton.paged_tile import _to_compute, cache_offsets

from . import reference as ref
from .estimate import _dot_precision, _head_pad, _pow2, _tma_operand, xattn_estimate

NEG_INF = tl.constexpr(float("-inf"))
_FP8 = {"auto": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2}
# Query rows x keys per tile and launch shape (capped by the sparse block size), for dense (TMA) and paged K/V.
# On the H100 at 64K (32/8 heads, head 128), dense at 11% / 100% density: 128 x 64 with 4 warps and 2 stages
# 373 / 527 TFLOP/s, 128 x 128 with 8 warps 335 / 454; paged (32K, full mask, "hnd" cache) 128 x 128 with 8
# warps and 3 stages 354, 128 x 64 293 (results README). The interpreter (CPU tests) uses small tiles so small
# test shapes still cover several tiles per block.
GPU_CONFIG = dict(dense=dict(block_m=128, block_n=64, num_warps=4, num_stages=2),
                  paged=dict(block_m=128, block_n=128, num_warps=8, num_stages=3))
CPU_CONFIG = dict(block_m=64, block_n=32, num_warps=4, num_stages=1)


@triton.jit
def _load_tile(X_, seq, kvh, page, start, offs_n, n_ok, stride_0, stride_1, stride_2, DTYPE: tl.constexpr,
               PAGED: tl.constexpr, PAGE: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr, FP8: tl.constexpr,
               MASKED: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, IS_KEY: tl.constexpr):
    """The tile's keys as [D, N] (IS_KEY) or values as [N, D], in DTYPE (fp8 bits are bitcast, not scaled).
    Dense K/V are TMA descriptors (zeros past the sequence and the head). Paged tiles go through ``page``
    (each key's page); unmasked ones lie wholly inside the sequence, so they load without token masks (and
    without any mask when the head size is a power of two)."""
    if not PAGED:
        x = X_.load([seq.to(tl.int32), kvh, tl.cast(start, tl.int32), 0]).reshape(offs_n.shape[0], HEAD_PAD)
        if IS_KEY:
            x = x.T
    else:
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD
        if IS_KEY:
            off = cache_offsets(page[None, :], (offs_n % PAGE)[None, :], offs_d[:, None], kvh, stride_0, stride_1,
                                stride_2, X, LAYOUT, True)
            ok = d_ok[:, None] & n_ok[None, :] if MASKED else d_ok[:, None]
        else:
            off = cache_offsets(page[:, None], (offs_n % PAGE)[:, None], offs_d[None, :], kvh, stride_0, stride_1,
                                stride_2, X, LAYOUT, False)
            ok = n_ok[:, None] & d_ok[None, :] if MASKED else d_ok[None, :]
        if MASKED or HEAD < HEAD_PAD:
            x = tl.load(X_ + off, mask=ok, other=0.0)
        else:
            x = tl.load(X_ + off)
        x = _to_compute(x, DTYPE, FP8)
    return x


@triton.jit
def _attend(q, m_i, l_i, acc, start, q0, seq, seq_len, K, V, kvh, bt_row, qk_scale,
            stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr,
            FP8: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
            HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """One BLOCK_N key tile of the online softmax for query rows q0.. (m_i in log2 units, s left unscaled).
    m_i starts at a finite -1e30 rather than -inf, so a row that sees nothing yet needs no guard. V is
    loaded after the softmax, so the K and V tiles are never live together (dense: 15% faster at 64K, 11% density)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seq_len
    page = 0
    if PAGED:
        if MASKED:
            page = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
    k = _load_tile(K, seq, kvh, page, start, offs_n, n_ok, stride_k0, stride_k1, stride_k2, q.dtype, PAGED, PAGE,
                   X, LAYOUT, FP8, MASKED, HEAD, HEAD_PAD, True)
    s = tl.dot(q, k, input_precision=DOT_PREC)
    if MASKED:
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= (q0 + tl.arange(0, BLOCK_M))[:, None])
        s = tl.where(ok, s, NEG_INF)
    # The scale is positive (the softmax scale is checked on the host, an fp8 k_scale is positive), so it
    # commutes with the max and folds into one FMA before the exp2 instead of a multiply of the whole tile.
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_tile(V, seq, kvh, page, start, offs_n, n_ok, stride_v0, stride_v1, stride_v2, q.dtype, PAGED, PAGE,
                   X, LAYOUT, FP8, MASKED, HEAD, HEAD_PAD, False)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


# Strides that follow each batch's block-table width and mask shape: not specialised on, so a new batch does
# not compile a new variant. Positions are int32 and per-row values are recomputed after the loops rather
# than kept live across them: at 128 x 128 tiles every register counts (a live int64 row index made the
# kernel spill).
@triton.jit(do_not_specialize=["stride_bt", "stride_ip", "stride_ih", "stride_iq", "stride_cp", "stride_ch"])
def _sparse_attn_kernel(
    Q, O, K, V, BLOCK_TABLES, SCALES, ITEM_P, ITEM_J, P_SEQ, P_QSTART, P_LEN, P_QROW, P_OOFF,
    KV_IDX, KV_CNT, stride_ot, stride_oh,
    stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, stride_bt,
    stride_ip, stride_ih, stride_iq, stride_cp, stride_ch, H, GROUP, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr,
    FP8: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # kv head slowest, its query heads fastest: the programs running at once read one kv head's K/V (32 MB at
    # 64K tokens), which the L2 then holds for every query block that selects a block of it
    per_kv = tl.num_programs(0) // H * GROUP
    kvh = tl.program_id(0) // per_kv
    tile = tl.program_id(0) % per_kv // GROUP
    h = kvh * GROUP + tl.program_id(0) % GROUP
    M_TILES: tl.constexpr = BLOCK_SIZE // BLOCK_M
    item = tile // M_TILES
    p = tl.load(ITEM_P + item)  # which mask (sequence) and which of its query blocks
    j = tl.load(ITEM_J + item)
    seq = tl.load(P_SEQ + p)
    q_start = tl.load(P_QSTART + p).to(tl.int32)
    seq_len = tl.load(P_LEN + p).to(tl.int32)
    q0 = (q_start // BLOCK_SIZE + j) * BLOCK_SIZE + (tile % M_TILES) * BLOCK_M  # first query row's position
    # Q through its descriptor ([batch, heads, rows, D]; dense inputs are batched, the paged query is one
    # batch of packed tokens): it stays in shared memory for the tensor cores instead of ~50 registers.
    if PAGED:
        q_batch = 0
    else:
        q_batch = seq.to(tl.int32)
    q_row = (tl.load(P_QROW + p) + q0 - q_start).to(tl.int32)
    q = Q.load([q_batch, h, q_row, 0]).reshape(BLOCK_M, HEAD_PAD)

    bt_row = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    qk_scale = qk_scale * tl.load(SCALES)
    idx = KV_IDX + p.to(tl.int64) * stride_ip + h * stride_ih + j.to(tl.int64) * stride_iq
    count = tl.load(KV_CNT + p * stride_cp + h * stride_ch + j)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # Wholly visible blocks, no masks: one flat loop over their tiles so loads stream across blocks.
    N_TILES: tl.constexpr = BLOCK_SIZE // BLOCK_N
    for it in range(0, (count - 1) * N_TILES):
        start = tl.load(idx + it // N_TILES) * BLOCK_SIZE + (it % N_TILES) * BLOCK_N
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, start, q0, seq, seq_len, K, V, kvh, bt_row, qk_scale,
                                stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, BLOCK_M,
                                BLOCK_N, PAGED, PAGE, X, LAYOUT, FP8, False, CAUSAL, DOT_PREC, HEAD, HEAD_PAD)
    if count > 0:  # the last listed block: diagonal and/or ragged end
        kb_start = tl.load(idx + count - 1) * BLOCK_SIZE
        end = kb_start + BLOCK_SIZE
        if CAUSAL:
            end = tl.minimum(end, q0 + BLOCK_M)
        for n in range(kb_start, end, BLOCK_N):
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, n, q0, seq, seq_len, K, V, kvh, bt_row, qk_scale,
                                    stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2,
                                    BLOCK_M, BLOCK_N, PAGED, PAGE, X, LAYOUT, FP8, True, CAUSAL, DOT_PREC, HEAD,
                                    HEAD_PAD)
    o = acc * (tl.load(SCALES + 1) / tl.where(l_i > 0, l_i, 1.0))[:, None]
    q_pos = q0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD
    rows = tl.load(P_OOFF + p) + (q_pos - q_start).to(tl.int64) * stride_ot
    tl.store(O + rows[:, None] + h * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=((q_pos >= q_start) & (q_pos < seq_len))[:, None] & d_ok[None, :])


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


def _launch(out, query, k, v, block_tables, scales, masks, plan, o_strides, k_strides, v_strides, group, scale,
            block_size, causal, paged, fp8):
    """Run the sparse kernel. ``query`` is ``[batch, heads, rows, D]`` (any strides TMA accepts); ``masks`` is
    bool [P, H, q_blocks, k_blocks], entry p zero-padded past its own shape; ``plan`` lists per entry
    (sequence, query start, seq len, query row, output element offset), the queries being positions query
    start .. seq len - 1, found from the query row on (in batch ``sequence`` when dense, 0 when paged)."""
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
    cfg = GPU_CONFIG["paged" if paged else "dense"] if query.is_cuda else CPU_CONFIG
    block_m, block_n = min(cfg["block_m"], block_size), min(cfg["block_n"], block_size)
    query = _tma_operand(query)
    # unit box dimensions lead: the loaded tile then reshapes to 2-D without a trip through registers
    q_desc = TensorDescriptor.from_tensor(query, [1, 1, block_m, _head_pad(d)])
    if not paged:
        k, v = (TensorDescriptor.from_tensor(x, [1, 1, block_n, _head_pad(d)]) for x in (k, v))
    layout, page, x = cache_layout(k, v) if paged else (0, 1, 1)
    grid = (len(items) * (block_size // block_m) * num_heads,)
    _sparse_attn_kernel[grid](
        q_desc, out, k, v, block_tables, scales, item_p, item_j, *cols, idx, count, *o_strides,
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
    k, v = _tma_operand(k), _tma_operand(v)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    plan = [(i, k_len - q_len, k_len, 0, i * out.stride(0)) for i in range(b)]
    ones = torch.ones(2, dtype=torch.float32, device=q.device)
    no_table = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
    _launch(out, q, k, v, no_table, ones, block_mask, plan, (out.stride(2), out.stride(1)),
            k.stride()[:3], v.stride()[:3], h // hkv, scale, block_size, causal, False, 0)
    return out


def _scales(k_scale, v_scale, device):
    """[k_scale, v_scale] as a device fp32 tensor (tensor scales stay on the device: no sync)."""
    return torch.stack([torch.as_tensor(s, dtype=torch.float32, device=device).reshape(())
                        for s in (k_scale, v_scale)])


def _prefill_masks(query, key_cache, block_tables, plan, kv_cache_dtype, k_scale, threshold, stride, block_size,
                   share_kv_heads, fp8_estimate):
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
        mask = xattn_estimate(q, k[None], block_size, stride, threshold, share_kv_heads=share_kv_heads,
                              fp8_estimate=fp8_estimate)[0][0]
        masks[i, :, :mask.shape[1], :mask.shape[2]] = mask
    return masks


def xattention_paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                             query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype,
                             k_scale, v_scale, threshold=0.9, stride=8, block_size=128, share_kv_heads=False,
                             fp8_estimate=False):
    plan = ref.prefill_plan(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                            query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype)
    if not plan:
        return
    _check_block_size(block_size)
    masks = _prefill_masks(query, as_vllm_layout(key_cache, value_cache)[0], block_tables, plan, kv_cache_dtype,
                           k_scale, threshold, stride, block_size, share_kv_heads, fp8_estimate)
    fp8 = _FP8[kv_cache_dtype]
    kc = key_cache.view(torch.uint8) if fp8 and key_cache.dtype != torch.uint8 else key_cache
    vc = value_cache.view(torch.uint8) if fp8 and value_cache.dtype != torch.uint8 else value_cache
    scales = _scales(k_scale, v_scale, query.device) if fp8 else torch.ones(2, device=query.device)
    entries = [(seq, seq_len - q_len, seq_len, q0, q0 * out.stride(0)) for seq, q0, q_len, seq_len in plan]
    _launch(out, query.transpose(0, 1)[None], kc, vc, block_tables, scales, masks, entries,
            (out.stride(0), out.stride(1)), kc.stride()[:3], vc.stride()[:3], query.shape[1] // num_kv_heads, scale,
            block_size, True, True, fp8)
