"""Triton building blocks shared by the paged decode and prefill kernels.

`attend_tile` is the whole inner step of both: gather BLOCK_N keys/values of one kv head through the
block table (several pages per tile, so enough bytes are in flight; `load_kv_tile`), dequantise fp8 in
registers, S = Q K^T on tensor cores, mask, online-softmax update in the exp2 domain, acc += P V (`attend_kv`).
Q is a tile of M rows (query heads of one kv group, times query tokens for prefill), so each K/V byte is
read once per kv head however many query heads share it.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def load_scale(scale, IS_PTR: tl.constexpr):
    if IS_PTR:
        return tl.load(scale).to(tl.float32)
    else:
        return scale


@triton.jit
def cache_offsets(page, slot, d, kv_head, stride_b, stride_h, stride_2, X: tl.constexpr, LAYOUT: tl.constexpr,
                  IS_KEY: tl.constexpr):
    """Element offsets of (page, slot in page, channel d) of one kv head, broadcasting the three; the layout
    codes and strides come from `_host.cache_layout` (stride_2: the third dim's stride)."""
    base = page * stride_b + kv_head * stride_h
    if LAYOUT == 1:  # [blocks, heads, block_size, D]: rows of D channels
        return base + slot * stride_2 + d
    elif IS_KEY:  # vLLM [blocks, heads, D/X, block_size, X]: 16-byte runs along D
        return base + (d // X) * stride_2 + slot * X + d % X
    else:  # vLLM [blocks, heads, D, block_size]: runs of block_size tokens
        return base + d * stride_2 + slot


@triton.jit
def _to_compute(x, DTYPE: tl.constexpr, FP8: tl.constexpr):
    # fp8 caches hold raw bits in uint8; the scale is folded into the logits / output by the caller.
    if FP8 == 1:
        x = x.to(tl.float8e4nv, bitcast=True)
    elif FP8 == 2:
        x = x.to(tl.float8e5, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def load_kv_tile(
    start_n, seq_len, q_pos,     # as attend_tile's
    k_cache, v_cache, block_table, kv_head,
    stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
    sparse_off, sparse_q_block, sparse_local, sparse_vert, sparse_block,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    X: tl.constexpr, LAYOUT: tl.constexpr, MASKED: tl.constexpr, SPARSE: tl.constexpr,
):
    """The raw K [D, N] and V [N, D] of attend_tile's keys, and which pages (and, SPARSE, which rows' blocks)
    hold keys: the loads alone, so that a caller can issue them before what the math waits for."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    page_idx = offs_n // BLOCK_SIZE
    slot = offs_n % BLOCK_SIZE
    # Loads are masked per page (not per token) so the mask stays constant along a page and the V load,
    # contiguous along tokens of a page, remains vectorised; the tail of the last page is masked later.
    page_ok = page_idx * BLOCK_SIZE < seq_len
    keep = page_ok[None, :]
    if SPARSE:
        # vLLM's block-sparse rule, per row (with head sliding the rows of a group differ); a page is
        # loaded only if some row keeps it, so skipped blocks cost no memory traffic.
        bs_id = (page_idx * BLOCK_SIZE) // sparse_block
        keep = ((bs_id[None, :] + sparse_off[:, None]) % sparse_vert == 0) | \
            (bs_id[None, :] > sparse_q_block - sparse_local)
        keep = keep & ((page_idx * BLOCK_SIZE)[None, :] <= q_pos[:, None])
        page_ok = page_ok & (tl.max(keep.to(tl.int32), axis=0) > 0)
    # Unmasked tiles lie wholly inside the sequence (the callers guarantee it), so they load without masks.
    if MASKED:
        page = tl.load(block_table + page_idx, mask=page_ok, other=0).to(tl.int64)
    else:
        page = tl.load(block_table + page_idx).to(tl.int64)

    k_off = cache_offsets(page[None, :], slot[None, :], offs_d[:, None], kv_head, stride_kb, stride_kh, stride_k2,
                          X, LAYOUT, True)
    v_off = cache_offsets(page[:, None], slot[:, None], offs_d[None, :], kv_head, stride_vb, stride_vh, stride_v2,
                          X, LAYOUT, False)
    if LAYOUT == 0:
        # vLLM's V pages hold runs of BLOCK_SIZE contiguous tokens, which the compiler cannot see through
        # the gathered page numbers.
        v_off = tl.max_contiguous(tl.multiple_of(v_off, [BLOCK_SIZE, 1]), [BLOCK_SIZE, 1])
    if MASKED:
        k = tl.load(k_cache + k_off, mask=d_ok[:, None] & page_ok[None, :], other=0.0)
        v = tl.load(v_cache + v_off, mask=page_ok[:, None] & d_ok[None, :], other=0.0)
    elif HEAD_SIZE < HEAD_PAD:
        k = tl.load(k_cache + k_off, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_cache + v_off, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_cache + k_off)
        v = tl.load(v_cache + v_off)
    return k, v, page_ok, keep


@triton.jit
def attend_kv(
    q, m_i, l_i, acc, k, v, page_ok, keep,  # load_kv_tile's outputs for the keys start_n ...
    start_n, seq_len, q_pos, alibi, qk_scale,
    BLOCK_N: tl.constexpr, FP8: tl.constexpr, MASKED: tl.constexpr, SPARSE: tl.constexpr,
    ALIBI: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """attend_tile's math on a loaded tile."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _to_compute(k, q.dtype, FP8)
    v = _to_compute(v, q.dtype, FP8)

    s = tl.dot(q, k, input_precision=DOT_PREC)
    s_scale = qk_scale
    if ALIBI:  # the bias is in scaled (log2) units
        s = s * qk_scale + alibi[:, None] * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)
        s_scale = 1.0
    if MASKED:
        tok_ok = page_ok & (offs_n < seq_len)
        visible = tok_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SPARSE:
            visible = visible & keep
        s = tl.where(visible, s, float("-inf"))
        # Cache slots past seq_len hold garbage (maybe NaN); P is 0 there but 0 * NaN is not.
        v = tl.where(tok_ok[:, None], v, 0.0)

    # The scale is positive, so it commutes with the max and folds into one FMA before the exp2.
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * s_scale)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s * s_scale - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def attend_tile(
    q, m_i, l_i, acc,            # [M, D] query tile; running max (log2 units), sum, [M, D] accumulator
    start_n, seq_len,            # first key position of the tile; keys >= seq_len do not exist
    q_pos,                       # [M] position of each row's query: key n is visible iff n <= q_pos
    alibi,                       # [M] ALiBi slope * log2(e) per row (ignored unless ALIBI)
    qk_scale,                    # softmax scale * log2(e) (* k_scale for fp8)
    k_cache, v_cache, block_table, kv_head,
    stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
    sparse_off, sparse_q_block, sparse_local, sparse_vert, sparse_block,  # [M] offsets + scalars (SPARSE)
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    X: tl.constexpr, LAYOUT: tl.constexpr, FP8: tl.constexpr, MASKED: tl.constexpr, SPARSE: tl.constexpr,
    ALIBI: tl.constexpr, DOT_PREC: tl.constexpr,
):
    k, v, page_ok, keep = load_kv_tile(
        start_n, seq_len, q_pos, k_cache, v_cache, block_table, kv_head,
        stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
        sparse_off, sparse_q_block, sparse_local, sparse_vert, sparse_block,
        HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, X, LAYOUT, MASKED, SPARSE)
    return attend_kv(q, m_i, l_i, acc, k, v, page_ok, keep, start_n, seq_len, q_pos, alibi, qk_scale,
                     BLOCK_N, FP8, MASKED, SPARSE, ALIBI, DOT_PREC)


@triton.jit
def attend_range(
    q, m_i, l_i, acc, start, masked_from, end, seq_len, q_pos, alibi, qk_scale,
    k_cache, v_cache, block_table, kv_head,
    stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
    sparse_off, sparse_q_block, sparse_local, sparse_vert, sparse_block,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    X: tl.constexpr, LAYOUT: tl.constexpr, FP8: tl.constexpr, SPARSE: tl.constexpr, ALIBI: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """`attend_tile` over the keys start..end in BLOCK_N tiles: those before masked_from (a tile boundary the
    caller knows every row sees in full) without masks, the rest masked."""
    for start_n in range(start, masked_from, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start_n, seq_len, q_pos, alibi, qk_scale,
            k_cache, v_cache, block_table, kv_head,
            stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
            sparse_off, sparse_q_block, sparse_local, sparse_vert, sparse_block,
            HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, X, LAYOUT, FP8, False, SPARSE, ALIBI, DOT_PREC)
    for start_n in range(masked_from, end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start_n, seq_len, q_pos, alibi, qk_scale,
            k_cache, v_cache, block_table, kv_head,
            stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
            sparse_off, sparse_q_block, sparse_local, sparse_vert, sparse_block,
            HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, X, LAYOUT, FP8, True, SPARSE, ALIBI, DOT_PREC)
    return m_i, l_i, acc
