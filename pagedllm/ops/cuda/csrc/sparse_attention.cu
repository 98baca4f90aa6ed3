// XAttention's block-sparse attention for Hopper (sm_90a): one thread block runs 128 query rows (one query block)
// of one head over the key blocks listed for them (pagedllm/ops/xattention/sparse_attention.py builds the
// lists). A producer warp streams Q once and each listed 128-key tile of K and V through a three-stage ring with
// TMA; two consumer warpgroups (64 rows each) compute S = Q K^T and O += P V with wgmma (K and V straight from
// the swizzled tiles, P from registers), issuing tile t+1's Q K^T with tile t's P V so that the exp2 online
// softmax of one runs while the other is on the tensor cores (FA3's intra-warpgroup overlap). The softmax's
// reference moves only when a row max passes it by 2^8. Only the last listed block is masked (causal diagonal,
// ragged end). bf16, head 128.
//
// Measured on the H100 (benchmarks/results/README.md, 21st and 22nd sessions): 14-19% less time than the Triton
// kernel at 64K-128K and 5-20% density (two visits); the overlap took 5-14% off (same visit), where the tensor
// pipe had been busy 63% of the cycles at 128K. Tried and dropped: the overlap with a two-stage ring (a stage is
// freed a tile later: slower), the warpgroups taking turns on named barriers, freeing K and V stages apart, a
// persistent grid (a block per SM taking every SM-th unit: 0-40% slower), two or more consecutive units a block
// with the next one's Q loaded during the current one (within noise), a quarter or more of the exponentials as
// an FMA polynomial (2-10% slower at 64K-128K: the softmax is not bound by MUFU).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include "host_utils.h"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int kRows = 128, kKeys = 128, kHead = 128, kStages = 3;
constexpr int kBox = 128 * 64 * 2;  // one TMA box: 128 rows x 64 channels of bf16 (the 128-byte swizzle's width)
constexpr int kTile = 2 * kBox;     // 128 rows x 128 channels
constexpr int kSmem = kTile * (1 + 2 * kStages) + 1024;  // Q, the K and V rings; 1024 for the swizzle alignment

struct SparseParams {
  __nv_bfloat16* out;
  const int* kv_idx;  // [B, H, q blocks, k blocks] ascending listed key blocks; kv_cnt [B, H, q blocks]
  const int* kv_cnt;
  int64_t stride_ob, stride_ot, stride_oh, stride_ip, stride_ih, stride_iq, stride_cp, stride_ch;
  int heads, group, batch, q_blocks;
  int q_start, seq_len;  // the queries are positions q_start .. seq_len - 1 of every batch entry's keys
  float qk_scale;  // softmax scale x log2(e)
  bool causal;
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                         int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

// wgmma operand descriptors, 128-byte swizzle. K-major (Q, K: channels contiguous): 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t desc_k_major(const void* p) {
  return (uint64_t)((smem_addr(p) & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
// N-major (V as P V's B operand): 64-channel chunks one box apart, 8-key groups 1024 B apart.
__device__ __forceinline__ uint64_t desc_n_major(const void* p) {
  return (uint64_t)((smem_addr(p) & 0x3FFFF) >> 4) | ((uint64_t)(kBox >> 4) << 16) |
         ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// The compiler sees the asynchronous MMAs' accumulators as written when issued: keep reads after the wait.
__device__ __forceinline__ void reg_fence(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 64 accumulator operands of one m64n128 wgmma.
#define PAGEDLLM_WGMMA_ACC \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// m64n128k16, bf16 in, fp32 accumulators (the m64nNk16 fragment: element i of a thread at row
// 16 warp + lane / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (lane % 4) + i % 2).
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : PAGEDLLM_WGMMA_ACC
      : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
      : PAGEDLLM_WGMMA_ACC
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#undef PAGEDLLM_WGMMA_ACC
#endif

// The online softmax of one S tile (this thread's two rows): masked if it is the last listed block, moves the
// exponent's reference m only when a row max passes it by more than 8 (P then stays below 2^8, and most tiles
// skip rescaling O), adds P to l and packs it as wgmma A fragments (one per 16 keys). Returns whether O must be
// multiplied by alpha (the same for the whole warp).
template <bool kMasked>
__device__ __forceinline__ bool softmax_tile(const float (&sacc)[64], uint32_t (&pa)[8][4], float (&m)[2],
                                             float (&l)[2], float (&alpha)[2], float qk_scale, int key0, int seq_len,
                                             bool causal, int qpos0, int lane) {
  // S is read, never written: with MMAs in flight, writing an accumulator makes ptxas serialize them, and a
  // masked copy would not fit in the registers beside O and the two P sets
  auto x = [&](int i) {
    const int key = key0 + 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
    return kMasked && (key >= seq_len || (causal && key > qpos0 + 8 * ((i / 2) % 2))) ? -INFINITY : sacc[i];
  };
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < 64; ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], x(i));
  bool grow = false;
  float m_new[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // a row's 128 columns lie on the 4 lanes of a quad
    mx[r] = warp_max_xor(mx[r], 2, 1);
    m_new[r] = fmaxf(m[r], mx[r] * qk_scale);  // the scale is positive: it commutes with max
    grow |= m_new[r] > m[r] + 8.f;
  }
  grow = __any_sync(0xffffffffu, grow);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    alpha[r] = 1.f;
    if (grow) {
      alpha[r] = exp2_ftz(m[r] - m_new[r]);
      m[r] = m_new[r];
      l[r] *= alpha[r];
    }
  }
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const int r = (i / 2) % 2;
    const float p0 = exp2_ftz(x(i) * qk_scale - m[r]), p1 = exp2_ftz(x(i + 1) * qk_scale - m[r]);
    l[r] += p0 + p1;
    pa[i / 8][(i % 8) / 2] = pack2<__nv_bfloat16>(p0, p1);
  }
  return grow;
}

__global__ void __launch_bounds__(384, 1)
    xattn_sparse_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                        const __grid_constant__ CUtensorMap v_map, const SparseParams P) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sq = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sk = sq + kTile;
  uint8_t* sv = sk + kStages * kTile;
  __shared__ uint64_t q_full, k_full[kStages], v_full[kStages], empty[kStages];

  // Same order as the Triton kernel's grid: kv head slowest, its query heads fastest.
  const int per_kv = gridDim.x / P.heads * P.group;
  const int kvh = blockIdx.x / per_kv;
  const int item = blockIdx.x % per_kv / P.group;
  const int h = kvh * P.group + blockIdx.x % P.group;
  const int seq = item % P.batch, j = P.q_blocks - 1 - item / P.batch;  // heaviest (latest) query blocks first
  const int q_start = P.q_start, seq_len = P.seq_len;
  const int q0 = (q_start / kRows + j) * kRows;
  const int* idx = P.kv_idx + seq * P.stride_ip + h * P.stride_ih + (int64_t)j * P.stride_iq;
  const int count = P.kv_cnt[seq * P.stride_cp + h * P.stride_ch + j];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    mbar_init(&q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&empty[s], 8);  // each consumer warp arrives once its tile's MMAs are done
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp < 4) {  // the producer warpgroup: one thread issues every copy
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (threadIdx.x == 0) {
      mbar_expect_tx(&q_full, kTile);
      for (int b = 0; b < 2; ++b) tma_load(sq + b * kBox, &q_map, &q_full, b * 64, q0 - q_start, h, seq);
      for (int t = 0; t < count; ++t) {
        const int s = t % kStages;
        mbar_wait(&empty[s], ((t / kStages) & 1) ^ 1);
        const int row = idx[t] * kKeys;
        mbar_expect_tx(&k_full[s], kTile);
        for (int b = 0; b < 2; ++b) tma_load(sk + s * kTile + b * kBox, &k_map, &k_full[s], b * 64, row, kvh, seq);
        mbar_expect_tx(&v_full[s], kTile);
        for (int b = 0; b < 2; ++b) tma_load(sv + s * kTile + b * kBox, &v_map, &v_full[s], b * 64, row, kvh, seq);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
  const int wg = warp / 4 - 1;                                  // rows 64 wg .. 64 wg + 63 of the block
  const int qpos0 = q0 + 64 * wg + 16 * (warp % 4) + lane / 4;  // this thread's rows: qpos0 and qpos0 + 8
  float o[64], sacc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  reg_fence(o);  // zeroed here, not among the first MMAs
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};  // finite start: a row with nothing seen needs no guard
  mbar_wait(&q_full, 0);
  // FA3's intra-warpgroup overlap: tile t+1's Q K^T is issued with tile t's P V, and tile t+1's softmax runs while
  // P V is on the tensor cores; O is rescaled once P V is done. P alternates between two register sets, pa and pb
  // (copying one into the other made ptxas serialize every wgmma), so a unit with an odd number of tiles runs its
  // first tile alone.
  uint32_t pa[8][4], pb[8][4];
  float alpha[2];
  const float qk_scale = P.qk_scale;
  auto issue_s = [&](int t) {  // S = Q K^T of tile t into sacc
    const int s = t % kStages;
    mbar_wait(&k_full[s], (t / kStages) & 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {  // 16 channels a step; steps 4-7 in the second box
      const int off = (kk >> 2) * kBox + (kk & 3) * 32;
      wgmma_ss(sacc, desc_k_major(sq + off + wg * 64 * 128), desc_k_major(sk + s * kTile + off), kk > 0);
    }
    wgmma_commit();
  };
  auto issue_pv = [&](int t, const uint32_t (&p)[8][4]) {  // O += P V of tile t
    const int s = t % kStages;
    mbar_wait(&v_full[s], (t / kStages) & 1);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma_rs(o, p[ks], desc_n_major(sv + s * kTile + ks * 16 * 128));
    wgmma_commit();
  };
  auto rescale = [&](bool grow) {  // the softmax's rescale of O, if it moved m
    if (grow) {
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] *= alpha[(i / 2) % 2];
    }
    reg_fence(o);  // the rescale lands here, not among the next tile's MMAs
  };
  auto finish_pv = [&](int t, bool grow) {  // wait for tile t's P V, free its stage, then rescale
    wgmma_wait();
    reg_fence(o);
    if (lane == 0) mbar_arrive(&empty[t % kStages]);
    rescale(grow);
  };
  // With P(t) in cur: S(t+1) and P V(t) issued together, P(t+1) into next. Only the unit's last step meets its last
  // (masked) tile.
  auto step = [&](auto last, int t, const uint32_t (&cur)[8][4], uint32_t (&next)[8][4]) {
    issue_s(t + 1);
    issue_pv(t, cur);
    wgmma_wait1();
    reg_fence(sacc);
    finish_pv(t, softmax_tile<decltype(last)::value>(sacc, next, m, l, alpha, qk_scale, idx[t + 1] * kKeys, seq_len,
                                                      P.causal, qpos0, lane));
  };
  if (count & 1) {  // tile 0 alone
    issue_s(0);
    wgmma_wait();
    reg_fence(sacc);
    const bool grow = count == 1 ? softmax_tile<true>(sacc, pa, m, l, alpha, qk_scale, idx[0] * kKeys, seq_len,
                                                      P.causal, qpos0, lane)
                                 : softmax_tile<false>(sacc, pa, m, l, alpha, qk_scale, 0, seq_len, P.causal, qpos0,
                                                       lane);
    rescale(grow);
    issue_pv(0, pa);
    finish_pv(0, false);
  }
  if (count > 1) {  // an even number of tiles from t0 on
    const int t0 = count & 1;
    issue_s(t0);
    wgmma_wait();
    reg_fence(sacc);
    rescale(softmax_tile<false>(sacc, pa, m, l, alpha, qk_scale, 0, seq_len, P.causal, qpos0, lane));
    int t = t0;
    for (; t + 2 < count; t += 2) {
      step(std::false_type(), t, pa, pb);
      step(std::false_type(), t + 1, pb, pa);
    }
    step(std::true_type(), t, pa, pb);
    issue_pv(t + 1, pb);
    finish_pv(t + 1, false);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = warp_sum_xor(l[r], 2, 1);
    l[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  }
  const int64_t o_base = seq * P.stride_ob + h * P.stride_oh;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int qpos = qpos0 + 8 * r;
    if (qpos < q_start || qpos >= seq_len) continue;
    __nv_bfloat16* row = P.out + o_base + (int64_t)(qpos - q_start) * P.stride_ot;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      *reinterpret_cast<uint32_t*>(row + 8 * c + 2 * (lane % 4)) =
          pack2<__nv_bfloat16>(o[4 * c + 2 * r] * l[r], o[4 * c + 2 * r + 1] * l[r]);
    }
  }
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status);
    TORCH_CHECK(err == cudaSuccess && status == cudaDriverEntryPointSuccess,
                "xattn_sparse_attention: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// [batch, heads, len, 128] bf16 with unit channel stride as a 4-D TMA map of 128-row x 64-channel boxes; rows past
// `len` arrive as zeros.
CUtensorMap tensor_map(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) == kHead && x.stride(3) == 1, "xattn_sparse_attention: ", name,
              " must be [batch, heads, len, 128] with unit channel stride, got sizes ", x.sizes(), " strides ",
              x.strides());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "xattn_sparse_attention: ", name, " must be bfloat16");
  CUtensorMap map;
  cuuint64_t dims[4] = {(cuuint64_t)x.size(3), (cuuint64_t)x.size(2), (cuuint64_t)x.size(1), (cuuint64_t)x.size(0)};
  cuuint64_t strides[3] = {(cuuint64_t)x.stride(2) * 2, (cuuint64_t)x.stride(1) * 2, (cuuint64_t)x.stride(0) * 2};
  cuuint32_t box[4] = {64, kRows, 1, 1}, elem[4] = {1, 1, 1, 1};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, x.data_ptr(), dims, strides, box,
                                    elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "xattn_sparse_attention: cuTensorMapEncodeTiled failed for ", name, " (error ",
              (int)r, "; strides must be multiples of 16 bytes and the base 16-byte aligned)");
  return map;
}

}  // namespace

void xattn_sparse_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& kv_idx, const at::Tensor& kv_count, int64_t stride_ob, int64_t stride_ot,
                            int64_t stride_oh, int64_t group, double qk_scale, bool causal) {
  const c10::cuda::CUDAGuard guard(query.device());
  int dev = query.get_device(), major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  TORCH_CHECK(major == 9, "xattn_sparse_attention needs a Hopper GPU (sm_90a), got compute capability ", major, ".x");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, "xattn_sparse_attention: out must be bfloat16");
  TORCH_CHECK(qk_scale > 0, "xattn_sparse_attention: qk_scale must be positive, got ", qk_scale);
  const int heads = (int)query.size(1), batch = (int)query.size(0), q_blocks = (int)kv_count.size(2);
  TORCH_CHECK(kv_count.dim() == 3 && kv_count.size(0) == batch && kv_count.size(1) == heads && kv_idx.dim() == 4,
              "xattn_sparse_attention: kv_count must be [batch, heads, q blocks], got ", kv_count.sizes());
  SparseParams P{reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), kv_idx.data_ptr<int>(), kv_count.data_ptr<int>(),
                 stride_ob, stride_ot, stride_oh, kv_idx.stride(0), kv_idx.stride(1), kv_idx.stride(2),
                 kv_count.stride(0), kv_count.stride(1), heads, (int)group, batch, q_blocks,
                 (int)(key.size(2) - query.size(2)), (int)key.size(2), (float)qk_scale, causal};
  const CUtensorMap qm = tensor_map(query, "query"), km = tensor_map(key, "key"), vm = tensor_map(value, "value");
  const int64_t grid = (int64_t)batch * q_blocks * heads;
  if (grid == 0) return;
  // Per call, not once: the attribute belongs to the current device.
  C10_CUDA_CHECK(cudaFuncSetAttribute(xattn_sparse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  xattn_sparse_kernel<<<grid, 384, kSmem, c10::cuda::getCurrentCUDAStream()>>>(qm, km, vm, P);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pagedllm
