// The attention half of a decoder layer for a decode step of ONE sequence, as one launch of thread-block
// clusters, one cluster of 8 blocks per kv head.
//
// The Triton decoder-layer kernel (pagedllm/ops/triton/decode_layer.py) runs a layer as five dependent launches
// (norm + qkv, attention, o_proj, norm + gate_up, down). Each boundary is a grid-wide exchange through the L2:
// the previous phase drains, its stores reach the L2, the next phase's wait returns and its programs read the
// results back, ~2.5 us a boundary on the H100 even where the phase's weights are already on chip. Only the
// norms need the whole grid's results; qkv rows -> attention -> o_proj columns stay within a kv head. Here the
// first three phases are one launch whose blocks exchange through distributed shared memory instead. Block r
// of kv head h's cluster:
//   residual add + RMSNorm of the layer's input -> 1/8 of the kv head's q/k/v rows -> cluster barrier ->
//   gathers the head's q/k/v from its peers, q/k norm + RoPE (block 0 writes the new K/V into the cache),
//   attention over the r-th 8th of the cached keys -> cluster barrier -> merges the 8 partials and the newest
//   token's score -> rows [r H/8, (r+1) H/8) of o_proj over the kv head's columns: o_out[row, h], the partial
//   sums per kv head that the Triton kernel's gate_up phase adds up, as it does its own o_proj's.
// Clusters of 8, not 16: an H100 SXM holds 15 clusters of 8 blocks of one SM each at once, but only 7 of 16
// (cudaOccupancyMaxActiveClusters; a GPC has 16-18 SMs and one of them fewer), so 16 would run 8 kv heads in
// two waves.
//
// A block requests its weights (bulk copies into shared memory, ~190 KB) and its first keys before it waits for
// the previous launch (griddepcontrol.wait; it launches as a programmatic dependent) and lets the next launch
// start once its norm has read the previous launch's results. Values are rounded to the model dtype where the
// layers' own path holds tensors of that dtype, as the Triton kernel does. KV cache: "hnd" [blocks, kv_heads,
// block_size, head_size], 16-bit.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "batch1.cuh"
#include "host_utils.h"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int kCluster = 8;  // blocks a cluster: the kv head's attention partitions
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxXChunks = 4;  // 8-element chunks of the hidden vector per lane: hidden <= 1024
constexpr int kKeys = 4;        // keys in flight per warp
// Registers that leave room on an SM for a program of the Triton kernel's gate_up phase (16 warps x 72), so that
// its weights stream while this launch runs.
constexpr int kRegisters = 104;
constexpr float kLog2E = 1.4426950408889634f;

struct Params {
  const void *x, *residual;  // the layer's input ([hidden] float32, or T for layer 0's embedding) and residual (T)
  bool x_float, o_smem;
  void* res_mid;  // [hidden] T: the residual stream after the attention's residual add
  float* o_out;   // [hidden, kv_heads]: o_proj's partial sums per kv head
  const void *ln, *qkv, *qkv_bias, *q_norm, *k_norm, *o;
  void *k_cache, *v_cache;
  int hidden, heads, kv_heads, block_size;
  int64_t cache_stride_block, cache_stride_head;  // elements
  float eps, qk_eps, qk_scale;                    // qk_scale: softmax scale * log2(e)
  const float* cos_sin;
  int64_t cos_sin_stride;
  const int64_t* positions;
  const int64_t* slot_mapping;
  const int* seq_lens;
  const int* block_table;
};

// ---------------------------------------------------------------------------------------------------------
// Cluster and grid-dependency primitives
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ int cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return static_cast<int>(r);
}

// The cluster barrier, split: arrive once this block's shared memory holds what its peers will read (or once it
// is done reading theirs), wait before reading theirs (or before exiting: a block's shared memory must outlive
// its peers' reads).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// float `local` of this block's shared memory, read from block `rank` of the cluster.
__device__ __forceinline__ float peer_load(const float* local, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------------------
// Norm and GEMV rows
// ---------------------------------------------------------------------------------------------------------
using XVec = float[kMaxXChunks][8];  // a GEMV input: lane l holds elements 8 (32 c + l) ... + 7

// vec = RMSNorm(h) * w, h = round(round(x) + res), rounded as fused.rms_norm rounds; h_out (may be null)
// receives h. w: this thread's 8 weights (chunk threadIdx.x), loaded before the wait.
template <typename T>
__device__ void stage_norm(const Params& p, uint4 w, T* h_out, T* vec, float* red) {
  const int j = threadIdx.x, k = p.hidden;
  float h[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float ss = 0.f;
  if (j < k / 8) {
    if (p.x_float) {
      const float4 a = __ldcg(reinterpret_cast<const float4*>(p.x) + 2 * j);
      const float4 b = __ldcg(reinterpret_cast<const float4*>(p.x) + 2 * j + 1);
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) h[e] = rnd<T>(v[e]);
    } else {
      unpack8<T>(__ldcg(reinterpret_cast<const uint4*>(p.x) + j), h);
    }
    float r[8];
    unpack8<T>(__ldcg(reinterpret_cast<const uint4*>(p.residual) + j), r);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      h[e] = rnd<T>(h[e] + r[e]);
      ss += h[e] * h[e];
    }
    if (h_out != nullptr) reinterpret_cast<uint4*>(h_out)[j] = pack8<T>(h);
  }
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += red[i];
  const float rstd = rsqrtf(total / k + p.eps);
  if (j < k / 8) {
    float wf[8];
    unpack8<T>(w, wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = rnd<T>(wf[e] * rnd<T>(h[e] * rstd));
    reinterpret_cast<uint4*>(vec)[j] = pack8<T>(h);
  }
  __syncthreads();
}

__device__ __forceinline__ float dot8(const float (&w)[8], const float* x) {
  float a = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) a = fmaf(w[e], x[e], a);
  return a;
}

// A row of k T values in shared memory dotted with x, lane l taking chunks l, l + 32, ... (every lane gets the
// sum); the loads go out ahead of the math (explicit shared loads: decode_model.cu's dot_row says why).
template <typename T>
__device__ __forceinline__ float dot_row(const T* row, const XVec& x, int k) {
  const uint32_t base = smem_addr(row) + (threadIdx.x % 32) * 16;
  const int lane = threadIdx.x % 32;
  uint4 w[kMaxXChunks];
#pragma unroll
  for (int c = 0; c < kMaxXChunks; ++c) w[c] = c * 32 + lane < k / 8 ? lds128(base + c * 512) : uint4{};
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < kMaxXChunks; ++c) {
    float f[8];
    unpack8<T>(w[c], f);
    acc += dot8(f, x[c]);
  }
  return warp_sum(acc);
}

// Issues n rows of `bytes` each as bulk copies into shared memory (row i from src(i) to dst + i * bytes),
// completing on `bar`, by warp 0's lanes.
template <typename Src>
__device__ __forceinline__ void request_rows(char* dst, int n, uint32_t bytes, uint64_t* bar, Src src) {
  if (threadIdx.x >= 32) return;
  for (int i = threadIdx.x; i < n; i += 32) bulk_copy(dst + static_cast<int64_t>(i) * bytes, src(i), bytes, bar);
}

// ---------------------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------------------
// Shared memory, in bytes: the block's q/k/v rows [rows, hidden] and o_proj rows [hidden / kCluster, group *
// head] (T), the normed input (T), the norm's partial sums, this block's q/k/v outputs, the kv head's whole
// q/k/v (gathered), the merged attention output, this block's attention partial [group][max, sum, output], the
// mbarrier. Attention's scratch (rotated q and k, the newest token's scores, the warps' partials) reuses the
// q/k/v rows' space once they are done.
struct Layout {
  int rows, o_rows, o_w, vec, red, mine, all, out, part, bar, total;
  __host__ __device__ Layout(int hidden, int group, int head, int elem, bool o_smem = true) {
    rows = (group + 2) * head / kCluster;
    o_rows = hidden / kCluster;
    o_w = rows * hidden * elem;
    vec = o_w + (o_smem ? o_rows * group * head * elem : 0);
    red = vec + hidden * elem;
    mine = red + kWarps * 4;
    all = mine + rows * 4;
    out = all + (group + 2) * head * 4;
    part = out + group * head * 4;
    bar = (part + group * (head + 2) * 4 + 15) / 16 * 16;
    total = bar + 16;
  }
};

// Row `local` of kv head h's q/k/v rows (its query heads', then its k's, then its v's) in the qkv projection.
__device__ __forceinline__ int qkv_row(const Params& p, int h, int group, int head, int local) {
  const int q_rows = group * head;
  return local < q_rows          ? h * q_rows + local
         : local < q_rows + head ? (p.heads + h) * head + local - q_rows
                                 : (p.heads + p.kv_heads + h) * head + local - q_rows - head;
}

template <typename T, int HEAD, int GMAX>
__global__ void __maxnreg__(kRegisters) attention_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(128) char smem[];
  constexpr int EPL = HEAD / 32;
  constexpr int ROW = HEAD + 2;
  const int group = p.heads / p.kv_heads;
  const int q_rows = group * HEAD;
  const int kv_head = blockIdx.x / kCluster, rank = cluster_rank();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Layout L(p.hidden, group, HEAD, sizeof(T), p.o_smem);
  T* w_qkv = reinterpret_cast<T*>(smem);
  T* w_o = reinterpret_cast<T*>(smem + L.o_w);
  T* vec = reinterpret_cast<T*>(smem + L.vec);
  float* red = reinterpret_cast<float*>(smem + L.red);
  float* mine = reinterpret_cast<float*>(smem + L.mine);
  float* all = reinterpret_cast<float*>(smem + L.all);
  float* out = reinterpret_cast<float*>(smem + L.out);
  float* part = reinterpret_cast<float*>(smem + L.part);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + L.bar);
  float* q_s = reinterpret_cast<float*>(smem);  // [group][HEAD], then k [HEAD], scores [GMAX], warp partials
  float* k_s = q_s + q_rows;
  float* s_new = k_s + HEAD;
  float* warp_part = s_new + GMAX;  // [kWarps][group][ROW]

  // Everything that does not depend on the previous launch, requested first: the weights (q/k/v rows first,
  // as they are needed first), the norm weights, RoPE's and the first keys.
  if (threadIdx.x == 0) {
    mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    mbar_expect_tx(bar, (L.rows * p.hidden + (p.o_smem ? L.o_rows * q_rows : 0)) * sizeof(T));
  }
  __syncthreads();
  request_rows(smem, L.rows, p.hidden * sizeof(T), bar, [&](int i) {
    return static_cast<const T*>(p.qkv) + static_cast<int64_t>(qkv_row(p, kv_head, group, HEAD, rank * L.rows + i)) *
                                              p.hidden;
  });
  if (p.o_smem) request_rows(smem + L.o_w, L.o_rows, q_rows * sizeof(T), bar, [&](int i) {
    return static_cast<const T*>(p.o) + static_cast<int64_t>(rank * L.o_rows + i) * p.heads * HEAD + kv_head * q_rows;
  });
  const uint4 ln_w =
      static_cast<int>(threadIdx.x) < p.hidden / 8 ? __ldg(reinterpret_cast<const uint4*>(p.ln) + threadIdx.x) : uint4{};
  const int64_t pos = *p.positions, slot = *p.slot_mapping;
  const int cached = *p.seq_lens - 1;  // keys from earlier steps; the newest is merged on its own
  Elems<EPL> cos, sin, qn_w, kn_w;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int d = lane * EPL + e, i = d % (HEAD / 2);
    cos.v[e] = rnd<T>(p.cos_sin[pos * p.cos_sin_stride + i]);
    sin.v[e] = rnd<T>(p.cos_sin[pos * p.cos_sin_stride + HEAD / 2 + i]);
    qn_w.v[e] = p.q_norm != nullptr ? to_float(static_cast<const T*>(p.q_norm)[d]) : 0.f;
    kn_w.v[e] = p.k_norm != nullptr ? to_float(static_cast<const T*>(p.k_norm)[d]) : 0.f;
  }
  const int chunk_len = (cached + kCluster - 1) / kCluster;
  const int start = rank * chunk_len, end = min(start + chunk_len, cached);
  const T* k_cache = static_cast<const T*>(p.k_cache) + kv_head * p.cache_stride_head;
  const T* v_cache = static_cast<const T*>(p.v_cache) + kv_head * p.cache_stride_head;
  // The warp's keys t0 + u * kWarps (u < kKeys); past `end`, the last one again (masked later).
  Elems<EPL> kk[kKeys], vv[kKeys];
  auto load_keys = [&](int t0) {
    int block[kKeys];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) block[u] = p.block_table[min(t0 + u * kWarps, end - 1) / p.block_size];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      const int64_t at = static_cast<int64_t>(block[u]) * p.cache_stride_block +
                         min(t0 + u * kWarps, end - 1) % p.block_size * HEAD + lane * EPL;
      kk[u] = load_elems<T, EPL>(k_cache + at);
      vv[u] = load_elems<T, EPL>(v_cache + at);
    }
  };
  if (start + warp < end) load_keys(start + warp);

  asm volatile("griddepcontrol.wait;" ::: "memory");
  stage_norm<T>(p, ln_w, blockIdx.x == 0 ? static_cast<T*>(p.res_mid) : nullptr, vec, red);
  // The next launch's programs may start (and stream their weights) from here on: this launch reads nothing
  // more that the previous one wrote.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  {
    XVec x;
    const int lane8 = lane;
#pragma unroll
    for (int c = 0; c < kMaxXChunks; ++c) {
      const int j = c * 32 + lane8;
      unpack8<T>(j < p.hidden / 8 ? reinterpret_cast<const uint4*>(vec)[j] : uint4{}, x[c]);
    }
    mbar_wait(bar, 0);
    for (int i = warp; i < L.rows; i += kWarps) {
      float a = dot_row<T>(w_qkv + static_cast<int64_t>(i) * p.hidden, x, p.hidden);
      if (lane == 0) {
        if (p.qkv_bias != nullptr) {
          a += to_float(static_cast<const T*>(p.qkv_bias)[qkv_row(p, kv_head, group, HEAD, rank * L.rows + i)]);
        }
        mine[i] = rnd<T>(a);
      }
    }
  }
  cluster_sync();  // every block's q/k/v rows are in its shared memory; the q/k/v weights' space is free
  for (int i = threadIdx.x; i < q_rows + 2 * HEAD; i += kThreads) all[i] = peer_load(mine + i % L.rows, i / L.rows);
  __syncthreads();
  // q heads 0 .. group - 1, then k (item `group`), a warp each; block 0 writes the newest token's K/V
  for (int item = warp; item <= group; item += kWarps) {
    Elems<EPL> x;
#pragma unroll
    for (int e = 0; e < EPL; ++e) x.v[e] = all[item * HEAD + lane * EPL + e];
    const Elems<EPL> r =
        norm_rotate<T, HEAD>(x, p.q_norm != nullptr, item < group ? qn_w : kn_w, p.qk_eps, cos, sin);
#pragma unroll
    for (int e = 0; e < EPL; ++e) q_s[item * HEAD + lane * EPL + e] = r.v[e];
    if (item == group && rank == 0 && slot >= 0) {
      Elems<EPL> v;
#pragma unroll
      for (int e = 0; e < EPL; ++e) v.v[e] = all[(group + 1) * HEAD + lane * EPL + e];
      const int64_t at = (slot / p.block_size) * p.cache_stride_block + (slot % p.block_size) * HEAD + lane * EPL;
      store_elems<T, EPL>(static_cast<T*>(p.k_cache) + kv_head * p.cache_stride_head + at, r);
      store_elems<T, EPL>(static_cast<T*>(p.v_cache) + kv_head * p.cache_stride_head + at, v);
    }
  }
  __syncthreads();
  if (warp < group) {  // the newest token's score against each query head (log2 units)
    float d = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) d = fmaf(q_s[warp * HEAD + lane * EPL + e], k_s[lane * EPL + e], d);
    d = warp_sum(d);
    if (lane == 0) s_new[warp] = d * p.qk_scale;
  }
  // This block's 8th of the cached keys: warp w takes keys start + w, + kWarps, ...
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
  for (int t0 = start + warp; t0 < end; t0 += kWarps * kKeys) {
    if (t0 > start + warp) load_keys(t0);
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g >= group) break;
      float s[kKeys];
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < kKeys; ++u) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) d = fmaf(q[g][e], kk[u].v[e], d);
        s[u] = t0 + u * kWarps < end ? warp_sum(d) * p.qk_scale : -INFINITY;
        m_new = fmaxf(m_new, s[u]);
      }
      const float alpha = exp2f(m[g] - m_new);  // m_new is finite: key t0 is real
      l[g] *= alpha;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[g][e] *= alpha;
#pragma unroll
      for (int u = 0; u < kKeys; ++u) {
        const float pr = exp2f(s[u] - m_new);
        l[g] += pr;
        const float pt = rnd<T>(pr);  // P is rounded to the cache dtype before P V, as the Triton kernels do
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(pt, vv[u].v[e], acc[g][e]);
      }
      m[g] = m_new;
    }
  }
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g >= group) break;
    float* row = warp_part + (warp * group + g) * ROW;
    if (lane == 0) row[0] = m[g], row[1] = l[g];
#pragma unroll
    for (int e = 0; e < EPL; ++e) row[2 + lane * EPL + e] = acc[g][e];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < q_rows; idx += kThreads) {  // the block's partial: its warps merged
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
    if (d == 0) part[g * ROW] = mx, part[g * ROW + 1] = sum;
    part[g * ROW + 2 + d] = o;
  }
  cluster_sync();  // every block's partial is in place
  for (int idx = threadIdx.x; idx < q_rows; idx += kThreads) {  // the partials and the newest token, merged
    const int g = idx / HEAD, d = idx % HEAD;
    float mr[kCluster];
    float mx = s_new[g];
#pragma unroll
    for (int r = 0; r < kCluster; ++r) {
      mr[r] = peer_load(part + g * ROW, r);
      mx = fmaxf(mx, mr[r]);
    }
    float den = exp2f(s_new[g] - mx);
    float num = den * all[(group + 1) * HEAD + d];
#pragma unroll
    for (int r = 0; r < kCluster; ++r) {
      const float scale = exp2f(mr[r] - mx);  // 0 for an empty partition (max -inf)
      den += scale * peer_load(part + g * ROW + 1, r);
      num += scale * peer_load(part + g * ROW + 2 + d, r);
    }
    out[idx] = rnd<T>(num / den);  // rounded as the attention output o_proj reads
  }
  cluster_arrive();  // done with the peers' shared memory
  __syncthreads();
  // o_proj: rows rank * o_rows + i over the kv head's columns, from shared memory
  const int k8 = q_rows / 8;
  for (int i = warp; i < L.o_rows; i += kWarps) {
    const T* row = p.o_smem ? w_o + static_cast<int64_t>(i) * q_rows
                            : static_cast<const T*>(p.o) + static_cast<int64_t>(rank * L.o_rows + i) * p.heads * HEAD +
                                  kv_head * q_rows;
    float a = 0.f;
    for (int c = lane; c < k8; c += 32) {
      float f[8];
      unpack8<T>(reinterpret_cast<const uint4*>(row)[c], f);
      a += dot8(f, out + c * 8);
    }
    a = warp_sum(a);
    if (lane == 0) p.o_out[static_cast<int64_t>(rank * L.o_rows + i) * p.kv_heads + kv_head] = a;
  }
  cluster_wait();
}

}  // namespace

void decode_cluster_check(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_size, int64_t elem_size) {
  TORCH_CHECK(head_size == 64 || head_size == 128, "head size ", str(head_size), " (64 or 128)");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 8, str(heads), " heads over ",
              str(kv_heads), " kv heads (at most 8 per kv head)");
  const int64_t group = heads / kv_heads;
  TORCH_CHECK((group + 2) * head_size % kCluster == 0, "a kv head's ", str((group + 2) * head_size),
              " q/k/v rows are not a multiple of ", str(kCluster));
  TORCH_CHECK(hidden % (kCluster * 8) == 0 && hidden / 8 <= kMaxXChunks * 32, "hidden size ", str(hidden),
              " (a multiple of ", str(kCluster * 8), " up to ", str(kMaxXChunks * 256), ")");
  const Layout l(hidden, group, head_size, elem_size);
  TORCH_CHECK((group + 1) * head_size * 4 + 8 * 4 + kWarps * group * (head_size + 2) * 4 <= l.o_w,
              "attention's scratch is larger than a block's q/k/v rows");
  TORCH_CHECK(l.total <= 227 * 1024, "a block's weights (", str(l.total), " bytes of shared memory) are too many");
}

void decode_cluster_attention(const at::Tensor& x, const at::Tensor& residual, at::Tensor& res_mid, at::Tensor& o_out,
                              const at::Tensor& input_norm, const at::Tensor& qkv,
                              const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& q_norm,
                              const std::optional<at::Tensor>& k_norm, const at::Tensor& o, at::Tensor& key_cache,
                              at::Tensor& value_cache, const at::Tensor& cos_sin_cache, const at::Tensor& positions,
                              const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                              const at::Tensor& block_table, double eps, double qk_eps, double scale) {
  const at::ScalarType dtype = qkv.scalar_type();
  check_activation_dtype(dtype);
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.scalar_type() == dtype && key_cache.stride(3) == 1 &&
                  key_cache.stride(2) == key_cache.size(3) && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.strides() == key_cache.strides() && value_cache.scalar_type() == dtype,
              "the caches must be 'hnd' [blocks, kv_heads, block_size, head_size] in the model dtype, alike, got ",
              shape(key_cache), " and ", shape(value_cache));
  const int64_t hidden = input_norm.numel(), kv_heads = key_cache.size(1), head_size = key_cache.size(3);
  TORCH_CHECK(o.dim() == 2 && o.size(0) == hidden && o.size(1) % head_size == 0, "o_proj's weight must be [",
              str(hidden), ", heads * ", str(head_size), "], got ", shape(o));
  const int64_t heads = o.size(1) / head_size;
  decode_cluster_check(hidden, heads, kv_heads, head_size, qkv.element_size());
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == (heads + 2 * kv_heads) * head_size && qkv.size(1) == hidden &&
                  qkv.is_contiguous() && o.is_contiguous(),
              "qkv and o weights must be contiguous [out, in], got ", shape(qkv), " and ", shape(o));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == dtype, "x must be float32 or the model dtype");
  check_buffer(x, qkv, x.scalar_type(), hidden, "x");
  check_buffer(residual, qkv, dtype, hidden, "residual");
  check_buffer(res_mid, qkv, dtype, hidden, "res_mid");
  check_buffer(input_norm, qkv, dtype, hidden, "input_norm");
  check_buffer(o_out, qkv, at::kFloat, hidden * kv_heads, "o_out");
  check_cuda(cos_sin_cache, qkv, "cos_sin_cache");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.size(1) == head_size && cos_sin_cache.stride(1) == 1,
              "cos_sin_cache must be float32 [positions, head_size], got ", shape(cos_sin_cache));
  for (const at::Tensor* t : {&positions, &slot_mapping}) {
    check_cuda(*t, qkv, "positions and slot_mapping");
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() >= 1, "positions and slot_mapping must be int64");
  }
  check_cuda(seq_lens, qkv, "seq_lens");
  check_cuda(block_table, qkv, "block_table");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt &&
                  block_table.stride(-1) == 1,
              "seq_lens and block_table must be int32, the block table's row dense");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm: both or neither");

  Params p{};
  p.o_smem = true;
  p.x = x.data_ptr(), p.x_float = x.scalar_type() == at::kFloat, p.residual = residual.data_ptr();
  p.res_mid = res_mid.data_ptr(), p.o_out = o_out.data_ptr<float>();
  p.ln = input_norm.data_ptr(), p.qkv = qkv.data_ptr(), p.o = o.data_ptr();
  p.qkv_bias = qkv_bias.has_value() ? qkv_bias->data_ptr() : nullptr;
  p.q_norm = q_norm.has_value() ? q_norm->data_ptr() : nullptr;
  p.k_norm = k_norm.has_value() ? k_norm->data_ptr() : nullptr;
  p.k_cache = key_cache.data_ptr(), p.v_cache = value_cache.data_ptr();
  p.hidden = static_cast<int>(hidden), p.heads = static_cast<int>(heads), p.kv_heads = static_cast<int>(kv_heads);
  p.block_size = static_cast<int>(key_cache.size(2));
  p.cache_stride_block = key_cache.stride(0), p.cache_stride_head = key_cache.stride(1);
  p.eps = static_cast<float>(eps), p.qk_eps = static_cast<float>(qk_eps);
  p.qk_scale = static_cast<float>(scale) * kLog2E;
  p.cos_sin = cos_sin_cache.data_ptr<float>(), p.cos_sin_stride = cos_sin_cache.stride(0);
  p.positions = positions.data_ptr<int64_t>(), p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.seq_lens = seq_lens.data_ptr<int>(), p.block_table = block_table.data_ptr<int>();
  const int group = static_cast<int>(heads / kv_heads);
  const int smem = Layout(p.hidden, group, static_cast<int>(head_size), qkv.element_size(), p.o_smem).total;

  const c10::cuda::CUDAGuard guard(qkv.device());
  auto launch = [&](auto kernel) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(kv_heads * kCluster));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = smem;
    config.stream = c10::cuda::getCurrentCUDAStream();
    cudaLaunchAttribute attrs[2];
    attrs[0].id = cudaLaunchAttributeClusterDimension;
    attrs[0].val.clusterDim.x = kCluster;
    attrs[0].val.clusterDim.y = 1;
    attrs[0].val.clusterDim.z = 1;
    // a programmatic dependent of the kernel before it (and the one after it of this), as the Triton kernel's
    // phases launch
    attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[1].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attrs;
    config.numAttrs = 2;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  };
  auto with_type = [&](auto t) {
    using T = decltype(t);
    auto with_head = [&](auto head) {
      constexpr int H = decltype(head)::value;
      if (group <= 2) {
        launch(attention_kernel<T, H, 2>);
      } else if (group <= 4) {
        launch(attention_kernel<T, H, 4>);
      } else {
        launch(attention_kernel<T, H, 8>);
      }
    };
    head_size == 64 ? with_head(std::integral_constant<int, 64>{}) : with_head(std::integral_constant<int, 128>{});
  };
  dtype == at::kHalf ? with_type(__half{}) : with_type(__nv_bfloat16{});
}

}  // namespace pagedllm
