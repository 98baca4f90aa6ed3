"""Fused kernels of the decoder layer: RMSNorm (with the residual add), SiLU-and-mul, and RoPE (with Qwen3's
per-head q/k RMSNorm; optionally writing the rotated k, and v, into the paged cache); and the greedy
sampler's argmax. Each replaces several PyTorch kernels with one pass over memory and needs no host sync and
no data-dependent allocation, so it can be captured in a CUDA graph.

The pagedllm.layers modules call these on CUDA tensors; their PyTorch code is the oracle. The kernels
compute in the same precision and round at the same points: statistics in float32, everything else in
the model dtype. FMA contraction is off (`enable_fp_fusion=False`), so a product followed by a sum is
rounded twice as in PyTorch's separate kernels; RoPE and the residual add then match bit for bit, the
norms (also the q/k norm before RoPE) and SiLU within an ulp (reduction order, rsqrt/exp implementations).
"""
import torch
import triton
import triton.language as tl

from . import _host, pdl
from .cache import store_quantized
from .linear import head_linear, head_supported, split_k_linear, split_k_supported  # noqa: F401  (same switch)
from .paged_tile import cache_offsets, load_scale


@triton.jit
def rms_scale(x, w, rstd):
    # Normalised value rounded to the model dtype before the weight multiply, as HF Llama does.
    return w * (x.to(tl.float32) * rstd).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, residual_out, eps, stride_x, stride_r, stride_part,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if PARTS:
        # x holds a projection's split-K partial sums (linear.split_k_linear): summed in a fixed order and
        # rounded to the model dtype, as F.linear would have returned it.
        acc = tl.zeros([BLOCK], tl.float32)
        for p in tl.static_range(PARTS):
            acc += tl.load(x + p * stride_part + row * stride_x + cols, mask=mask, other=0.0)
        h = acc.to(residual.dtype.element_ty)
    else:
        h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h += tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_out + row * N + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    w = tl.load(weight + cols, mask=mask)
    tl.store(out + row * N + cols, rms_scale(h, w, rstd), mask=mask)


def _rms_norm(rows, weight, eps, residual, parts, stride_part, out_shape, out_dtype):
    n = rows.shape[-1]
    out = torch.empty(out_shape, dtype=out_dtype, device=rows.device)
    block = triton.next_power_of_2(n)
    # One program per row; wider rows get more warps so each thread keeps ~8-16 values in registers.
    launch = dict(N=n, BLOCK=block, PARTS=parts, num_warps=min(max(block // 256, 1), 16), enable_fp_fusion=False,
                  **pdl.options(rows))
    if residual is None:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, eps, rows.stride(0), 0, stride_part,
                                           HAS_RESIDUAL=False, **launch)
        return out
    res = residual.reshape(-1, n)
    res_out = torch.empty_like(out)
    _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, res_out, eps, rows.stride(0), res.stride(0),
                                       stride_part, HAS_RESIDUAL=True, **launch)
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim: norm(x), or with residual (norm(x + residual), x + residual) in new
    tensors. Rows may be strided; each row must be contiguous."""
    return _rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, residual, 0, 0, x.shape, x.dtype)


def rms_norm_split_k(partials: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor):
    """rms_norm(x, weight, eps, residual) where x is given as float32 split-K partial sums [parts, rows, N]
    (linear.split_k_linear), x = their sum rounded to the residual's dtype; x itself is never written."""
    parts, m, n = partials.shape
    if residual.shape[-1] != n or residual.numel() != m * n:
        raise ValueError(f"rms_norm_split_k: partials of {m} x {n} but a residual of {tuple(residual.shape)}")
    return _rms_norm(partials[0], weight, eps, residual, parts, partials.stride(0), residual.shape, residual.dtype)


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, I: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + I + cols, mask=mask, other=0.0)
    # F.silu computes in float32 and rounds; the multiply is a second op in the model dtype.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out + row * I + cols, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]. Rows may be strided; each row contiguous."""
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * inter)
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, rows.stride(0), I=inter, BLOCK=block, num_warps=4, enable_fp_fusion=False, **pdl.options(x))
    return out


@triton.jit
def head_halves(x, h, d, mask, HALF: tl.constexpr):
    """The heads h at x (one token, contiguous heads of 2 * HALF) as (first halves, second halves) at channels d
    and d + HALF."""
    ptr = x + h * (2 * HALF) + d
    return tl.load(ptr, mask=mask, other=0.0), tl.load(ptr + HALF, mask=mask, other=0.0)


@triton.jit
def rotate_halves(x1, x2, w1, w2, eps, cos, sin, HALF: tl.constexpr, NORM: tl.constexpr):
    """Heads as head_halves gives them rotated neox style, the first half of each head paired with the second.
    NORM: RMSNorm each head first, with the weight's halves w1, w2."""
    if NORM:
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        sum_sq = tl.sum(x1f * x1f, axis=1, keep_dims=True) + tl.sum(x2f * x2f, axis=1, keep_dims=True)
        rstd = tl.rsqrt(sum_sq / (2 * HALF) + eps)
        x1 = rms_scale(x1, w1, rstd)
        x2 = rms_scale(x2, w2, rstd)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def rotated_heads(x, w, eps, cos, sin, h, d, mask, HALF: tl.constexpr, NORM: tl.constexpr):
    """The heads h at x rotated (rotate_halves), with NORM normed by weight w first."""
    x1, x2 = head_halves(x, h, d, mask, HALF)
    w1, w2 = x1, x2
    if NORM:
        w1, w2 = head_halves(w, 0, d, d < HALF, HALF)
    return rotate_halves(x1, x2, w1, w2, eps, cos, sin, HALF, NORM)


@triton.jit
def store_token_kv(key_cache, value_cache, slot, k1, k2, v1, v2, h, d, mask, k_scale, v_scale,
                   stride_kcb, stride_kch, stride_kc2, stride_vcb, stride_vch, stride_vc2,
                   HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr,
                   FP8: tl.constexpr):
    """One token's k and v of kv heads h (as halves at channels d and d + HALF) into its cache slot."""
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k_off = cache_offsets(block, offset, d, h, stride_kcb, stride_kch, stride_kc2, X, LAYOUT, True)
    k_off2 = cache_offsets(block, offset, d + HALF, h, stride_kcb, stride_kch, stride_kc2, X, LAYOUT, True)
    v_off = cache_offsets(block, offset, d, h, stride_vcb, stride_vch, stride_vc2, X, LAYOUT, False)
    v_off2 = cache_offsets(block, offset, d + HALF, h, stride_vcb, stride_vch, stride_vc2, X, LAYOUT, False)
    store_quantized(key_cache + k_off, k1, k_scale, mask, FP8)
    store_quantized(key_cache + k_off2, k2, k_scale, mask, FP8)
    store_quantized(value_cache + v_off, v1, v_scale, mask, FP8)
    store_quantized(value_cache + v_off2, v2, v_scale, mask, FP8)


@triton.jit
def _rope_kernel(q, q_out, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, slot_mapping, num_slots,
                 key_cache, value_cache, k_scale, v_scale,
                 stride_q, stride_qo, stride_k, stride_v, stride_cache,
                 stride_kcb, stride_kch, stride_kc2, stride_vcb, stride_vch, stride_vc2,
                 Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS: tl.constexpr,
                 K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr,
                 CACHE: tl.constexpr, BLOCK_SIZE: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr,
                 FP8: tl.constexpr, SCALE_PTR: tl.constexpr, PDL: tl.constexpr):
    """q rotated into q_out (q itself: in place). k: rotated in place, or with CACHE rotated straight into the
    paged key cache while v is copied into the value cache (what reshape_and_cache does with the rotated k)."""
    pdl.start(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    row = cos_sin_cache + pos * stride_cache + d
    # The cache is float32; like the PyTorch layer, round cos/sin to the model dtype before using them.
    cos = tl.load(row, mask=d < HALF).to(q.dtype.element_ty)
    sin = tl.load(row + HALF, mask=d < HALF).to(q.dtype.element_ty)
    hq = tl.arange(0, Q_HEADS_PAD)[:, None]
    q_mask = (hq < Q_HEADS) & (d < HALF)
    q1, q2 = rotated_heads(q + token * stride_q, q_weight, eps, cos, sin, hq, d, q_mask, HALF, NORM)
    q_ptr = q_out + token * stride_qo + hq * (2 * HALF) + d
    tl.store(q_ptr, q1, mask=q_mask)
    tl.store(q_ptr + HALF, q2, mask=q_mask)
    hk = tl.arange(0, K_HEADS_PAD)[:, None]
    k_mask = (hk < K_HEADS) & (d < HALF)
    if not CACHE:
        k1, k2 = rotated_heads(k + token * stride_k, k_weight, eps, cos, sin, hk, d, k_mask, HALF, NORM)
        k_ptr = k + token * stride_k + hk * (2 * HALF) + d
        tl.store(k_ptr, k1, mask=k_mask)
        tl.store(k_ptr + HALF, k2, mask=k_mask)
    else:
        # Tokens past the slot mapping, and slots of -1, are padding: nothing goes into the cache.
        slot = tl.load(slot_mapping + token, mask=token < num_slots, other=-1).to(tl.int64)
        if slot >= 0:
            k1, k2 = rotated_heads(k + token * stride_k, k_weight, eps, cos, sin, hk, d, k_mask, HALF, NORM)
            v_ptr = v + token * stride_v + hk * (2 * HALF) + d
            v1 = tl.load(v_ptr, mask=k_mask)
            v2 = tl.load(v_ptr + HALF, mask=k_mask)
            k_scale_val = 1.0
            v_scale_val = 1.0
            if FP8 != 0:
                k_scale_val = load_scale(k_scale, SCALE_PTR)
                v_scale_val = load_scale(v_scale, SCALE_PTR)
            store_token_kv(key_cache, value_cache, slot, k1, k2, v1, v2, hk, d, k_mask, k_scale_val, v_scale_val,
                           stride_kcb, stride_kch, stride_kc2, stride_vcb, stride_vch, stride_vc2,
                           HALF, BLOCK_SIZE, X, LAYOUT, FP8)


def _rope(positions, q, k, head_size, cos_sin_cache, qk_norm, v=None, cache=None, q_out=None):
    """cache: (key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale) or None."""
    q_out = q if q_out is None else q_out.view(q.shape)
    q_heads, k_heads = q.shape[-1] // head_size, k.shape[-1] // head_size
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # dummies, never read
    half = head_size // 2
    tile = triton.next_power_of_2(max(q_heads, k_heads)) * triton.next_power_of_2(half)
    if cache is None:  # CACHE=False: the cache arguments are dummies, never read
        v, key_cache, value_cache, slot_mapping = q, q, q, positions
        layout, block_size, x, fp8, k_scale, v_scale, scale_ptr = 1, 1, 1, 0, 1.0, 1.0, False
        cache_strides = (0,) * 6
    else:
        key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale = cache
        layout, block_size, x = _host.cache_layout(key_cache, value_cache)
        fp8 = _host.fp8_kind(kv_cache_dtype)
        k_scale, v_scale, scale_ptr = _host.scale_args(k_scale, v_scale)
        cache_strides = (*key_cache.stride()[:3], *value_cache.stride()[:3])
    _rope_kernel[(q.shape[0],)](
        q, q_out, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, slot_mapping, slot_mapping.shape[0],
        key_cache, value_cache, k_scale, v_scale,
        q.stride(0), q_out.stride(0), k.stride(0), v.stride(0), cos_sin_cache.stride(0), *cache_strides,
        Q_HEADS=q_heads, Q_HEADS_PAD=triton.next_power_of_2(q_heads),
        K_HEADS=k_heads, K_HEADS_PAD=triton.next_power_of_2(k_heads), HALF=half,
        HALF_PAD=triton.next_power_of_2(half), NORM=qk_norm is not None, CACHE=cache is not None,
        BLOCK_SIZE=block_size, X=x, LAYOUT=layout, FP8=fp8, SCALE_PTR=scale_ptr,
        num_warps=min(max(tile // 256, 1), 8), enable_fp_fusion=False, **pdl.options(q))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
                     cos_sin_cache: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """Neox-style RoPE of q [T, H*D] and k [T, Hkv*D] in place, cos/sin from rows `positions` [T] of
    cos_sin_cache [max_position, D] ([cos | sin], float32). qk_norm = (q weight, k weight, eps): RMSNorm
    each head first (Qwen3). q and k may be strided views of one qkv tensor; each row contiguous."""
    _rope(positions, q, k, head_size, cos_sin_cache, qk_norm)


def rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_size: int,
                   cos_sin_cache: torch.Tensor, qk_norm, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale, v_scale,
                   q_out: torch.Tensor | None = None) -> None:
    """rotary_embedding of q (in place, or into q_out: T rows of H*D, each row contiguous), with the rotated
    k and v [T, Hkv*D] written straight into the paged caches (either layout, fp8 included) as
    reshape_and_cache would: one kernel instead of two, and the rotated k is never written back. k is left
    as it was; tokens past slot_mapping or at slot -1 are padding."""
    _rope(positions, q, k, head_size, cos_sin_cache, qk_norm, v,
          (key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale), q_out)


@triton.jit
def argmax_key(value, index):
    """int64 keys ordered as (value, -index), for float32 values that are not NaN: the largest key over a row's
    chunks is the first index of its largest value, so that the argmax of the chunks reads one array, one load
    instead of a load and then a second one at the winner's index. -0.0 is keyed as 0.0 (they compare equal)."""
    bits = tl.where(value == 0.0, 0.0, value).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # the floats' order, as signed integers
    return (ordered.to(tl.int64) << 32) | (tl.full([], 0xFFFFFFFF, tl.int64) - index)


@triton.jit
def _argmax_chunk_kernel(x, keys, N, stride_x, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(x + row * stride_x + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
    best = tl.argmax(v, axis=0, tie_break_left=True)
    tl.store(keys + row * tl.num_programs(1) + chunk, argmax_key(tl.max(v, axis=0), chunk * CHUNK + best))


@triton.jit
def _argmax_rows_kernel(keys, out, num_chunks, host, host_slot, stride_host, reset, BLOCK: tl.constexpr,
                        HOST: tl.constexpr, RESET: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    if RESET:  # once the kernel before, which read them, has completed
        tl.store(reset + tl.arange(0, RESET), float("-inf"))
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    key = tl.max(tl.load(keys + row * num_chunks + c, mask=c < num_chunks, other=-2 ** 63), axis=0)
    low = tl.full([], 0xFFFFFFFF, tl.int64)
    token = low - (key & low)
    tl.store(out + row, token)
    if HOST:
        tl.store(host + tl.load(host_slot) * stride_host + row, token)


ARGMAX_CHUNK = 8192  # fastest from 64 rows up; within 0.2 us of 4096 below (H100)


def argmax(x: torch.Tensor, out: torch.Tensor | None = None, host: torch.Tensor | None = None,
           host_slot: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, N] -> int64 [rows] (into out where given): the first index of each row's maximum, as
    torch.argmax(x, -1) (rows holding NaN excepted). Every row is cut into chunks reduced in parallel and then
    combined: torch's kernel reduces a row in few blocks, slow for one row of a 150K vocabulary and half the copy
    bandwidth for a few hundred. host (int64 [slots, >= rows], pinned) and host_slot (int64 [1] on x's device):
    the ids are also written into row host_slot[0] of host, which the host then reads without a copy (a slot
    chosen at run time, so that a CUDA graph can write a different one at each replay)."""
    rows, n = x.shape
    if x.stride(1) != 1:
        raise ValueError("argmax needs rows with unit stride")
    num_chunks = triton.cdiv(n, ARGMAX_CHUNK)
    keys = torch.empty(rows, num_chunks, dtype=torch.int64, device=x.device)
    _argmax_chunk_kernel[(rows, num_chunks)](x, keys, n, x.stride(0), CHUNK=ARGMAX_CHUNK, num_warps=8,
                                            **pdl.options(x))
    return argmax_of_chunks(keys, out, host, host_slot)


def argmax_of_chunks(keys: torch.Tensor, out: torch.Tensor | None = None, host: torch.Tensor | None = None,
                     host_slot: torch.Tensor | None = None, reset: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's token from its chunks' argmax_keys (int64 [rows, chunks]), into out and host as argmax writes
    them. reset (float32 [a power of two]): set to -inf, for the kernels before that raise it by atomics
    (greedy_head)."""
    rows, num_chunks = keys.shape
    if (host is None) != (host_slot is None) or host is not None and (
            host.dim() != 2 or host.shape[1] < rows or host.stride(1) != 1 or host.dtype != torch.int64):
        raise ValueError("argmax: host must be int64 [slots, >= rows] with unit-stride rows, given with host_slot")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=keys.device)
    _argmax_rows_kernel[(rows,)](keys, out, num_chunks, out if host is None else host,
                                 out if host_slot is None else host_slot, 0 if host is None else host.stride(0),
                                 keys if reset is None else reset, BLOCK=_host.pow2_at_least(num_chunks),
                                 HOST=host is not None, RESET=0 if reset is None else reset.numel(), num_warps=1,
                                 **pdl.options(keys))
    return out
