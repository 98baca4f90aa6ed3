// reshape_and_cache: write one step's keys and values [num_tokens, num_kv_heads, head_size] into the
// paged caches at their slots (slot = block * block_size + offset; -1 = skip), quantizing to float8
// bits of value / scale for fp8 caches.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "host_utils.h"
#include "ops.h"

namespace pagedllm {
namespace {

struct CacheWriteParams {
  const void* key;
  const void* value;
  void* key_cache;
  void* value_cache;
  const void* slot_mapping;
  bool slots_are_int64;
  const float* k_scale;
  const float* v_scale;
  int64_t key_stride_token, key_stride_head, value_stride_token, value_stride_head;
  int64_t k_stride_block, k_stride_head, v_stride_block, v_stride_head;
  int head_size, block_size, units_per_token;  // unit: X consecutive dims of one kv head
};

template <typename T, CacheKind KIND>
__device__ __forceinline__ cache_elem_t<T, KIND> to_cache(T v, float scale) {
  if constexpr (KIND == CacheKind::kAuto) {
    return v;
  } else {
    return float_to_fp8<KIND>(to_float(v) / scale);  // true division, bit-equal to the reference
  }
}

// One thread block per token; a thread moves X dims (16 bytes of cache) of one kv head: the key unit
// as one 16-byte store (its x-interleaved chunk), the value unit as X stores strided by block_size.
template <typename T, CacheKind KIND>
__global__ void reshape_and_cache_kernel(const CacheWriteParams p) {
  using C = cache_elem_t<T, KIND>;
  constexpr int X = 16 / sizeof(C);
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slots_are_int64 ? static_cast<const int64_t*>(p.slot_mapping)[token]
                                         : static_cast<const int*>(p.slot_mapping)[token];
  if (slot < 0) return;
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const float k_scale = KIND == CacheKind::kAuto ? 1.f : *p.k_scale;
  const float v_scale = KIND == CacheKind::kAuto ? 1.f : *p.v_scale;
  const int chunks = p.head_size / X;
  for (int u = threadIdx.x; u < p.units_per_token; u += blockDim.x) {
    const int head = u / chunks, chunk = u % chunks;
    const T* k = static_cast<const T*>(p.key) + token * p.key_stride_token + head * p.key_stride_head + chunk * X;
    const T* v = static_cast<const T*>(p.value) + token * p.value_stride_token + head * p.value_stride_head +
                 chunk * X;
    alignas(16) C kout[X];
#pragma unroll
    for (int i = 0; i < X; ++i) kout[i] = to_cache<T, KIND>(k[i], k_scale);
    C* kc = static_cast<C*>(p.key_cache) + block * p.k_stride_block + head * p.k_stride_head +
            (static_cast<int64_t>(chunk) * p.block_size + offset) * X;
    *reinterpret_cast<uint4*>(kc) = *reinterpret_cast<const uint4*>(kout);
    C* vc = static_cast<C*>(p.value_cache) + block * p.v_stride_block + head * p.v_stride_head +
            static_cast<int64_t>(chunk) * X * p.block_size + offset;
#pragma unroll
    for (int i = 0; i < X; ++i) vc[i * p.block_size] = to_cache<T, KIND>(v[i], v_scale);
  }
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale) {
  const CacheKind kind = parse_cache_kind(kv_cache_dtype);
  TORCH_CHECK(key.is_cuda() && key.dim() == 3 && value.sizes() == key.sizes() &&
                  value.scalar_type() == key.scalar_type(),
              "key and value must be CUDA tensors [num_tokens, num_kv_heads, head_size] of one dtype");
  check_activation_dtype(key.scalar_type());
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&value, "value"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                         {&slot_mapping, "slot_mapping"}}) {
    check_cuda(*t, key, name);
  }
  check_scale(k_scale, key, "k_scale");
  check_scale(v_scale, key, "v_scale");
  check_cache_dtype(key_cache, key.scalar_type(), kind, "key_cache");
  check_cache_dtype(value_cache, key.scalar_type(), kind, "value_cache");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value must be contiguous in head_size");
  const int64_t num_kv_heads = key.size(1), head_size = key.size(2);
  const int64_t elem = key_cache.element_size(), x = 16 / elem;
  TORCH_CHECK(key_cache.dim() == 5 && value_cache.dim() == 4 && key_cache.size(1) == num_kv_heads &&
                  key_cache.size(2) * x == head_size && key_cache.size(4) == x &&
                  value_cache.size(1) == num_kv_heads && value_cache.size(2) == head_size &&
                  value_cache.size(3) == key_cache.size(3) && value_cache.size(0) == key_cache.size(0),
              "cache shapes ", shape(key_cache), " / ", shape(value_cache), " do not match keys ", shape(key));
  TORCH_CHECK(key_cache.stride(4) == 1 && key_cache.stride(3) == x && key_cache.stride(2) == key_cache.size(3) * x &&
                  value_cache.stride(3) == 1 && value_cache.stride(2) == value_cache.size(3),
              "each cache block of a head must be dense");
  TORCH_CHECK(key_cache.stride(0) * elem % 16 == 0 && key_cache.stride(1) * elem % 16 == 0 &&
                  aligned(key_cache.data_ptr(), 16),
              "key cache blocks must start on 16-byte boundaries");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.numel() <= key.size(0) && slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
              "slot_mapping must be a contiguous int64/int32 vector of at most num_tokens entries");
  const int64_t num_tokens = slot_mapping.numel();  // trailing tokens (e.g. CUDA-graph padding) are ignored
  if (num_tokens == 0 || num_kv_heads == 0) return;

  CacheWriteParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr();
  p.slots_are_int64 = slot_mapping.scalar_type() == at::kLong;
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.key_stride_token = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.value_stride_token = value.stride(0);
  p.value_stride_head = value.stride(1);
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_head = key_cache.stride(1);
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_head = value_cache.stride(1);
  p.head_size = static_cast<int>(head_size);
  p.block_size = static_cast<int>(value_cache.size(3));
  p.units_per_token = static_cast<int>(num_kv_heads * head_size / x);

  const c10::cuda::CUDAGuard guard(key.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int threads = static_cast<int>(std::min<int64_t>(256, (p.units_per_token + 31) / 32 * 32));
  dispatch_types(key.scalar_type(), kind, [&](auto t_tag, auto kind_tag) {
    using T = decltype(t_tag);
    reshape_and_cache_kernel<T, decltype(kind_tag)::value>
        <<<static_cast<unsigned>(num_tokens), threads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace pagedllm
