// Device-side building blocks shared by pagedllm's kernels: element types, fp8 conversion, and thin
// wrappers over the PTX instructions the attention kernel is built from (cp.async, ldmatrix,
// movmatrix, mma.sync). Each wrapper is one instruction; the kernels own the data layouts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace pagedllm {

// How the KV cache stores values: the query's own 16-bit type, or float8 bits (uint8) of value / scale.
enum class CacheKind { kAuto, kFp8E4M3, kFp8E5M2 };

template <typename T, CacheKind KIND>
using cache_elem_t = std::conditional_t<KIND == CacheKind::kAuto, T, uint8_t>;

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(v);
  } else {
    return __bfloat162float(v);
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else {
    return __float2bfloat16_rn(v);
  }
}

// Two floats as one 32-bit register of T pairs, `lo` in the low half (the lower column of an mma
// fragment).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  }
  return r;
}

// Two float8 values (low byte first) as a T pair. fp8 -> fp16 is exact for both formats and every fp8
// value is exact in bf16, so the result is exact; the per-tensor scale is applied later in fp32.
template <typename T, CacheKind KIND>
__device__ __forceinline__ uint32_t fp8x2_to_pair(uint16_t bits) {
  constexpr __nv_fp8_interpretation_t fmt = KIND == CacheKind::kFp8E4M3 ? __NV_E4M3 : __NV_E5M2;
  __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits), fmt);
  if constexpr (std::is_same_v<T, __half>) {
    return static_cast<uint32_t>(raw.x) | (static_cast<uint32_t>(raw.y) << 16);
  } else {
    const float2 f = __half22float2(__half2(raw));
    return pack2<T>(f.x, f.y);
  }
}

// float -> float8 bits of v / scale, round to nearest even, saturated to the finite range (as the
// reference's clamp-then-cast); NaN stays NaN.
template <CacheKind KIND>
__device__ __forceinline__ uint8_t float_to_fp8(float v) {
  constexpr __nv_fp8_interpretation_t fmt = KIND == CacheKind::kFp8E4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// mbarriers (Hopper): a count of arrivals plus the bytes of the asynchronous copies that complete on them.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}

// Asynchronous global -> shared copy of BYTES (8 or 16); bytes past `src_bytes` are zero-filled, so
// cache slots past a sequence's end (which may hold NaN) never reach the tensor cores.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src, int src_bytes) {
  static_assert(BYTES == 8 || BYTES == 16, "cp.async copies 8 or 16 bytes here");
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

// Transpose of an 8x8 b16 matrix held in the mma fragment layout (lane holds row lane/4, cols
// 2*(lane%4) and +1).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// d += a (16x16, row-major) * b (16x8, column-major), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// 2^x in one MUFU.EX2: exp2f also rescales inputs whose result would be subnormal (three more instructions), which
// softmax weights below 2^-126 do not need.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max_xor(float v, int from_mask, int to_mask) {
  for (int m = from_mask; m >= to_mask; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ float warp_sum_xor(float v, int from_mask, int to_mask) {
  for (int m = from_mask; m >= to_mask; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

}  // namespace pagedllm
