// One decode step of ONE sequence through every decoder layer of a Llama-family model, in one launch.
//
// At batch 1 a layer is ~31 MB of weights (Qwen3-0.6B) that DRAM delivers in ~10 us, but a layer is a chain
// of dependent steps (norm, qkv, attention, o_proj, norm, gate_up, down) and every kernel boundary or grid
// barrier between them leaves DRAM idle while the chain waits: the Triton decoder-layer kernel
// (pagedllm/ops/triton/decode_layer.py) takes ~26 us a layer because its weights are requested only once the
// phase before is (nearly) done, and attention's ~8 us of dependent loads stream nothing.
//
// Here weights never wait for data. Each thread block (one per SM) owns fixed rows of every projection; a
// producer warp streams the block's rows, layer after layer, in the order they will be used, into a ring of
// shared-memory stages with bulk copies (cp.async.bulk + mbarrier), held back only by free stages. Eight
// consumer warps run the dependent chain: residual add + RMSNorm, GEMV rows out of the ring, grid barriers
// between phases, attention. While the consumers wait at a barrier or attend, the ring (~190 KB a block,
// most of a layer's ~240 KB share) fills with what comes next.
//
// Phases of a layer (a grid barrier after each):
//   A  residual add + RMSNorm (once per block, into shared memory), qkv rows
//   B  (kv head, partition) items: q/k RMSNorm + RoPE, the new token's K/V into the cache, attention over the
//      partition; the last partition of a kv head to finish merges the head's partials
//   C  o_proj rows
//   D  residual add + RMSNorm, gate_up row pairs + SiLU-and-mul
//   E  down_proj rows: the layer's output (float32) and the residual are the next layer's input
// Values are rounded to the model dtype where the layers' own path holds them in tensors of that dtype, as
// the Triton kernel does, so the paths agree to the GEMVs' order of accumulation.
//
// Cross-block data is read with ld.global.cg (L2, never a stale L1 line). The grid barriers need every block
// resident at once: the launcher sizes the grid to the SMs, one block each (the ring takes most of shared
// memory). KV cache: pagedllm's "hnd" layout [blocks, kv_heads, block_size, head_size], 16-bit.
//
// Measured on the H100 (benchmarks/results/README.md, eleventh session): the stream alone reads the layers'
// weights at 3.0 TB/s (10.4 us a layer), but the chain takes ~33 us a layer (five barriers at 1.25-3 us of
// waiting each, GEMV phases at ~0.75-1 us per 24 KB stage, attention ~5 us): the forward is 917-932 us against
// the Triton kernel's 750, so this kernel is opt-in (PAGEDLLM_DECODE_LAYER=cuda). Twenty-ninth session: with two of
// the barriers replaced by kv-head counters (commit 768d253, reverted) it took as long, and with its weight stream
// off that chain alone took 26.5 us a layer, more than the Triton kernel's whole layer by then (~21 us).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "host_utils.h"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int kWarps = 8;  // consumer warps
constexpr int kConsumers = kWarps * 32;
constexpr int kThreads = kConsumers + 32;  // + the producer warp
constexpr int kStageBytes = 24 * 1024;     // whole rows of 1K, 2K, 3K or 6K bytes fill it exactly
constexpr int kMaxChunks = 12;             // 8-element chunks of a GEMV's input per lane: K <= 3072
constexpr int kMaxK = kMaxChunks * 32 * 8;
constexpr int kMaxGroup = 8;               // query heads per kv head
constexpr float kLog2E = 1.4426950408889634f;
// Optional trace, per block and layer (%globaltimer, ns): the consumers' start and end of phases A..E (10), when
// the producer issued the layer's first and last weight stage, and when A's and D's norms were done.
constexpr int kTracePoints = 14;

// Per-layer device pointers, in this order, kPtrsPerLayer of them per layer.
enum : int { kLn, kQkv, kQkvBias, kQNorm, kKNorm, kO, kPost, kGateUp, kDown, kKCache, kVCache, kPtrsPerLayer };
// The projections in the order the producer streams them.
enum : int { kMatQkv, kMatO, kMatGateUp, kMatDown, kMats };

struct Params {
  const int64_t* layers;  // [num_layers, kPtrsPerLayer]
  int num_layers, hidden, inter, heads, kv_heads, partitions, block_size, stages;
  int64_t cache_stride_block, cache_stride_head;  // elements
  float eps, post_eps, qk_eps, qk_scale;          // qk_scale: softmax scale * log2(e)
  bool qk_norm, qkv_bias;
  const void* x_in;      // [hidden] T: the embedded token
  float* x;              // [hidden] a layer's MLP output; the last layer's is the result
  void* residual;        // [hidden] T: the residual stream after a layer's attention; the last is the result
  void* res_mid;         // [hidden] T: the residual stream before it
  void* qkv;             // [(heads + 2 kv_heads) head_size] T
  float* attn_part;      // [kv_heads, partitions, group, head_size + 2]: max (log2), sum, unnormalised output
  void* attn_out;        // [heads * head_size] T
  float* o_out;          // [hidden]
  void* act;             // [inter] T
  unsigned long long* sync;  // [0] grid barrier, [1 + h] kv head h's arrivals
  const float* cos_sin;      // [positions, head_size]: cos then sin
  int64_t cos_sin_stride;
  const int64_t* positions;
  const int64_t* slot_mapping;
  const int* seq_lens;
  const int* block_table;
  int64_t* trace;  // [blocks, num_layers, kTracePoints] or null
};

// ---------------------------------------------------------------------------------------------------------
// Synchronisation
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Every block adds one to the counter and waits for `target`; the counter only grows (see the kernel), so no
// block can miss a release. The CTA barriers order all consumer threads' stores before the release and their
// later loads after the acquire, as cooperative groups' grid sync does.
__device__ __forceinline__ void grid_sync(unsigned long long* counter, unsigned long long target) {
  consumer_sync();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(counter) : "memory");
    while (load_acquire(counter) < target) {
    }
  }
  consumer_sync();
}

__device__ __forceinline__ void mark(const Params& p, int layer, int point) {
  if (p.trace != nullptr) {
    int64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    p.trace[(static_cast<int64_t>(blockIdx.x) * p.num_layers + layer) * kTracePoints + point] = t;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Element helpers
// ---------------------------------------------------------------------------------------------------------
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

using Vec = float[kMaxChunks][8];  // a GEMV input: lane l holds elements 8 (32 c + l) ... + 7

__device__ __forceinline__ bool chunk_ok(int c, int k8) { return c * 32 + static_cast<int>(threadIdx.x % 32) < k8; }

// A GEMV's input goes through the block's shared memory: one L2 read per block. When every warp of every block
// read the same few KB from the L2 right after a grid barrier (1056 warps), those lines became a hotspot that
// cost ~10 us a layer.

// x from the block's copy; chunks past k are zeroed, not skipped: every element written kills x's previous phase.
template <typename T>
__device__ __forceinline__ void vec_to_regs(const T* vec, int k, Vec& x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    const uint4 v = chunk_ok(c, k / 8) ? reinterpret_cast<const uint4*>(vec)[c * 32 + lane] : uint4{};
    unpack8<T>(v, x[c]);
  }
}

// vec = src [k] (another phase's output).
template <typename T>
__device__ __forceinline__ void stage_vec(const T* src, int k, T* vec) {
  for (int j = threadIdx.x; j < k / 8; j += kConsumers) {
    reinterpret_cast<uint4*>(vec)[j] = __ldcg(reinterpret_cast<const uint4*>(src) + j);
  }
  consumer_sync();
}

// A norm's weights, this thread's 8-element chunks of them (stage_norm's), requested before the grid barrier
// the norm waits at: they do not depend on the step.
struct NormWeights {
  static constexpr int kChunks = (kMaxK / 8 + kConsumers - 1) / kConsumers;
  uint4 w[kChunks];
};

template <typename T>
__device__ __forceinline__ NormWeights prefetch_norm(const T* w, int k) {
  NormWeights r;
#pragma unroll
  for (int i = 0; i < NormWeights::kChunks; ++i) {
    const int j = threadIdx.x + i * kConsumers;
    r.w[i] = j < k / 8 ? __ldg(reinterpret_cast<const uint4*>(w) + j) : uint4{};
  }
  return r;
}

// vec = RMSNorm(h) * w with h = round(round(in) + res) (res may be null), rounded as fused.rms_norm rounds;
// `h_out` (may be null) receives h. in is float32 (in_f) or T (in_t); red: kWarps floats of scratch.
template <typename T>
__device__ __forceinline__ void stage_norm(const float* in_f, const T* in_t, const T* res, const NormWeights& nw,
                                           float eps, int k, T* h_out, T* vec, float* red) {
  float ss = 0.f;
  for (int j = threadIdx.x; j < k / 8; j += kConsumers) {
    float h[8];
    if (in_f != nullptr) {
      const float4 a = __ldcg(reinterpret_cast<const float4*>(in_f) + 2 * j);
      const float4 b = __ldcg(reinterpret_cast<const float4*>(in_f) + 2 * j + 1);
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) h[e] = rnd<T>(v[e]);
    } else {
      unpack8<T>(__ldcg(reinterpret_cast<const uint4*>(in_t) + j), h);
    }
    if (res != nullptr) {
      float r[8];
      unpack8<T>(__ldcg(reinterpret_cast<const uint4*>(res) + j), r);
#pragma unroll
      for (int e = 0; e < 8; ++e) h[e] = rnd<T>(h[e] + r[e]);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += h[e] * h[e];
    const uint4 packed = pack8<T>(h);
    reinterpret_cast<uint4*>(vec)[j] = packed;
    if (h_out != nullptr) reinterpret_cast<uint4*>(h_out)[j] = packed;
  }
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  consumer_sync();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += red[i];
  const float rstd = rsqrtf(total / k + eps);
#pragma unroll
  for (int i = 0; i < NormWeights::kChunks; ++i) {
    const int j = threadIdx.x + i * kConsumers;
    if (j >= k / 8) break;
    float h[8], wf[8];
    unpack8<T>(reinterpret_cast<const uint4*>(vec)[j], h);
    unpack8<T>(nw.w[i], wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = rnd<T>(wf[e] * rnd<T>(h[e] * rstd));
    reinterpret_cast<uint4*>(vec)[j] = pack8<T>(h);
  }
  consumer_sync();
}

// ---------------------------------------------------------------------------------------------------------
// The weight stream
// ---------------------------------------------------------------------------------------------------------
struct Gemv {
  int n, k, pairs, weight;  // rows (row pairs: gate and up), inputs, 1 or 2, pointer index
};

__device__ __forceinline__ Gemv gemv_of(const Params& p, int mat, int head_size) {
  switch (mat) {
    case kMatQkv: return {(p.heads + 2 * p.kv_heads) * head_size, p.hidden, 1, kQkv};
    case kMatO: return {p.hidden, p.heads * head_size, 1, kO};
    case kMatGateUp: return {p.inter, p.hidden, 2, kGateUp};
    default: return {p.hidden, p.inter, 1, kDown};
  }
}

// This block's rows [first, last) of a projection: equal contiguous shares.
__device__ __forceinline__ int2 share_of(int n) {
  return make_int2(static_cast<int>(static_cast<int64_t>(n) * blockIdx.x / gridDim.x),
                   static_cast<int>(static_cast<int64_t>(n) * (blockIdx.x + 1) / gridDim.x));
}

template <typename T>
__device__ __forceinline__ int rows_per_stage(const Gemv& g) {
  return kStageBytes / (g.k * g.pairs * static_cast<int>(sizeof(T)));
}

struct Ring {
  char* stages;
  uint64_t* full;   // a stage's bytes have landed
  uint64_t* empty;  // every consumer warp is done with a stage
  int count;
  uint32_t it;      // stages used so far (the producer and each consumer warp count alike)
};

// The producer: every layer's four projections, this block's rows, in consumption order.
template <typename T, int HEAD>
__device__ void produce(const Params& p, Ring ring) {
  for (int layer = 0; layer < p.num_layers; ++layer) {
    for (int mat = 0; mat < kMats; ++mat) {
      const Gemv g = gemv_of(p, mat, HEAD);
      const T* w = reinterpret_cast<const T*>(p.layers[layer * kPtrsPerLayer + g.weight]);
      const int2 rows = share_of(g.n);
      const int step = rows_per_stage<T>(g);
      for (int r = rows.x; r < rows.y; r += step, ++ring.it) {
        const int s = ring.it % ring.count;
        const uint32_t round = ring.it / ring.count;
        if (round > 0) mbar_wait(&ring.empty[s], (round - 1) & 1);
        if (mat == kMatQkv && r == rows.x) mark(p, layer, 10);
        const uint32_t bytes = min(step, rows.y - r) * g.k * sizeof(T);
        mbar_expect_tx(&ring.full[s], bytes * g.pairs);
        char* dst = ring.stages + static_cast<int64_t>(s) * kStageBytes;
        bulk_copy(dst, w + static_cast<int64_t>(r) * g.k, bytes, &ring.full[s]);
        if (g.pairs == 2) bulk_copy(dst + bytes, w + static_cast<int64_t>(g.n + r) * g.k, bytes, &ring.full[s]);
      }
    }
    mark(p, layer, 11);
  }
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// One row of a stage dotted with x (all lanes get the sum). The loads go out four chunks at a time ahead of their
// math, as explicit shared-memory loads: one generic load per chunk, each waited for, made the GEMVs ~1.5x slower
// (917 against 1010 us for the model's forward, benchmarks/decode_layer.py).
template <typename T>
__device__ __forceinline__ float dot_row(const T* row, const Vec& x, int k8) {
  const uint32_t base = smem_addr(row) + (threadIdx.x % 32) * 16;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int c0 = 0; c0 < kMaxChunks; c0 += 4) {
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

// The consumer side of one projection: this block's rows out of the ring, dealt to the warps round-robin over
// the whole share (so no warp always gets a stage's odd rows); out(row, dot, second dot of a pair).
template <typename T, int HEAD, typename Out>
__device__ __forceinline__ void consume(const Params& p, Ring& ring, int mat, const Vec& x, Out out) {
  const Gemv g = gemv_of(p, mat, HEAD);
  const int2 rows = share_of(g.n);
  const int step = rows_per_stage<T>(g);
  const int warp = threadIdx.x / 32;
  for (int r = rows.x; r < rows.y; r += step, ++ring.it) {
    const int s = ring.it % ring.count;
    mbar_wait(&ring.full[s], (ring.it / ring.count) & 1);
    const int n = min(step, rows.y - r);
    const T* stage = reinterpret_cast<const T*>(ring.stages + static_cast<int64_t>(s) * kStageBytes);
    for (int i = ((warp - (r - rows.x)) % kWarps + kWarps) % kWarps; i < n; i += kWarps) {
      const float a = dot_row<T>(stage + static_cast<int64_t>(i) * g.k, x, g.k / 8);
      const float b = g.pairs == 2 ? dot_row<T>(stage + static_cast<int64_t>(n + i) * g.k, x, g.k / 8) : 0.f;
      out(r + i, a, b);
    }
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(&ring.empty[s]);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Attention (phase B)
// ---------------------------------------------------------------------------------------------------------
template <int N>
struct Elems {
  float v[N];
};

// A head of `HEAD` T values at src: lane l's EPL consecutive elements (l * EPL ...), RMSNormed with w if
// given, rotated neox style (element d pairs with d + HEAD/2, held by lane l ^ 16).
template <typename T, int HEAD>
__device__ __forceinline__ Elems<HEAD / 32> rotated_head(const T* src, const T* norm_w, float eps,
                                                         const Elems<HEAD / 32>& cos, const Elems<HEAD / 32>& sin) {
  constexpr int EPL = HEAD / 32;
  const int lane = threadIdx.x % 32;
  Elems<EPL> x;
#pragma unroll
  for (int e = 0; e < EPL; ++e) x.v[e] = to_float(__ldcg(src + lane * EPL + e));
  if (norm_w != nullptr) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) ss += x.v[e] * x.v[e];
    const float rstd = rsqrtf(warp_sum(ss) / HEAD + eps);
#pragma unroll
    for (int e = 0; e < EPL; ++e) x.v[e] = rnd<T>(to_float(norm_w[lane * EPL + e]) * rnd<T>(x.v[e] * rstd));
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


// Attention items: (kv head, partition of the context), partitions of whole 16-token multiples.
__device__ __forceinline__ int2 partition_of(const Params& p, int item) {
  const int seq_len = *p.seq_lens;
  const int chunk = ((seq_len + p.partitions - 1) / p.partitions + 15) / 16 * 16;
  const int start = (item % p.partitions) * chunk;
  return make_int2(start, min(start + chunk, seq_len));
}

// A warp's next kTokens keys and values of a partition: tokens t0 + u * kWarps (past `end`: the last token again,
// masked out later). find() looks their blocks up, load() requests them. For a warp's first keys the kernel does the
// two at either end of phase A, so that the cache's latency overlaps the qkv projection and the grid barrier before
// attention instead of following them: they do not depend on this step's q/k/v (the newest token's slot is not
// written yet; attend() puts its K/V in place).
template <typename T, int HEAD, int GMAX>
struct Keys {
  static constexpr int kTokens = GMAX <= 2 ? 8 : 4;  // loads in flight per warp, as registers allow
  static constexpr int EPL = HEAD / 32;
  int block[kTokens];
  Elems<EPL> k[kTokens], v[kTokens];

  __device__ __forceinline__ void find(const Params& p, int t0, int end) {
#pragma unroll
    for (int u = 0; u < kTokens; ++u) block[u] = p.block_table[min(t0 + u * kWarps, end - 1) / p.block_size];
  }

  __device__ __forceinline__ void load(const Params& p, const T* k_cache, const T* v_cache, int t0, int end) {
#pragma unroll
    for (int u = 0; u < kTokens; ++u) {
      const int64_t at = static_cast<int64_t>(block[u]) * p.cache_stride_block +
                         min(t0 + u * kWarps, end - 1) % p.block_size * HEAD + threadIdx.x % 32 * EPL;
      k[u] = load_elems<T, EPL>(k_cache + at);
      v[u] = load_elems<T, EPL>(v_cache + at);
    }
  }
};

template <typename T>
__device__ __forceinline__ T* head_cache(const Params& p, const int64_t* lp, int which, int item) {
  return reinterpret_cast<T*>(lp[which]) + item / p.partitions * p.cache_stride_head;
}

// Item (kv head, partition) of layer `lp`'s attention, for up to GMAX query heads per kv head (the register
// arrays are sized by it); keys: the warp's first keys, requested. smem: q [group, HEAD] then the warps' partials
// [kWarps, group, HEAD + 2], one int.
template <typename T, int HEAD, int GMAX>
__device__ __forceinline__ void attend(const Params& p, const int64_t* lp, float* smem, int item,
                                      Keys<T, HEAD, GMAX>& keys) {
  constexpr int EPL = HEAD / 32;
  constexpr int HALF = HEAD / 2;
  constexpr int ROW = HEAD + 2;
  constexpr int kTokens = Keys<T, HEAD, GMAX>::kTokens;
  const int group = p.heads / p.kv_heads;
  const int kv_head = item / p.partitions;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int seq_len = *p.seq_lens;
  const int64_t pos = *p.positions, slot = *p.slot_mapping;
  const int2 range = partition_of(p, item);
  const int start = range.x, end = range.y;
  float* q_s = smem;
  float* warp_part = smem + group * HEAD;
  int* last_flag = reinterpret_cast<int*>(warp_part + kWarps * group * ROW);
  const T* qkv = static_cast<const T*>(p.qkv);
  T* k_cache = head_cache<T>(p, lp, kKCache, item);
  T* v_cache = head_cache<T>(p, lp, kVCache, item);
  const T* q_norm = p.qk_norm ? reinterpret_cast<const T*>(lp[kQNorm]) : nullptr;
  const T* k_norm = p.qk_norm ? reinterpret_cast<const T*>(lp[kKNorm]) : nullptr;

  Elems<EPL> cos, sin;  // rounded to T as the layers' RoPE rounds the cache's values
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int i = (lane * EPL + e) % HALF;
    cos.v[e] = rnd<T>(p.cos_sin[pos * p.cos_sin_stride + i]);
    sin.v[e] = rnd<T>(p.cos_sin[pos * p.cos_sin_stride + HALF + i]);
  }
  if (warp < group) {
    const Elems<EPL> q = rotated_head<T, HEAD>(qkv + (kv_head * group + warp) * HEAD, q_norm, p.qk_eps, cos, sin);
#pragma unroll
    for (int e = 0; e < EPL; ++e) q_s[warp * HEAD + lane * EPL + e] = q.v[e];
  }
  // The partition holding the newest token writes its K/V (no other partition reads that slot), by the warp whose
  // share holds it; if that is among its prefetched keys, the registers take it too.
  const int newest = seq_len - 1;
  if (start <= newest && newest < end && warp == (newest - start) % kWarps && slot >= 0) {
    const Elems<EPL> k = rotated_head<T, HEAD>(qkv + (p.heads + kv_head) * HEAD, k_norm, p.qk_eps, cos, sin);
    Elems<EPL> v;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      v.v[e] = to_float(__ldcg(qkv + (p.heads + p.kv_heads + kv_head) * HEAD + lane * EPL + e));
    }
    const int64_t at = (slot / p.block_size) * p.cache_stride_block + (slot % p.block_size) * HEAD + lane * EPL;
    store_elems<T, EPL>(k_cache + at, k);
    store_elems<T, EPL>(v_cache + at, v);
    const int at_u = (newest - start) / kWarps;
#pragma unroll
    for (int u = 0; u < kTokens; ++u) {  // selects, not an indexed store: the arrays stay in registers
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        keys.k[u].v[e] = u == at_u ? k.v[e] : keys.k[u].v[e];
        keys.v[u].v[e] = u == at_u ? v.v[e] : keys.v[u].v[e];
      }
    }
  }
  consumer_sync();

  float q[GMAX][EPL], m[GMAX], l[GMAX], acc[GMAX][EPL];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      q[g][e] = g < group ? q_s[g * HEAD + lane * EPL + e] : 0.f;
      acc[g][e] = 0.f;
    }
  }
  for (int t0 = start + warp; t0 < end; t0 += kWarps * kTokens) {
    if (t0 >= start + kWarps * kTokens) {
      keys.find(p, t0, end);
      keys.load(p, k_cache, v_cache, t0, end);
    }
    const auto& k = keys.k;
    const auto& v = keys.v;
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g >= group) break;
      float s[kTokens];
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < kTokens; ++u) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) d = fmaf(q[g][e], k[u].v[e], d);
        s[u] = t0 + u * kWarps < end ? warp_sum(d) * p.qk_scale : -INFINITY;
        m_new = fmaxf(m_new, s[u]);
      }
      const float alpha = exp2f(m[g] - m_new);  // m_new is finite: token t0 is real
      l[g] *= alpha;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[g][e] *= alpha;
#pragma unroll
      for (int u = 0; u < kTokens; ++u) {
        const float pr = exp2f(s[u] - m_new);
        l[g] += pr;
        const float pt = rnd<T>(pr);  // P is rounded to the cache dtype before P V, as the Triton kernels do
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(pt, v[u].v[e], acc[g][e]);
      }
      m[g] = m_new;
    }
  }
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {  // unrolled: the register arrays take constant indices only
    if (g >= group) break;
    float* row = warp_part + (warp * group + g) * ROW;
    if (lane == 0) row[0] = m[g], row[1] = l[g];
#pragma unroll
    for (int e = 0; e < EPL; ++e) row[2 + lane * EPL + e] = acc[g][e];
  }
  consumer_sync();

  // The block's partial: its warps merged.
  float* out_part = p.attn_part + static_cast<int64_t>(item) * group * ROW;
  for (int idx = threadIdx.x; idx < group * HEAD; idx += kConsumers) {
    const int g = idx / HEAD, d = idx % HEAD;
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, warp_part[(w * group + g) * ROW]);
    float sum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float* row = warp_part + (w * group + g) * ROW;
        const float scale = exp2f(row[0] - mx);
        sum += scale * row[1];
        o += scale * row[2 + d];
      }
    }
    if (d == 0) out_part[g * ROW] = mx, out_part[g * ROW + 1] = sum;
    out_part[g * ROW + 2 + d] = o;
  }
  consumer_sync();
  if (threadIdx.x == 0) {
    unsigned long long* arrivals = p.sync + 1 + kv_head;
    unsigned long long before;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(before) : "l"(arrivals) : "memory");
    const bool last = before == static_cast<unsigned long long>(p.partitions - 1);
    if (last) *arrivals = 0;  // the next layer's arrivals come after a grid barrier
    *last_flag = last;
  }
  consumer_sync();
  if (!*last_flag) return;
  // Last of the kv head's partitions: merge them into the attention output. The partitions' stats go to shared
  // memory in one parallel pass, and each thread's partial outputs are loaded several at a time: a chain of
  // one L2 round trip per partition would take longer than the attention itself.
  const float* parts = p.attn_part + static_cast<int64_t>(kv_head) * p.partitions * group * ROW;
  float* stats = warp_part;  // [partitions * group][max, sum]; the warps' partials are merged already
  for (int i = threadIdx.x; i < p.partitions * group; i += kConsumers) {
    stats[2 * i] = __ldcg(parts + i * ROW);
    stats[2 * i + 1] = __ldcg(parts + i * ROW + 1);
  }
  consumer_sync();
  T* attn_out = static_cast<T*>(p.attn_out) + kv_head * group * HEAD;
  for (int idx = threadIdx.x; idx < group * HEAD; idx += kConsumers) {
    const int g = idx / HEAD, d = idx % HEAD;
    float mx = -INFINITY;
    for (int i = 0; i < p.partitions; ++i) mx = fmaxf(mx, stats[2 * (i * group + g)]);
    float den = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll 8
      for (int i = 0; i < p.partitions; ++i) {
        const float scale = exp2f(stats[2 * (i * group + g)] - mx);
        den += scale * stats[2 * (i * group + g) + 1];
        o += scale * __ldcg(parts + (i * group + g) * ROW + 2 + d);
      }
    }
    attn_out[idx] = from_float<T>(den > 0.f ? o / den : 0.f);
  }
}

// ---------------------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------------------
__host__ __device__ __forceinline__ int max_gemv_input(const Params& p, int head_size) {
  return max(max(p.hidden, p.inter), p.heads * head_size);
}

// Bytes of scratch after the ring: attention's, or a GEMV input (T) and kWarps partial sums.
__host__ __device__ __forceinline__ int scratch_bytes(const Params& p, int head_size, int elem_size) {
  const int group = p.heads / p.kv_heads;
  const int attention = (group * head_size + kWarps * group * (head_size + 2) + 4) * 4;
  return max(attention, max_gemv_input(p, head_size) * elem_size + kWarps * 4);
}

template <typename T, int HEAD, int GMAX>
__global__ void __launch_bounds__(kThreads, 1) decode_model_kernel(const __grid_constant__ Params p) {
  // Bulk copies and mbarrier transaction counts are Hopper's: built for an older GPU (the library compiles for
  // the device's own architecture) the kernel is empty and the launcher refuses to run it.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char smem[];
  Ring ring{smem, reinterpret_cast<uint64_t*>(smem + static_cast<int64_t>(p.stages) * kStageBytes), nullptr,
            p.stages, 0};
  ring.empty = ring.full + p.stages;
  // Scratch, by phase: attention's (attend) or a GEMV input and the norm's partial sums.
  float* scratch = reinterpret_cast<float*>(ring.empty + p.stages);
  T* vec = reinterpret_cast<T*>(scratch);
  float* red = reinterpret_cast<float*>(vec + max_gemv_input(p, HEAD));
  __shared__ unsigned long long barrier_base;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(&ring.full[s], 1);
      mbar_init(&ring.empty[s], kWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // The barrier counter grows by gridDim.x per barrier, (5 layers - 1) barriers a launch, and never resets.
    // A block reads it before its own first arrival, when the launch's first barrier has not released: the
    // value is the launch's base plus fewer than gridDim.x arrivals.
    const unsigned long long per_launch = static_cast<unsigned long long>(gridDim.x) * (5 * p.num_layers - 1);
    const unsigned long long now = load_acquire(p.sync);
    barrier_base = now - now % per_launch;
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {
    if (threadIdx.x == kConsumers) produce<T, HEAD>(p, ring);
    return;
  }
  const int lane = threadIdx.x % 32;
  const bool writer = blockIdx.x == 0;  // stores the residual stream
  unsigned long long target = barrier_base;
  int layer = 0, point = 0;  // for the trace
  auto phase_edge = [&] {
    if (threadIdx.x == 0) mark(p, layer, point++);
  };
  auto barrier = [&] {
    phase_edge();
    grid_sync(p.sync, target += gridDim.x);
    phase_edge();
  };
  // x is rewritten whole by every phase (vec_to_regs), so it is dead across attention: no spills there.
  Vec x;
  NormWeights norm_w = prefetch_norm(reinterpret_cast<const T*>(p.layers[kLn]), p.hidden);
  // Attention: this block's item and the warp's first token there (the step's shape, the same in every layer).
  const int item = blockIdx.x;
  const bool attends = item < p.kv_heads * p.partitions;
  const int2 range = attends ? partition_of(p, item) : make_int2(0, 0);
  const int t0 = range.x + static_cast<int>(threadIdx.x) / 32;
  const bool keyed = t0 < range.y;
  for (; layer < p.num_layers; ++layer) {
    const int64_t* lp = p.layers + layer * kPtrsPerLayer;
    point = 0;
    phase_edge();
    Keys<T, HEAD, GMAX> keys;
    if (keyed) keys.find(p, t0, range.y);
    {  // A: residual add + RMSNorm, qkv
      stage_norm<T>(layer ? p.x : nullptr, layer ? nullptr : static_cast<const T*>(p.x_in),
                    layer ? static_cast<const T*>(p.residual) : nullptr, norm_w, p.eps, p.hidden,
                    writer ? static_cast<T*>(p.res_mid) : nullptr, vec, red);
      if (threadIdx.x == 0) mark(p, layer, 12);
      vec_to_regs<T>(vec, p.hidden, x);
      const T* bias = p.qkv_bias ? reinterpret_cast<const T*>(lp[kQkvBias]) : nullptr;
      consume<T, HEAD>(p, ring, kMatQkv, x, [&](int row, float a, float) {
        if (lane == 0) static_cast<T*>(p.qkv)[row] = from_float<T>(bias ? a + to_float(bias[row]) : a);
      });
    }
    if (keyed) keys.load(p, head_cache<T>(p, lp, kKCache, item), head_cache<T>(p, lp, kVCache, item), t0, range.y);
    barrier();
    // B: attention
    if (attends) attend<T, HEAD, GMAX>(p, lp, scratch, item, keys);
    barrier();
    {  // C: o_proj
      stage_vec<T>(static_cast<const T*>(p.attn_out), p.heads * HEAD, vec);
      vec_to_regs<T>(vec, p.heads * HEAD, x);
      consume<T, HEAD>(p, ring, kMatO, x, [&](int row, float a, float) {
        if (lane == 0) p.o_out[row] = a;
      });
    }
    norm_w = prefetch_norm(reinterpret_cast<const T*>(lp[kPost]), p.hidden);
    barrier();
    {  // D: residual add + RMSNorm, gate_up + SiLU-and-mul (rounded as F.linear, then as silu_and_mul rounds)
      stage_norm<T>(p.o_out, nullptr, static_cast<const T*>(p.res_mid), norm_w, p.post_eps, p.hidden,
                    writer ? static_cast<T*>(p.residual) : nullptr, vec, red);
      if (threadIdx.x == 0) mark(p, layer, 13);
      vec_to_regs<T>(vec, p.hidden, x);
      consume<T, HEAD>(p, ring, kMatGateUp, x, [&](int row, float a, float b) {
        const float gate = rnd<T>(a);
        if (lane == 0) {
          static_cast<T*>(p.act)[row] = from_float<T>(rnd<T>(gate / (1.f + __expf(-gate))) * rnd<T>(b));
        }
      });
    }
    barrier();
    {  // E: down_proj
      stage_vec<T>(static_cast<const T*>(p.act), p.inter, vec);
      vec_to_regs<T>(vec, p.inter, x);
      consume<T, HEAD>(p, ring, kMatDown, x, [&](int row, float a, float) {
        if (lane == 0) p.x[row] = a;
      });
    }
    phase_edge();
    if (layer + 1 < p.num_layers) {
      norm_w = prefetch_norm(reinterpret_cast<const T*>(lp[kPtrsPerLayer + kLn]), p.hidden);
      grid_sync(p.sync, target += gridDim.x);
    }
  }
#endif
}

void check_buffer(const at::Tensor& t, const at::Tensor& like, at::ScalarType dtype, int64_t numel,
                  const char* name) {
  check_cuda(t, like, name);
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() >= numel, name, " must be a contiguous ",
              dtype, " tensor of at least ", str(numel), " elements, got ", t.scalar_type(), " ", shape(t));
  TORCH_CHECK(aligned(t.data_ptr(), 16), name, " must be 16-byte aligned");
}

}  // namespace

void decode_model_b1(const at::Tensor& x_in, at::Tensor& x, at::Tensor& residual, at::Tensor& res_mid,
                     at::Tensor& qkv, at::Tensor& attn_part, at::Tensor& attn_out, at::Tensor& o_out,
                     at::Tensor& act, at::Tensor& sync, const at::Tensor& layers, const at::Tensor& cos_sin_cache,
                     const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                     const at::Tensor& block_table, int64_t hidden, int64_t inter, int64_t heads,
                     int64_t kv_heads, int64_t head_size, int64_t block_size, int64_t cache_stride_block,
                     int64_t cache_stride_head, int64_t num_blocks, double eps, double post_eps, double qk_eps,
                     double scale, bool qk_norm, bool qkv_bias, const std::optional<at::Tensor>& trace) {
  const at::ScalarType dtype = x_in.scalar_type();
  check_activation_dtype(dtype);
  TORCH_CHECK(head_size == 64 || head_size == 128, "decode_model_b1: head_size ", str(head_size),
              " (64 or 128)");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "decode_model_b1: ",
              str(heads), " heads over ", str(kv_heads), " kv heads (at most ", str(kMaxGroup), " per kv head)");
  for (int64_t k : {hidden, inter, heads * head_size}) {
    TORCH_CHECK(k % 8 == 0 && k <= kMaxK, "decode_model_b1: GEMV inputs must be multiples of 8 up to ",
                str(kMaxK), ", got ", str(k));
  }
  TORCH_CHECK(layers.dim() == 2 && layers.size(1) == kPtrsPerLayer && layers.scalar_type() == at::kLong,
              "layers must be an int64 [num_layers, ", str(kPtrsPerLayer), "] table of device pointers, got ",
              shape(layers));
  check_cuda(layers, x_in, "layers");
  const int64_t num_layers = layers.size(0);
  const int64_t group = heads / kv_heads;
  int device = x_in.get_device(), sms = 0, smem_optin = 0, major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TORCH_CHECK(major >= 9, "decode_model_b1 needs a Hopper GPU or newer (bulk copies), got compute capability ",
              str(major), ".x");
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK(num_blocks >= kv_heads && num_blocks <= sms, "decode_model_b1: num_blocks ", str(num_blocks),
              " must be between the kv heads (", str(kv_heads), ") and the SMs (", str(sms), ")");
  const int64_t partitions = num_blocks / kv_heads;
  check_buffer(x_in, x_in, dtype, hidden, "x_in");
  check_buffer(x, x_in, at::kFloat, hidden, "x");
  check_buffer(residual, x_in, dtype, hidden, "residual");
  check_buffer(res_mid, x_in, dtype, hidden, "res_mid");
  check_buffer(qkv, x_in, dtype, (heads + 2 * kv_heads) * head_size, "qkv");
  check_buffer(attn_part, x_in, at::kFloat, kv_heads * partitions * group * (head_size + 2), "attn_part");
  check_buffer(attn_out, x_in, dtype, heads * head_size, "attn_out");
  check_buffer(o_out, x_in, at::kFloat, hidden, "o_out");
  check_buffer(act, x_in, dtype, inter, "act");
  check_buffer(sync, x_in, at::kLong, 1 + kv_heads, "sync");
  check_buffer(cos_sin_cache, x_in, at::kFloat, head_size, "cos_sin_cache");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == head_size, "cos_sin_cache must be ",
              "[positions, head_size], got ", shape(cos_sin_cache));
  for (const at::Tensor* t : {&positions, &slot_mapping}) {
    check_cuda(*t, x_in, "positions and slot_mapping");
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() >= 1, "positions and slot_mapping must be int64");
  }
  check_cuda(seq_lens, x_in, "seq_lens");
  check_cuda(block_table, x_in, "block_table");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt &&
                  block_table.stride(-1) == 1,
              "seq_lens and block_table must be int32, the block table's row dense");

  Params p{};
  p.layers = layers.data_ptr<int64_t>();
  p.num_layers = static_cast<int>(num_layers);
  p.hidden = static_cast<int>(hidden), p.inter = static_cast<int>(inter);
  p.heads = static_cast<int>(heads), p.kv_heads = static_cast<int>(kv_heads);
  // The ring takes what shared memory the scratch and the mbarriers (16 bytes a stage) leave.
  const int scratch = scratch_bytes(p, static_cast<int>(head_size), static_cast<int>(x_in.element_size()));
  const int stages = static_cast<int>((smem_optin - scratch - 128) / (kStageBytes + 16));  // 128: static smem
  TORCH_CHECK(stages >= 2, "decode_model_b1: shared memory for ", str(stages), " weight stages");
  const int smem = stages * (kStageBytes + 16) + scratch;
  p.partitions = static_cast<int>(partitions), p.block_size = static_cast<int>(block_size), p.stages = stages;
  p.cache_stride_block = cache_stride_block, p.cache_stride_head = cache_stride_head;
  p.eps = static_cast<float>(eps), p.post_eps = static_cast<float>(post_eps), p.qk_eps = static_cast<float>(qk_eps);
  p.qk_scale = static_cast<float>(scale) * kLog2E;
  p.qk_norm = qk_norm, p.qkv_bias = qkv_bias;
  p.x_in = x_in.data_ptr(), p.x = x.data_ptr<float>(), p.residual = residual.data_ptr();
  p.res_mid = res_mid.data_ptr(), p.qkv = qkv.data_ptr(), p.attn_part = attn_part.data_ptr<float>();
  p.attn_out = attn_out.data_ptr(), p.o_out = o_out.data_ptr<float>(), p.act = act.data_ptr();
  p.sync = reinterpret_cast<unsigned long long*>(sync.data_ptr<int64_t>());
  p.cos_sin = cos_sin_cache.data_ptr<float>(), p.cos_sin_stride = cos_sin_cache.stride(0);
  p.positions = positions.data_ptr<int64_t>(), p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.seq_lens = seq_lens.data_ptr<int>(), p.block_table = block_table.data_ptr<int>();
  if (trace.has_value()) {
    check_buffer(*trace, x_in, at::kLong, num_blocks * num_layers * kTracePoints, "trace");
    p.trace = trace->data_ptr<int64_t>();
  }

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto kernel) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<static_cast<int>(num_blocks), kThreads, smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto with_group = [&](auto t) {
    using T = decltype(t);
    auto with_head = [&](auto head) {
      constexpr int H = decltype(head)::value;
      if (group <= 2) {
        launch(decode_model_kernel<T, H, 2>);
      } else if (group <= 4) {
        launch(decode_model_kernel<T, H, 4>);
      } else {
        launch(decode_model_kernel<T, H, kMaxGroup>);
      }
    };
    head_size == 64 ? with_head(std::integral_constant<int, 64>{}) : with_head(std::integral_constant<int, 128>{});
  };
  dtype == at::kHalf ? with_group(__half{}) : with_group(__nv_bfloat16{});
}

}  // namespace pagedllm
