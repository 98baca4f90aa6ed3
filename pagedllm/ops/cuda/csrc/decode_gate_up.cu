// Phase D of the batch-1 decoder-layer kernel (pagedllm/ops/triton/decode_layer.py): the residual add of
// o_proj's per-kv-head partial sums, RMSNorm, and the gate_up rows of this block with SiLU-and-mul.
//
// Why in CUDA: the Triton phase holds its weight share (96 KB a program for Qwen3-0.6B) in registers, so its
// programs fit on an SM only once attention's and o_proj's have left it, and the share's loads then sit in the
// SM's load queue ahead of the norm's: traced on the H100 (benchmarks/results/README.md, twenty-fifth session)
// the phase ended 6.9 us (median program; slowest 8.1) after o_proj, of which the norm took 2.9 and the GEMV
// 2.75. Here one thread bulk-copies the block's rows into shared memory (cp.async.bulk) before the
// programmatic-dependent wait, in 4 warps and few registers: the block is resident beside the two phases
// before it, the rows stream while they run and the norm's loads do not queue behind them.
//
// Rounded as the Triton phase (and the layers' path) round: h = round(round(sum of partials) + residual),
// RMSNorm rounded as fused.rms_norm, gate and up as F.linear's outputs, then as silu_and_mul.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "gemv.cuh"
#include "host_utils.h"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxParts = 16;     // o_proj's partial sums (kv heads)
constexpr int kMaxHidden = 3072;  // GemvInput<12>

struct GateUpParams {
  const float* o_part;  // [hidden, parts]
  const void* res_mid;  // [hidden] T: the residual before o_proj
  const void* norm_w;   // [hidden] T
  const void* gate_up;  // [2 inter, hidden] T: gate rows, then up rows
  void* residual;       // [hidden] T: h, written by block 0
  void* act;            // [inter] T
  int hidden, inter, parts, rows;  // rows: gate rows a block (and as many up rows)
  float eps;
  int64_t* trace;  // [blocks, 2] or null: each block's start and end (%globaltimer, ns)
};

__device__ __forceinline__ int64_t globaltimer() {
  int64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" :::); }

template <typename T, int CHUNKS>
__global__ void __launch_bounds__(kThreads) gate_up_kernel(const __grid_constant__ GateUpParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t landed;
  __shared__ float red[kWarps];
  const int64_t started = p.trace != nullptr ? globaltimer() : 0;
  const int r0 = blockIdx.x * p.rows;
  const int n = max(0, min(p.rows, p.inter - r0));  // blocks past the last row load and store nothing
  T* w = reinterpret_cast<T*>(smem);  // [2 n, hidden]: the block's gate rows, then its up rows
  T* vec = w + 2 * static_cast<int64_t>(p.rows) * p.hidden;
  const int k8 = p.hidden / 8;
  if (threadIdx.x == 0) {
    // The weights depend on no kernel of the step: requested before the wait.
    mbar_init(&landed, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const uint32_t bytes = static_cast<uint32_t>(n) * p.hidden * sizeof(T);
    const T* gate = static_cast<const T*>(p.gate_up) + static_cast<int64_t>(r0) * p.hidden;
    mbar_expect_tx(&landed, 2 * bytes);
    if (n > 0) {
      bulk_copy(w, gate, bytes, &landed);
      bulk_copy(w + static_cast<int64_t>(n) * p.hidden, gate + static_cast<int64_t>(p.inter) * p.hidden, bytes,
                &landed);
    }
  }
  __syncthreads();  // the mbarrier is initialised
  grid_dependency_wait();

  // h into vec, a thread's 8-element chunks at a time
  float ss = 0.f;
  for (int j = threadIdx.x; j < k8; j += kThreads) {
    float h[8] = {}, r[8];
    const float4* part = reinterpret_cast<const float4*>(p.o_part) + static_cast<int64_t>(j) * 2 * p.parts;
    for (int e = 0; e < 8; ++e) {
      for (int q = 0; q < p.parts / 4; ++q) {
        const float4 v = __ldcg(part + e * p.parts / 4 + q);
        h[e] += (v.x + v.y) + (v.z + v.w);
      }
    }
    unpack8<T>(__ldcg(static_cast<const uint4*>(p.res_mid) + j), r);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      h[e] = rnd<T>(rnd<T>(h[e]) + r[e]);
      ss += h[e] * h[e];
    }
    const uint4 packed = pack8<T>(h);
    reinterpret_cast<uint4*>(vec)[j] = packed;
    if (blockIdx.x == 0) static_cast<uint4*>(p.residual)[j] = packed;
  }
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  // The next phase's programs may start now: their weight loads would have queued ahead of the norm's.
  launch_dependents();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += red[i];
  const float rstd = rsqrtf(total / p.hidden + p.eps);
  for (int j = threadIdx.x; j < k8; j += kThreads) {
    float h[8], wf[8];
    unpack8<T>(reinterpret_cast<const uint4*>(vec)[j], h);
    unpack8<T>(__ldg(static_cast<const uint4*>(p.norm_w) + j), wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = rnd<T>(wf[e] * rnd<T>(h[e] * rstd));
    reinterpret_cast<uint4*>(vec)[j] = pack8<T>(h);
  }
  __syncthreads();
  GemvInput<CHUNKS> x;
  vec_to_regs<T, CHUNKS>(vec, p.hidden, x);
  mbar_wait(&landed, 0);
  for (int i = threadIdx.x / 32; i < n; i += kWarps) {
    const float gate = rnd<T>(dot_row<T, CHUNKS>(w + static_cast<int64_t>(i) * p.hidden, x, k8));
    const float up = dot_row<T, CHUNKS>(w + static_cast<int64_t>(n + i) * p.hidden, x, k8);
    if (threadIdx.x % 32 == 0) {
      static_cast<T*>(p.act)[r0 + i] = from_float<T>(rnd<T>(gate / (1.f + __expf(-gate))) * rnd<T>(up));
    }
  }
  if (p.trace != nullptr) {  // when the block started and when its last thread issued its last store
    __syncthreads();
    if (threadIdx.x == 0) {
      p.trace[2 * blockIdx.x] = started;
      p.trace[2 * blockIdx.x + 1] = globaltimer();
    }
  }
}

}  // namespace

void decode_gate_up_b1(const at::Tensor& o_part, const at::Tensor& res_mid, const at::Tensor& norm_w, double eps,
                       const at::Tensor& gate_up, at::Tensor& residual, at::Tensor& act, int64_t rows,
                       int64_t blocks, bool pdl, const std::optional<at::Tensor>& trace) {
  const auto dtype = gate_up.scalar_type();
  check_activation_dtype(dtype);
  TORCH_CHECK(gate_up.is_cuda() && gate_up.dim() == 2 && gate_up.is_contiguous(), "gate_up must be a dense ",
              "[2 inter, hidden] CUDA matrix, got ", shape(gate_up));
  const int64_t hidden = gate_up.size(1), inter = gate_up.size(0) / 2;
  TORCH_CHECK(gate_up.size(0) == 2 * inter && hidden % 8 == 0 && hidden <= kMaxHidden &&
                  reinterpret_cast<uintptr_t>(gate_up.data_ptr()) % 16 == 0,
              "decode_gate_up_b1: gate_up ", shape(gate_up), " (hidden a multiple of 8 up to ", str(kMaxHidden),
              ", 16-byte aligned)");
  TORCH_CHECK(o_part.scalar_type() == at::kFloat && o_part.dim() == 2 && o_part.size(0) == hidden &&
                  o_part.is_contiguous() && o_part.size(1) % 4 == 0 && o_part.size(1) <= kMaxParts,
              "o_part must be dense float32 [hidden, parts] with parts a multiple of 4 up to ", str(kMaxParts),
              ", got ", shape(o_part));
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&res_mid, &norm_w, &residual}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->numel() == hidden && t->is_contiguous() &&
                    t->device() == gate_up.device(),
                "res_mid, norm_w and residual must be dense [hidden] tensors of gate_up's dtype and device");
  }
  TORCH_CHECK(act.scalar_type() == dtype && act.numel() == inter && act.is_contiguous() &&
                  act.device() == gate_up.device(), "act must be a dense [inter] tensor of gate_up's dtype");
  TORCH_CHECK(o_part.device() == gate_up.device(), "o_part must be on gate_up's device");
  TORCH_CHECK(rows >= 1 && blocks * rows >= inter, str(blocks), " blocks of ", str(rows),
              " row pairs do not cover ", str(inter));
  const int smem = static_cast<int>((2 * rows + 1) * hidden * gate_up.element_size());  // w, then vec

  const c10::cuda::CUDAGuard guard(gate_up.device());
  int smem_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        gate_up.get_device()));
  TORCH_CHECK(smem + 64 <= smem_optin, "decode_gate_up_b1: ", str(rows), " row pairs of ", str(hidden),
              " need ", str(smem), " bytes of shared memory, the device has ", str(smem_optin));
  GateUpParams p{};
  p.o_part = o_part.data_ptr<float>(), p.res_mid = res_mid.data_ptr(), p.norm_w = norm_w.data_ptr();
  p.gate_up = gate_up.data_ptr(), p.residual = residual.data_ptr(), p.act = act.data_ptr();
  p.hidden = static_cast<int>(hidden), p.inter = static_cast<int>(inter), p.parts = static_cast<int>(o_part.size(1));
  p.rows = static_cast<int>(rows), p.eps = static_cast<float>(eps);
  if (trace.has_value()) {
    TORCH_CHECK(trace->scalar_type() == at::kLong && trace->is_contiguous() && trace->numel() == 2 * blocks &&
                    trace->device() == gate_up.device(), "trace must be a dense int64 [blocks, 2] tensor");
    p.trace = trace->data_ptr<int64_t>();
  }

  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = c10::cuda::getCurrentCUDAStream();
  config.attrs = &attr;
  config.numAttrs = pdl ? 1 : 0;
  auto launch = [&](auto kernel) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  };
  auto with_type = [&](auto t) {
    using T = decltype(t);
    if (hidden <= 4 * 256) {
      launch(gate_up_kernel<T, 4>);
    } else if (hidden <= 8 * 256) {
      launch(gate_up_kernel<T, 8>);
    } else {
      launch(gate_up_kernel<T, 12>);
    }
  };
  dtype == at::kHalf ? with_type(__half{}) : with_type(__nv_bfloat16{});
}

}  // namespace pagedllm
