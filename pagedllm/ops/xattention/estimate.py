"""Triton kernels of XAttention's block estimation.

`flat_group_gemm_fuse_reshape` and `softmax_fuse_block_sum` are the seed's two stages, kept as separate ops
(tests, experiments). `xattn_estimate` fuses them: one program owns BLOCK_M reshaped query rows and sweeps
their causal key range once, computing each antidiagonal score tile on tensor cores and immediately reducing
it to per-row, per-key-block partial sums ``sum exp2(s - m_tile)`` plus the tile's row max (a few KB of
scratch per tile instead of the [q/stride, k/stride] score matrix). Once the row's final max and sum are
known, the same program rescales its partials into normalized block sums: the strided GEMM runs once, and
no score matrix ever reaches memory. Q and K are read through TMA tensor descriptors that see each head's
tokens ``[len, D]`` as ``[len / stride, stride * D]``, so each stride step of a tile is one box load (GQA by
head index; out-of-range tokens load as zeros). A token-padded copy is made only when a head's tokens are
not contiguous (the engine's packed query), a length or the queries' offset is not a multiple of the stride,
a stride breaks TMA's 16-byte alignment, or the head is not a multiple of 16 channels. `select_blocks` then
picks each query block's key blocks in one program per row, by bisection instead of a sort.

``fp8_estimate``: a small kernel first rounds Q and K to e4m3 with one scale per reshaped row (reference.fp8_rows),
and the GEMM runs on e4m3 tiles (twice the channels a step at the same bytes), each score tile scaled by its rows'
and columns' scales. The estimator is bound by moving its tiles into the SMs, so this cut its time by ~30% on the
H100. Hopper's fp8 MMAs add into their accumulator keeping ~14 bits, so the sums follow exact fp8 math to ~3e-2;
summing every step's products in fp32 (``max_num_imprecise_acc``) made it no faster than bf16 (results README).
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import reference as ref

NEG_INF = tl.constexpr(float("-inf"))
FP8_MAX = tl.constexpr(ref.FP8_MAX)
# Fused estimator tiles (reshaped rows x reshaped keys, head-dim chunk) and launch shape. On the H100 at 64K
# (32/8 heads, head 128): 5.4 ms (400 TFLOP/s) at stride 8 and 3.0 ms at 16, where the pointer-load kernel
# with 128 x 128 tiles took 7.3 / 4.7 (results README). The interpreter (CPU tests) uses small tiles so small
# test shapes still span several tiles.
GPU_CONFIG = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)
CPU_CONFIG = dict(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=1)


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 tests must not drop to tf32 on the GPU


@triton.jit
def _antidiag_step(acc, q_desc, k_desc, b, h, kvh, q_row, k_row, it, STRIDE: tl.constexpr, HEAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc += chunk ``it`` (stride step s = it // (HEAD / BLOCK_K), then a BLOCK_K slice of the head) of the
    antidiagonal sums: reshaped Q row r takes token r*STRIDE + STRIDE-1-s of its tensor, reshaped K row c
    token c*STRIDE + s. Rows are descriptor rows (``[B, heads, len / STRIDE, STRIDE * D]``); outside, zeros."""
    D_STEPS: tl.constexpr = HEAD // BLOCK_K
    s = it // D_STEPS
    kk = (it % D_STEPS) * BLOCK_K
    q = q_desc.load([b, h, q_row, (STRIDE - 1 - s) * HEAD + kk]).reshape(BLOCK_M, BLOCK_K)
    k = k_desc.load([b, kvh, k_row, s * HEAD + kk]).reshape(BLOCK_N, BLOCK_K)
    return tl.dot(q, k.T, acc, input_precision=DOT_PREC)


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
def _gemm_kernel(q_desc, k_desc, OUT, stride_ob, stride_oh, stride_or, H, GROUP, q_rows, k_rows, chunk_start,
                 STRIDE: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if CAUSAL and pid_n * BLOCK_N > chunk_start + pid_m * BLOCK_M + BLOCK_M - 1:
        return  # the whole tile is hidden; its entries may hold anything
    b, h = bh // H, bh % H
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for it in range(STRIDE * (HEAD // BLOCK_K)):
        s = _antidiag_step(s, q_desc, k_desc, b, h, h // GROUP, pid_m * BLOCK_M, pid_n * BLOCK_N, it, STRIDE, HEAD,
                           BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < q_rows)[:, None] & (cols < k_rows)[None, :]
    tl.store(OUT + b * stride_ob + h * stride_oh + rows[:, None] * stride_or + cols[None, :],
             s.to(OUT.dtype.element_ty), mask=ok)


def flat_group_gemm_fuse_reshape(query_states, key_states, stride, chunk_start, chunk_end, is_causal=True):
    ref._check_gemm_args(query_states, key_states, stride, chunk_start, chunk_end)
    q, k = _tma_tokens(query_states, 0, stride), _tma_tokens(key_states, 0, stride)
    b, h, q_len, d = q.shape  # d: the head padded to a multiple of 16
    hkv, k_len = k.shape[1], k.shape[2]
    out = torch.empty(b, h, q_len // stride, k_len // stride, device=q.device, dtype=q.dtype)
    block, block_k = 64, _block_k(d)
    grid = (triton.cdiv(q_len // stride, block), triton.cdiv(k_len // stride, block), b * h)
    _gemm_kernel[grid](_strided_desc(q, stride, block, block_k), _strided_desc(k, stride, block, block_k), out,
                       *out.stride()[:3], h, h // hkv, q_len // stride, k_len // stride, chunk_start,
                       STRIDE=stride, HEAD=d, BLOCK_M=block, BLOCK_N=block, BLOCK_K=block_k, CAUSAL=is_causal,
                       DOT_PREC=_dot_precision(q.dtype))
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
def _estimate_kernel(q_desc, k_desc, Q_SCALE, K_SCALE, PART, TMAX, OUT, stride_pz, stride_pr, stride_tz, stride_tr,
                     stride_ob, stride_oh, stride_oq, H, GROUP, q_row0, q_first, k_len, row0, first_row, q_blocks,
                     k_blocks, q_scale_rows, scale, STRIDE: tl.constexpr, RBS: tl.constexpr, HEAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
                     DOT_PREC: tl.constexpr, FP8: tl.constexpr):
    """FP8: q_desc / k_desc read e4m3 tokens whose reshaped rows carry the scales Q_SCALE / K_SCALE (_fp8_tokens);
    each score tile is scaled by its rows' and columns' scales once its GEMM is done."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row of this chunk's scratch
    rows = row0 + local  # absolute reshaped rows; Q's descriptor row 0 is absolute row q_row0
    n_cols = tl.cdiv(k_len, STRIDE)
    hi = n_cols
    if CAUSAL:
        hi = tl.minimum(hi, row0 + pid_m * BLOCK_M + BLOCK_M)
    p_base = PART + bh * stride_pz + local[:, None] * stride_pr
    t_base = TMAX + bh * stride_tz + local * stride_tr
    NB: tl.constexpr = BLOCK_N // RBS
    K_STEPS: tl.constexpr = STRIDE * (HEAD // BLOCK_K)

    # Pass 1: one GEMM sweep, as a single loop over (key tile, stride step, head chunk) so loads keep streaming
    # across tiles; after a tile's last chunk, keep its row maxima and per-key-block partial sums, and update
    # the running row max / sum (online softmax).
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if FP8:
        q_row = rows - q_row0  # rows before the descriptor's first are zeros whatever their scale
        q_scale = tl.load(Q_SCALE + bh * q_scale_rows + q_row, mask=(q_row >= 0) & (q_row < q_scale_rows), other=0.0)
    for it in range(0, tl.cdiv(hi, BLOCK_N) * K_STEPS):
        t = it // K_STEPS
        acc = _antidiag_step(acc, q_desc, k_desc, b, h, h // GROUP, row0 + pid_m * BLOCK_M - q_row0, t * BLOCK_N,
                             it % K_STEPS, STRIDE, HEAD, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        if it % K_STEPS == K_STEPS - 1:
            cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = (cols < n_cols)[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None])
            if FP8:
                k_scale = tl.load(K_SCALE + (bh // H * (H // GROUP) + h // GROUP) * n_cols + cols, mask=cols < n_cols,
                                  other=0.0)
                acc = acc * q_scale[:, None] * k_scale[None, :]
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


def block_sums(query, key, block_size, stride, chunk_size, causal, fp8_estimate=False):
    """``(sums, first_q_block)`` as ``reference.block_sums`` defines them."""
    b, h, hkv, q_len, k_len, d = ref.check_qkv(query, key)
    ref.check_estimate_args(block_size, stride, chunk_size)
    first, q_blocks, k_blocks = ref.block_layout(q_len, k_len, block_size)
    q_first = k_len - q_len
    # query token 0 then sits at absolute reshaped row q_row0
    if fp8_estimate:
        (q, q_scale), (k, k_scale) = _fp8_tokens(query, q_first % stride, stride), _fp8_tokens(key, 0, stride)
    else:
        q, k = _tma_tokens(query, q_first % stride, stride), _tma_tokens(key, 0, stride)
        q_scale = k_scale = q  # never read without FP8
    d_pad = q.shape[-1]
    rbs = block_size // stride
    cfg = GPU_CONFIG if q.is_cuda else CPU_CONFIG
    block_m, block_n = max(rbs, cfg["block_m"]), max(rbs, cfg["block_n"])
    if block_m > 256 or block_n > 256:
        raise ValueError(f"block_size / stride = {rbs} reshaped rows per block; a TMA box holds at most 256")
    # fp8 steps twice the channels, so a stage holds the same bytes (and the GEMM steps 32 channels at least)
    block_k = min(cfg["block_k"] * (2 if fp8_estimate else 1), _block_k(d_pad, 128))
    total_rows = q_blocks * rbs
    chunk_rows = min(triton.cdiv(max(chunk_size // stride, 1), block_m) * block_m,
                     triton.cdiv(total_rows, block_m) * block_m)
    n_tiles = triton.cdiv(triton.cdiv(k_len, stride), block_n)
    part = torch.empty(b * h, chunk_rows, n_tiles * (block_n // rbs), device=q.device, dtype=torch.float32)
    tmax = torch.empty(b * h, chunk_rows, n_tiles, device=q.device, dtype=torch.float32)
    out = torch.zeros(b, h, q_blocks, k_blocks, device=q.device, dtype=torch.float32)
    q_desc = _strided_desc(q, stride, block_m, block_k)
    k_desc = _strided_desc(k, stride, block_n, block_k)
    for r0 in range(0, total_rows, chunk_rows):
        grid = (triton.cdiv(min(chunk_rows, total_rows - r0), block_m), b * h)
        _estimate_kernel[grid](
            q_desc, k_desc, q_scale, k_scale, part, tmax, out, *part.stride()[:2], *tmax.stride()[:2],
            *out.stride()[:3], h, h // hkv, q_first // stride, q_first, k_len, first * rbs + r0, first * rbs, q_blocks,
            k_blocks, q.shape[2] // stride, ref.estimate_scale(d, stride), STRIDE=stride, RBS=rbs, HEAD=d_pad,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, CAUSAL=causal, DOT_PREC=_dot_precision(q.dtype),
            FP8=fp8_estimate, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, first


@triton.jit
def _select_kernel(SUMS, THR, MASK, KEPT, stride_sz, stride_sq, stride_mz, stride_mq, first, k_blocks,
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
    tl.atomic_add(KEPT, tl.sum(keep.to(tl.int64), axis=0))


def select_blocks(block_sums, first_q_block, threshold, causal=True):
    """``reference.select_blocks`` as one Triton program per query block (no sort). The programs count the
    blocks they keep, so the density costs no pass over the mask (nor the launches of one)."""
    b, h, q_blocks, k_blocks = block_sums.shape
    sums = block_sums.float().reshape(b * h, q_blocks, k_blocks)
    thr = ref._thresholds(threshold, b, h, sums.device).reshape(b * h).contiguous()
    mask = torch.empty(b, h, q_blocks, k_blocks, dtype=torch.bool, device=sums.device)
    kept = torch.zeros((), dtype=torch.int64, device=sums.device)
    flat = mask.view(torch.int8).view(b * h, q_blocks, k_blocks)
    _select_kernel[(q_blocks, b * h)](sums, thr, flat, kept, sums.stride(0), sums.stride(1), flat.stride(0),
                                      flat.stride(1), first_q_block, k_blocks,
                                      KB_PAD=_pow2(k_blocks), CAUSAL=causal)
    return mask, kept / (ref.visible_count(first_q_block, q_blocks, k_blocks, causal) * b * h)


def xattn_estimate(query, key, block_size=128, stride=8, threshold=0.9, chunk_size=16384, causal=True,
                   share_kv_heads=False, fp8_estimate=False):
    sums, first = block_sums(query, key, block_size, stride, chunk_size, causal, fp8_estimate)
    if share_kv_heads:
        sums = ref.kv_head_sums(sums, key.shape[1])
    return select_blocks(sums, first, threshold, causal)


def _last_dim_dense(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _tma_tokens(x, front, stride):
    """x ``[B, heads, n, D]`` as the estimator's strided descriptor reads it: ``front`` zero tokens before it
    and zeros after up to a multiple of stride, each head's tokens contiguous, the head padded with zero
    channels to a multiple of 16 (a 16-bit tensor-core step; zeros add nothing to the scores), 16-byte
    aligned. A copy only when x is not already so."""
    b, h, n, d = x.shape
    total = triton.cdiv(front + n, stride) * stride
    d_pad = triton.cdiv(d, 16) * 16
    if front == 0 and total == n and d == d_pad and x.stride(2) == d and _tma_aligned(x):
        return x
    out = x.new_zeros(b, h, total, d_pad)
    out[:, :, front:front + n, :d] = x
    return out


@triton.jit
def _e4m3_grid(y):
    """y (|y| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still in float32: the conversion
    that follows is then exact. (The Triton interpreter's own conversion rounds some values wrongly, e.g. 125.9
    to 64 and subnormals down, so the CPU tests could not check the kernel against torch's rounding.)"""
    exp = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, -6) - 3  # 3 mantissa bits; subnormals below 2^-6
    to_ulps = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 + ulp_exp) << 23).to(tl.float32, bitcast=True)
    # adding 1.5 * 2^23 rounds to an integer, ties to even (y * to_ulps is exact, so an FMA changes nothing)
    return ((y * to_ulps + 12582912.0) - 12582912.0) * ulp


@triton.jit
def _fp8_rows_kernel(X, OUT, SCALE, stride_xb, stride_xh, stride_xt, H, n, front, n_rows, STRIDE: tl.constexpr,
                     D: tl.constexpr, D_OUT: tl.constexpr, D_P2: tl.constexpr, ROWS: tl.constexpr):
    """ROWS reshaped rows of one head of X as reference.fp8_rows rounds them: e4m3 values into OUT
    ``[B, H, n_rows * STRIDE, D_OUT]`` (zeros past D) and each row's scale into SCALE ``[B, H, n_rows]``."""
    pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    r = pid * ROWS + tl.arange(0, ROWS)
    t = r[:, None, None] * STRIDE + tl.arange(0, STRIDE)[None, :, None]  # padded token
    d = tl.arange(0, D_P2)[None, None, :]
    src = t - front
    x = tl.load(X + (bh // H) * stride_xb + (bh % H) * stride_xh + src.to(tl.int64) * stride_xt + d,
                mask=(src >= 0) & (src < n) & (d < D), other=0.0).to(tl.float32)
    scale = tl.max(tl.max(tl.abs(x), axis=2), axis=1) * (1.0 / FP8_MAX)  # as reference.fp8_rows computes it
    scale = tl.where(scale > 0, scale, 1.0)
    row_ok = r < n_rows
    e4m3 = _e4m3_grid(tl.div_rn(x, scale[:, None, None])).to(tl.float8e4nv)
    tl.store(OUT + (bh * n_rows * STRIDE + t) * D_OUT + d, e4m3, mask=row_ok[:, None, None] & (d < D_OUT))
    tl.store(SCALE + bh * n_rows + r, scale, mask=row_ok)


def _fp8_tokens(x, front, stride):
    """``(tokens, scales)``: x ``[B, heads, n, D]`` laid out as _tma_tokens lays it out (head padded to 32
    channels, an e4m3 GEMM step) in float8_e4m3fn, and the float32 scale of each reshaped row ``[B, heads,
    rows]`` (reference.fp8_rows)."""
    b, h, n, d = x.shape
    n_rows = triton.cdiv(front + n, stride)
    d_pad = triton.cdiv(d, 32) * 32
    out = torch.empty(b, h, n_rows * stride, d_pad, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(b, h, n_rows, device=x.device, dtype=torch.float32)
    rows = triton.next_power_of_2(max(1, 4096 // (stride * d_pad)) + 1) // 2  # ~4K elements a program
    _fp8_rows_kernel[(triton.cdiv(n_rows, rows), b * h)](
        x, out, scales, *x.stride()[:3], h, n, front, n_rows, STRIDE=stride, D=d, D_OUT=d_pad,
        D_P2=triton.next_power_of_2(d_pad), ROWS=rows)
    return out, scales


def _tma_operand(x):
    """x itself when a TMA descriptor can read it (unit last stride, 16-byte aligned base and strides), else a
    contiguous copy."""
    if _tma_aligned(x):
        return x
    if x.shape[-1] * x.element_size() % 16:
        raise ValueError(f"head size {x.shape[-1]} of {x.dtype} is not a multiple of 16 bytes, which TMA needs")
    return x.contiguous()


def _tma_aligned(x):
    size = x.element_size()
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in x.stride()[:-1])


def _strided_desc(x, stride, rows, block_k):
    """TMA descriptor of x ``[B, heads, n, D]`` (each head's n tokens contiguous, n a multiple of stride) as
    ``[B, heads, n / stride, stride * D]``: a box is ``rows`` reshaped rows of one stride step's ``block_k``
    head columns. (Seen as ``[.., stride, n / stride, D]`` the same boxes ran at half the speed at stride 16.)"""
    b, h, n, d = x.shape
    return TensorDescriptor(x, [b, h, n // stride, stride * d], [x.stride(0), x.stride(1), stride * d, 1],
                            [1, 1, rows, block_k])


def _block_k(d, most=64):
    """Head-dim chunk of one GEMM step: the largest power of two dividing d (a multiple of 16), at most `most`."""
    return min(most, d & -d)


def _pow2(n):
    return max(16, triton.next_power_of_2(n))


def _head_pad(d):
    return _pow2(d)
