// Host-side helpers shared by the op launchers: argument checks and compile-time dispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "device_utils.cuh"

namespace pagedllm {

// `make cuda-check` compiles one head size per kernel template (-DPAGEDLLM_CHECK_BUILD) so that CI on
// two cores stays fast; every source file and every code path of the templates is still compiled.
#ifdef PAGEDLLM_CHECK_BUILD
#define PAGEDLLM_HEAD_SIZES 128
#else
#define PAGEDLLM_HEAD_SIZES 64, 80, 96, 112, 128, 256
#endif

// Numbers and shapes enter error messages as std::string. Some toolchains link a private libstdc++ into
// the extension (seen with the H100 image's /opt/gcc), and there formatting an integer through
// TORCH_CHECK's ostream crashes while inserting strings works.
inline std::string str(int64_t v) { return std::to_string(v); }

inline std::string shape(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

constexpr int kHeadSizes[] = {PAGEDLLM_HEAD_SIZES};

inline void check_head_size(int64_t head_size) {
  bool ok = false;
  for (int h : kHeadSizes) ok = ok || h == head_size;
  TORCH_CHECK(ok, "unsupported head_size ", str(head_size), "; supported: " C10_STRINGIZE((PAGEDLLM_HEAD_SIZES)));
}

// Calls f(std::integral_constant<int, V>{}) for the V in Vs equal to v (validated beforehand).
template <int... Vs, typename F>
void dispatch_int(int v, F&& f) {
  (void)((v == Vs && (f(std::integral_constant<int, Vs>{}), true)) || ...);
}

inline CacheKind parse_cache_kind(const std::string& kv_cache_dtype) {
  if (kv_cache_dtype == "auto") return CacheKind::kAuto;
  if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") return CacheKind::kFp8E4M3;
  if (kv_cache_dtype == "fp8_e5m2") return CacheKind::kFp8E5M2;
  TORCH_CHECK(false, "unknown kv_cache_dtype '", kv_cache_dtype,
              "'; expected auto, fp8, fp8_e4m3 or fp8_e5m2");
}

inline void check_activation_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "pagedllm CUDA ops take float16 or bfloat16 activations, got ", dtype);
}

// Calls f(T{}, std::integral_constant<CacheKind, K>{}) with T the CUDA type of `dtype` (fp16 / bf16).
template <typename F>
void dispatch_types(at::ScalarType dtype, CacheKind kind, F&& f) {
  auto with_kind = [&](auto tag) {
    switch (kind) {
      case CacheKind::kAuto: f(tag, std::integral_constant<CacheKind, CacheKind::kAuto>{}); break;
      case CacheKind::kFp8E4M3: f(tag, std::integral_constant<CacheKind, CacheKind::kFp8E4M3>{}); break;
      case CacheKind::kFp8E5M2: f(tag, std::integral_constant<CacheKind, CacheKind::kFp8E5M2>{}); break;
    }
  };
  if (dtype == at::kHalf) {
    with_kind(__half{});
  } else if (dtype == at::kBFloat16) {
    with_kind(__nv_bfloat16{});
  } else {
    check_activation_dtype(dtype);
  }
}

// The cache tensors' dtype must match kv_cache_dtype: the activation type for "auto", uint8 bits
// (or a float8 tensor of the same width) for fp8.
inline void check_cache_dtype(const at::Tensor& cache, at::ScalarType act, CacheKind kind, const char* name) {
  if (kind == CacheKind::kAuto) {
    TORCH_CHECK(cache.scalar_type() == act, name, " dtype ", cache.scalar_type(),
                " must equal the activations' ", act, " for kv_cache_dtype 'auto'");
  } else {
    TORCH_CHECK(cache.element_size() == 1, name, " must hold float8 bits (uint8) for an fp8 "
                "kv_cache_dtype, got ", cache.scalar_type());
  }
}

inline void check_scale(const at::Tensor& scale, const at::Tensor& like, const char* name) {
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat && scale.device() == like.device(),
              name, " must be a one-element float32 tensor on ", like.device());
}

inline void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device());
}

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace pagedllm
