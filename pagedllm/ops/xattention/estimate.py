"""Triton kernels of XAttention's block estimation.

`flat_group_gemm_fuse_reshape` and `softmax_fuse_block_sum` are the seed's two stages, kept as separate ops
(tests, experiments). `xattn_estimate` fuses them: one program owns BLOCK_M reshaped query rows and sweeps
their causal key range once, computing each antidiagonal score tile on tensor cores and immediately reducing
it to per-row, per-key-block partial sums ``sum exp2(s - m_tile)`` plus the tile's row max (a few KB of
scratch per tile instead of the [q/stride, k/stride] score matrix). Once the row's final max and sum are
known, the same program rescales its partials into normalized block sums: the strided GEMM runs once, and
no score matrix ever reaches memory. Q and K are read in place (any strides, GQA by head index, any
length: out-of-range tokens load as zeros). `select_blocks` then picks each query block's key blocks in one
program per row, by bisection instead of a sort.
"""
import torch
import triton
import triton.language as tl

from . import reference as ref

NEG_INF = tl.constexpr(float("-inf"))
# Fused estimator tiles (reshaped rows x reshaped keys) and launch shape. The GPU wants big tiles for the
# tensor cores; the interpreter (CPU tests) uses small ones so small test shapes still span several tiles.
GPU_CONFIG = dict(block_m=128, block_n=128, num_warps=8, num_stages=3)
CPU_CONFIG = dict(block_m=64, block_n=64, num_warps=4, num_stages=1)


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 tests must not drop to tf32 on the GPU


@triton.jit
def _antidiag_step(acc, q_base, k_base, stride_qt, stride_kt, rows, cols, s, q_first, q_len, k_len,
                   STRIDE: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc += step s of the antidiagonal sums: reshaped row R takes query token R*STRIDE + STRIDE-1-s
    (absolute position; Q row 0 sits at q_first), column C key token C*STRIDE + s."""
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD
    qi = rows * STRIDE + (STRIDE - 1 - s) - q_first
    kj = cols * STRIDE + s
    q = tl.load(q_base + qi[:, None] * stride_qt + offs_d[None, :],
                mask=((qi >= 0) & (qi < q_len))[:, None] & d_ok[None, :], other=0.0)
    k = tl.load(k_base + kj[None, :] * stride_kt + offs_d[:, None],
                mask=(kj < k_len)[None, :] & d_ok[:, None], other=0.0)
    return tl.dot(q, k, acc, input_precision=DOT_PREC)


@triton.jit
def _block_partials(s, m, RBS: tl.constexpr):
    """exp2(s - m[:, None]) summed over each run of RBS columns: [M, N] -> [M, N // RBS]."""
    m = tl.where(m == NEG_INF, 0.0, m)  # rows with nothing visible: exp2(-inf) = 0 everywhere
    p = tl.exp2(s - m[:, None])
    return tl.sum(tl.reshape(p, [s.shape[0], s.shape[1] // RBS, RBS]), axis=2)


# ----------------------------------------------------------------------------------------------------
# Stage 1: antidiagonal scores
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _gemm_kernel(Q, K, OUT, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                 stride_ob, stride_oh, stride_or, H, GROUP, q_len, k_len, chunk_start,
                 STRIDE: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if CAUSAL and pid_n * BLOCK_N > chunk_start + pid_m * BLOCK_M + BLOCK_M - 1:
        return  # the whole tile is hidden; its entries may hold anything
    b, h = bh // H, bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(STRIDE):
        s = _antidiag_step(s, Q + b * stride_qb + h * stride_qh, K + b * stride_kb + (h // GROUP) * stride_kh,
                           stride_qt, stride_kt, rows, cols, i, 0, q_len, k_len, STRIDE, HEAD, HEAD_PAD,
                           DOT_PREC)
    ok = (rows < q_len // STRIDE)[:, None] & (cols < k_len // STRIDE)[None, :]
    tl.store(OUT + b * stride_ob + h * stride_oh + rows[:, None] * stride_or + cols[None, :],
             s.to(OUT.dtype.element_ty), mask=ok)


def flat_group_gemm_fuse_reshape(query_states, key_states, stride, chunk_start, chunk_end, is_causal=True):
    ref._check_gemm_args(query_states, key_states, stride, chunk_start, chunk_end)
    q, k = _last_dim_dense(query_states), _last_dim_dense(key_states)
    b, h, q_len, d = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    out = torch.empty(b, h, q_len // stride, k_len // stride, device=q.device, dtype=q.dtype)
    block = 64
    grid = (triton.cdiv(q_len // stride, block), triton.cdiv(k_len // stride, block), b * h)
    _gemm_kernel[grid](q, k, out, *q.stride()[:3], *k.stride()[:3], *out.stride()[:3], h, h // hkv,
                       q_len, k_len, chunk_start, STRIDE=stride, HEAD=d, HEAD_PAD=_head_pad(d),
                       BLOCK_M=block, BLOCK_N=block, CAUSAL=is_causal, DOT_PREC=_dot_precision(q.dtype))
    return out


# ----------------------------------------------------------------------------------------------------
# Stage 2: softmax + block sums over stored scores
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _softmax_block_sum_kernel(X, OUT, stride_xb, stride_xh, stride_xr, stride_ob, stride_oh, stride_or,
                              H, cols, chunk_start, real_q_len, scale, RBS: tl.constexpr,
                              SEGMENT: tl.constexpr, CAUSAL: tl.constexpr):
    qb, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = qb * RBS + tl.arange(0, RBS)
    x_base = X + b * stride_xb + h * stride_xh + rows[:, None] * stride_xr
    hi = cols
    if CAUSAL:
        hi = tl.minimum(hi, chunk_start + qb * RBS + RBS)  # columns past the block's last row are hidden
    m_i = tl.full([RBS], NEG_INF, tl.float32)
    l_i = tl.zeros([RBS], tl.float32)
    for c0 in range(0, hi, SEGMENT):
        s = _load_scores(x_base, rows, c0, hi, chunk_start, scale, SEGMENT, CAUSAL)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp2(m_i - tl.where(m_new == NEG_INF, 0.0, m_new)) + \
            tl.sum(_block_partials(s, m_new, RBS), axis=1)
        m_i = m_new
    inv_l = tl.where((rows < real_q_len) & (l_i > 0), 1.0 / l_i, 0.0)
    o_base = OUT + b * stride_ob + h * stride_oh + qb * stride_or
    for c0 in range(0, hi, SEGMENT):
        s = _load_scores(x_base, rows, c0, hi, chunk_start, scale, SEGMENT, CAUSAL)
        part = _block_partials(s, m_i, RBS) * inv_l[:, None]
        kb = c0 // RBS + tl.arange(0, SEGMENT // RBS)
        tl.store(o_base + kb, tl.sum(part, axis=0), mask=kb < cols // RBS)


@triton.jit
def _load_scores(x_base, rows, c0, hi, chunk_start, scale, SEGMENT: tl.constexpr, CAUSAL: tl.constexpr):
    offs = c0 + tl.arange(0, SEGMENT)
    ok = (offs < hi)[None, :]
    if CAUSAL:
        ok = ok & (offs[None, :] <= chunk_start + rows[:, None])
    s = tl.load(x_base + offs[None, :], mask=ok, other=0.0).to(tl.float32) * scale
    return tl.where(ok, s, NEG_INF)


def softmax_fuse_block_sum(attn_weights_slice, reshaped_block_size, segment_size, chunk_start, chunk_end,
                           real_q_len, scale, is_causal=True):
    x = _last_dim_dense(attn_weights_slice)
    b, h, rows, cols = x.shape
    rbs = reshaped_block_size
    if rows % rbs or cols % rbs or segment_size % rbs or segment_size <= 0 or rbs & (rbs - 1) \
            or segment_size & (segment_size - 1):
        raise ValueError(f"rows {rows}, cols {cols} and segment_size {segment_size} must be multiples of "
                         f"reshaped_block_size {rbs}; rbs and segment_size must be powers of two")
    if chunk_end - chunk_start != rows or chunk_start < 0:
        raise ValueError(f"chunk [{chunk_start}, {chunk_end}) must span the {rows} rows")
    out = torch.zeros(b, h, rows // rbs, cols // rbs, device=x.device, dtype=torch.float32)
    _softmax_block_sum_kernel[(rows // rbs, b * h)](
        x, out, *x.stride()[:3], *out.stride()[:3], h, cols, chunk_start, real_q_len, float(scale),
        RBS=rbs, SEGMENT=segment_size, CAUSAL=is_causal)
    return out


# ----------------------------------------------------------------------------------------------------
# Fused estimator
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _estimate_kernel(Q, K, PART, TMAX, OUT,
                     stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                     stride_pz, stride_pr, stride_tz, stride_tr, stride_ob, stride_oh, stride_oq,
                     H, GROUP, q_first, q_len, k_len, row0, first_row, q_blocks, k_blocks, scale,
                     STRIDE: tl.constexpr, RBS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row of this chunk's scratch
    rows = row0 + local  # absolute reshaped rows
    n_cols = tl.cdiv(k_len, STRIDE)
    hi = n_cols
    if CAUSAL:
        hi = tl.minimum(hi, row0 + pid_m * BLOCK_M + BLOCK_M)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + (h // GROUP) * stride_kh
    p_base = PART + bh * stride_pz + local[:, None] * stride_pr
    t_base = TMAX + bh * stride_tz + local * stride_tr
    NB: tl.constexpr = BLOCK_N // RBS

    # Pass 1: one GEMM sweep, as a single loop over (key tile, stride step) so loads keep streaming across
    # tiles; after a tile's last step, keep its row maxima and per-key-block partial sums, and update the
    # running row max / sum (online softmax).
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for it in range(0, tl.cdiv(hi, BLOCK_N) * STRIDE):
        t = it // STRIDE
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _antidiag_step(acc, q_base, k_base, stride_qt, stride_kt, rows, cols, it % STRIDE, q_first, q_len,
                             k_len, STRIDE, HEAD, HEAD_PAD, DOT_PREC)
        if it % STRIDE == STRIDE - 1:
            ok = (cols < n_cols)[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None])
            s = tl.where(ok, acc * scale, NEG_INF)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            m_t = tl.max(s, axis=1)
            part = _block_partials(s, m_t, RBS)
            tl.store(p_base + t * NB + tl.arange(0, NB)[None, :], part)
            tl.store(t_base + t, m_t)
            m_new = tl.maximum(m_i, m_t)
            m_ref = tl.where(m_new == NEG_INF, 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_ref) + tl.sum(part, axis=1) * tl.exp2(m_t - m_ref)
            m_i = m_new
    # The partials were stored by other threads of this program: make them visible before reading.
    tl.debug_barrier()

    # Pass 2: normalize the partials and sum the rows of each query block. Rows holding no real query
    # (padding onto the block grid) contribute nothing.
    row_ok = (rows * STRIDE + STRIDE - 1 >= q_first) & (rows * STRIDE < k_len)
    inv_l = tl.where(row_ok & (l_i > 0), 1.0 / l_i, 0.0)
    m_ref = tl.where(m_i == NEG_INF, 0.0, m_i)
    qb = (row0 - first_row + pid_m * BLOCK_M) // RBS + tl.arange(0, BLOCK_M // RBS)
    o_base = OUT + b * stride_ob + h * stride_oh + qb[:, None] * stride_oq
    for t in range(0, tl.cdiv(hi, BLOCK_N)):
        part = tl.load(p_base + t * NB + tl.arange(0, NB)[None, :])
        w = part * (tl.exp2(tl.load(t_base + t) - m_ref) * inv_l)[:, None]
        sums = tl.sum(tl.reshape(w, [BLOCK_M // RBS, RBS, NB]), axis=1)
        kb = t * NB + tl.arange(0, NB)
        tl.store(o_base + kb[None, :], sums, mask=(qb < q_blocks)[:, None] & (kb < k_blocks)[None, :])


def block_sums(query, key, block_size, stride, chunk_size, causal):
    """``(sums, first_q_block)`` as ``reference.block_sums`` defines them."""
    b, h, hkv, q_len, k_len, d = ref.check_qkv(query, key)
    ref.check_estimate_args(block_size, stride, chunk_size)
    first, q_blocks, k_blocks = ref.block_layout(q_len, k_len, block_size)
    q, k = _last_dim_dense(query), _last_dim_dense(key)
    rbs = block_size // stride
    cfg = GPU_CONFIG if q.is_cuda else CPU_CONFIG
    block_m, block_n = max(rbs, cfg["block_m"]), max(rbs, cfg["block_n"])
    total_rows = q_blocks * rbs
    chunk_rows = min(triton.cdiv(max(chunk_size // stride, 1), block_m) * block_m,
                     triton.cdiv(total_rows, block_m) * block_m)
    n_tiles = triton.cdiv(triton.cdiv(k_len, stride), block_n)
    part = torch.empty(b * h, chunk_rows, n_tiles * (block_n // rbs), device=q.device, dtype=torch.float32)
    tmax = torch.empty(b * h, chunk_rows, n_tiles, device=q.device, dtype=torch.float32)
    out = torch.zeros(b, h, q_blocks, k_blocks, device=q.device, dtype=torch.float32)
    for r0 in range(0, total_rows, chunk_rows):
        grid = (triton.cdiv(min(chunk_rows, total_rows - r0), block_m), b * h)
        _estimate_kernel[grid](
            q, k, part, tmax, out, *q.stride()[:3], *k.stride()[:3], *part.stride()[:2], *tmax.stride()[:2],
            *out.stride()[:3], h, h // hkv, k_len - q_len, q_len, k_len, first * rbs + r0, first * rbs,
            q_blocks, k_blocks, ref.estimate_scale(d, stride), STRIDE=stride, RBS=rbs, HEAD=d,
            HEAD_PAD=_head_pad(d), BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
            DOT_PREC=_dot_precision(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, first


@triton.jit
def _select_kernel(SUMS, THR, MASK, stride_sz, stride_sq, stride_mz, stride_mq, first, k_blocks,
                   KB_PAD: tl.constexpr, CAUSAL: tl.constexpr):
    """One query block's row of ``reference.select_blocks``. Instead of sorting, it finds the largest mass t
    such that the forced blocks plus every candidate of mass >= t reach the goal, by bisection on the bits
    of t (non-negative floats order like their int32 bits, so 31 steps are exact); the blocks of mass >= t
    are then exactly the sorted rule's choice, ties included."""
    j, bh = tl.program_id(0), tl.program_id(1)
    kb = tl.arange(0, KB_PAD)
    visible = kb < k_blocks
    if CAUSAL:
        visible = visible & (kb <= first + j)
    v = tl.load(SUMS + bh * stride_sz + j * stride_sq + kb, mask=visible, other=0.0)
    forced = visible & ((kb == 0) | (kb == first + j))
    thr = tl.load(THR + bh)
    goal = thr * tl.sum(v, axis=0)
    kept = tl.sum(tl.where(forced, v, 0.0), axis=0)
    bits = tl.where(forced, -1, tl.where(visible, v.to(tl.int32, bitcast=True), -1))
    lo = 0  # the answer: candidates with bits >= lo join (all of them if even that falls short of the goal)
    hi = 0x7F800001  # past +inf: nothing joins
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        if kept + tl.sum(tl.where(bits >= mid, v, 0.0), axis=0) >= goal:
            lo = mid
        else:
            hi = mid
    if thr >= 1.0:
        lo = 0  # every visible block, whatever the rounding of the sums
    keep = forced | (bits >= lo)
    tl.store(MASK + bh * stride_mz + j * stride_mq + kb, keep.to(tl.int8), mask=kb < k_blocks)


def select_blocks(block_sums, first_q_block, threshold, causal=True):
    """``reference.select_blocks`` as one Triton program per query block (no sort)."""
    b, h, q_blocks, k_blocks = block_sums.shape
    sums = block_sums.float().reshape(b * h, q_blocks, k_blocks)
    thr = ref._thresholds(threshold, b, h, sums.device).reshape(b * h).contiguous()
    mask = torch.empty(b, h, q_blocks, k_blocks, dtype=torch.bool, device=sums.device)
    flat = mask.view(torch.int8).view(b * h, q_blocks, k_blocks)
    _select_kernel[(q_blocks, b * h)](sums, thr, flat, sums.stride(0), sums.stride(1), flat.stride(0),
                                      flat.stride(1), first_q_block, k_blocks,
                                      KB_PAD=_pow2(k_blocks), CAUSAL=causal)
    visible = ref.visible_blocks(first_q_block, q_blocks, k_blocks, causal, sums.device)
    return mask, ref.density(mask, visible)


def xattn_estimate(query, key, block_size=128, stride=8, threshold=0.9, chunk_size=16384, causal=True):
    sums, first = block_sums(query, key, block_size, stride, chunk_size, causal)
    return select_blocks(sums, first, threshold, causal)


def _last_dim_dense(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _pow2(n):
    return max(16, triton.next_power_of_2(n))


def _head_pad(d):
    return _pow2(d)
