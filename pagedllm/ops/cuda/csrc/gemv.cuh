// GEMV building blocks of the batch-1 decode kernels (decode_model.cu, decode_gate_up.cu): 16-bit weights and
// inputs unpacked to float, weight rows bulk-copied into shared memory and dotted out of it by whole warps.
#pragma once

#include <type_traits>

#include "device_utils.cuh"

namespace pagedllm {

template <typename T>
__device__ __forceinline__ float rnd(float v) {  // v rounded to T, as a tensor of T would hold it
  return to_float(from_float<T>(v));
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
  } else {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  }
}

// 8 T values (16 bytes) as floats.
template <typename T>
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = unpack2<T>(u[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
}

__device__ __forceinline__ float warp_sum(float v) { return warp_sum_xor(v, 16, 1); }

// Asynchronous global -> shared copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) that completes
// on the mbarrier `bar` (which must expect them).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// A GEMV input of up to CHUNKS * 256 elements as one warp holds it: lane l holds elements 8 (32 c + l) ... + 7.
template <int CHUNKS>
using GemvInput = float[CHUNKS][8];

__device__ __forceinline__ bool chunk_ok(int c, int k8) { return c * 32 + static_cast<int>(threadIdx.x % 32) < k8; }

// x from a copy of the input in shared memory; chunks past k are zeroed, not skipped (x may hold an earlier
// input).
template <typename T, int CHUNKS>
__device__ __forceinline__ void vec_to_regs(const T* vec, int k, GemvInput<CHUNKS>& x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const uint4 v = chunk_ok(c, k / 8) ? reinterpret_cast<const uint4*>(vec)[c * 32 + lane] : uint4{};
    unpack8<T>(v, x[c]);
  }
}

// One row in shared memory (k8 = its length / 8) dotted with x; every lane gets the sum. The loads go out four
// chunks at a time ahead of their math, as explicit shared-memory loads: one generic load per chunk, each waited
// for, made the whole-model kernel's GEMVs ~1.5x slower (917 against 1010 us for the model's forward,
// benchmarks/decode_layer.py). CHUNKS: a multiple of 4.
template <typename T, int CHUNKS>
__device__ __forceinline__ float dot_row(const T* row, const GemvInput<CHUNKS>& x, int k8) {
  static_assert(CHUNKS % 4 == 0, "dot_row loads four chunks at a time");
  const uint32_t base = smem_addr(row) + (threadIdx.x % 32) * 16;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int c0 = 0; c0 < CHUNKS; c0 += 4) {
    if (c0 * 32 >= k8) break;
    uint4 w[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) w[c] = chunk_ok(c0 + c, k8) ? lds128(base + (c0 + c) * 512) : uint4{};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint32_t u[4] = {w[c].x, w[c].y, w[c].z, w[c].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<T>(u[i]);
        acc[i] = fmaf(f.x, x[c0 + c][2 * i], acc[i]);
        acc[i] = fmaf(f.y, x[c0 + c][2 * i + 1], acc[i]);
      }
    }
  }
  return warp_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

}  // namespace pagedllm
