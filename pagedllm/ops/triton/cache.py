"""reshape_and_cache: scatter new keys/values [num_tokens, num_kv_heads, head_size] into the paged caches
(either layout of `_host.cache_layout`), quantising to fp8 bits of x/scale when the cache is fp8.
Grid: (num_slots, num_kv_heads)."""
import triton
import triton.language as tl

from pagedllm.ops import reference

from . import _host
from .paged_tile import _to_compute, cache_offsets, load_scale


@triton.jit
def store_quantized(ptr, x, scale, mask, FP8: tl.constexpr):
    if FP8 == 0:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
    else:
        # Saturate like the reference instead of overflowing to inf/NaN, then store the raw bits
        # (the cache is uint8, or a torch float8 tensor of the same format). A NaN stays NaN, as in the reference:
        # not the largest finite value a plain min/max makes of it.
        y = x.to(tl.float32) / scale
        if FP8 == 1:
            y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)
        else:
            y = tl.clamp(y, -57344.0, 57344.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e5)
        tl.store(ptr, y.to(ptr.dtype.element_ty, bitcast=True), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kch, stride_kc2, stride_vcb, stride_vch, stride_vc2,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, X: tl.constexpr,
    LAYOUT: tl.constexpr, FP8: tl.constexpr, SCALE_PTR: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return  # padding token
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    k = tl.load(key + token * stride_kt + head * stride_kh + d, mask=d_ok)
    v = tl.load(value + token * stride_vt + head * stride_vh + d, mask=d_ok)
    k_scale_val = 1.0
    v_scale_val = 1.0
    if FP8 != 0:
        k_scale_val = load_scale(k_scale, SCALE_PTR)
        v_scale_val = load_scale(v_scale, SCALE_PTR)
    k_ptr = key_cache + cache_offsets(block, offset, d, head, stride_kcb, stride_kch, stride_kc2, X, LAYOUT, True)
    v_ptr = value_cache + cache_offsets(block, offset, d, head, stride_vcb, stride_vch, stride_vc2, X, LAYOUT, False)
    store_quantized(k_ptr, k, k_scale_val, d_ok, FP8)
    store_quantized(v_ptr, v, v_scale_val, d_ok, FP8)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    # the kernel indexes with these shapes unchecked: a wrong one would write out of bounds
    reference.check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    layout, block_size, x = _host.cache_layout(key_cache, value_cache)
    num_slots = slot_mapping.shape[0]  # may be shorter than key (trailing padding tokens are ignored)
    if num_slots == 0:
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    k_scale, v_scale, scale_ptr = _host.scale_args(k_scale, v_scale)
    _reshape_and_cache_kernel[(num_slots, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HEAD_SIZE=head_size, HEAD_PAD=_host.pow2_at_least(head_size, 16), BLOCK_SIZE=block_size,
        X=x, LAYOUT=layout, FP8=_host.fp8_kind(kv_cache_dtype), SCALE_PTR=scale_ptr, num_warps=1,
    )


@triton.jit
def _gather_one(cache, dst, page, t, d, head, scale, cached, out, out_ok, stride_b, stride_h, stride_2,
                BLOCK_SIZE: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr, FP8: tl.constexpr,
                SCALE_PTR: tl.constexpr, IS_KEY: tl.constexpr):
    off = cache_offsets(page, (t % BLOCK_SIZE)[:, None], d[None, :], head, stride_b, stride_h, stride_2, X, LAYOUT,
                        IS_KEY)
    x = _to_compute(tl.load(cache + off, mask=cached, other=0), tl.float32, FP8)
    if FP8 != 0:
        x = x * load_scale(scale, SCALE_PTR)
    tl.store(dst + out, x.to(dst.dtype.element_ty), mask=out_ok)


@triton.jit
def _gather_cache_kernel(
    key_cache, value_cache, block_table, key_out, value_out, k_scale, v_scale, seq_len, length,
    stride_kcb, stride_kch, stride_kc2, stride_vcb, stride_vch, stride_vc2, stride_oh, stride_ot,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr,
    X: tl.constexpr, LAYOUT: tl.constexpr, FP8: tl.constexpr, SCALE_PTR: tl.constexpr,
):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_PAD)
    cached = (t < seq_len)[:, None] & (d < HEAD_SIZE)[None, :]
    page = tl.load(block_table + t // BLOCK_SIZE, mask=t < seq_len, other=0).to(tl.int64)[:, None]
    out = head.to(tl.int64) * stride_oh + t.to(tl.int64)[:, None] * stride_ot + d[None, :]  # past 2^31 at 512K+
    out_ok = (t < length)[:, None] & (d < HEAD_SIZE)[None, :]
    _gather_one(key_cache, key_out, page, t, d, head, k_scale, cached, out, out_ok, stride_kcb, stride_kch,
                stride_kc2, BLOCK_SIZE, X, LAYOUT, FP8, SCALE_PTR, True)
    _gather_one(value_cache, value_out, page, t, d, head, v_scale, cached, out, out_ok, stride_vcb, stride_vch,
                stride_vc2, BLOCK_SIZE, X, LAYOUT, FP8, SCALE_PTR, False)


def gather_cache(key_cache, value_cache, block_table, seq_len, key_out, value_out, kv_cache_dtype, k_scale, v_scale):
    """The inverse of reshape_and_cache for one sequence: its first ``seq_len`` tokens (pages ``block_table``)
    into ``key_out`` / ``value_out`` [num_kv_heads, length >= seq_len, head_size], dequantised to their dtype,
    zeros past ``seq_len``."""
    layout, block_size, x = _host.cache_layout(key_cache, value_cache)
    num_kv_heads, length, head_size = key_out.shape
    if value_out.shape != key_out.shape or key_out.stride() != value_out.stride() or key_out.stride(2) != 1:
        raise ValueError("key_out and value_out must be alike [num_kv_heads, length, head_size], dense in head_size")
    if length < seq_len:
        raise ValueError(f"outputs hold {length} tokens, fewer than seq_len {seq_len}")
    k_scale, v_scale, scale_ptr = _host.scale_args(k_scale, v_scale)
    tokens = 64
    _gather_cache_kernel[(triton.cdiv(length, tokens), num_kv_heads)](
        key_cache, value_cache, block_table, key_out, value_out, k_scale, v_scale, seq_len, length,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), key_out.stride(0), key_out.stride(1),
        HEAD_SIZE=head_size, HEAD_PAD=_host.pow2_at_least(head_size, 16), BLOCK_SIZE=block_size, TOKENS=tokens,
        X=x, LAYOUT=layout, FP8=_host.fp8_kind(kv_cache_dtype), SCALE_PTR=scale_ptr, num_warps=4,
    )
