// Device helpers of the batch-1 decode kernels (decode_model.cu, decode_cluster.cu): 16-bit values packed in
// registers, rounding as a tensor of the model dtype holds values, bulk copies and explicit shared-memory loads.
#pragma once

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

template <int N>
struct Elems {
  float v[N];
};

template <typename T, int EPL>
__device__ __forceinline__ Elems<EPL> load_elems(const T* src) {
  Elems<EPL> out;
  if constexpr (EPL == 4) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    const float2 a = unpack2<T>(raw.x), b = unpack2<T>(raw.y);
    out.v[0] = a.x, out.v[1] = a.y, out.v[2] = b.x, out.v[3] = b.y;
  } else {
    const float2 a = unpack2<T>(*reinterpret_cast<const uint32_t*>(src));
    out.v[0] = a.x, out.v[1] = a.y;
  }
  return out;
}

template <typename T, int EPL>
__device__ __forceinline__ void store_elems(T* dst, const Elems<EPL>& x) {
  if constexpr (EPL == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(x.v[0], x.v[1]), pack2<T>(x.v[2], x.v[3]));
  } else {
    *reinterpret_cast<uint32_t*>(dst) = pack2<T>(x.v[0], x.v[1]);
  }
}

// A head held as lane l's EPL consecutive elements (l * EPL ...), RMSNormed with the weights w if norm, then
// rotated neox style (element d pairs with d + HEAD/2, held by lane l ^ 16), rounded as the layers' q/k norm
// and RoPE kernels round.
template <typename T, int HEAD>
__device__ __forceinline__ Elems<HEAD / 32> norm_rotate(Elems<HEAD / 32> x, bool norm, const Elems<HEAD / 32>& w,
                                                        float eps, const Elems<HEAD / 32>& cos,
                                                        const Elems<HEAD / 32>& sin) {
  constexpr int EPL = HEAD / 32;
  const int lane = threadIdx.x % 32;
  if (norm) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) ss += x.v[e] * x.v[e];
    const float rstd = rsqrtf(warp_sum(ss) / HEAD + eps);
#pragma unroll
    for (int e = 0; e < EPL; ++e) x.v[e] = rnd<T>(w.v[e] * rnd<T>(x.v[e] * rstd));
  }
  Elems<EPL> out;
  const float sign = lane < 16 ? -1.f : 1.f;  // first half: x1 cos - x2 sin; second: x2 cos + x1 sin
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const float partner = __shfl_xor_sync(0xffffffffu, x.v[e], 16);
    out.v[e] = rnd<T>(rnd<T>(x.v[e] * cos.v[e]) + sign * rnd<T>(partner * sin.v[e]));
  }
  return out;
}

}  // namespace pagedllm
