// Paged decode attention (one query token per sequence) over vLLM's cache layout:
//   key_cache   [num_blocks, num_kv_heads, head_size / X, block_size, X]   X = 16 bytes of cache elements
//   value_cache [num_blocks, num_kv_heads, head_size, block_size]
//
// What differs from vLLM's kernel, and why:
// * One thread block serves up to 8 query heads of ONE kv head (the whole GQA group for groups <= 8), so
//   every K/V byte is read from memory once instead of once per query head.
// * The dot products run on tensor cores (mma.sync m16n8k16): S^T = K Q^T with 16 cached tokens as M and
//   the group's query heads as N, then O^T += V P^T with head dims as M. The cache layout already is the
//   operand layout: a 16-byte key chunk is 8 dims of one token (a row of an ldmatrix 8x8 tile), a value
//   row is one dim over consecutive tokens (the column-major B / row-major A the mma wants). The
//   probabilities go from S^T's accumulator fragment to V's B fragment with one movmatrix transpose.
// * Each warp streams its own 16-token tiles through a private cp.async ring (no block-wide barrier in
//   the main loop) and keeps an online softmax; the warps merge once at the end. Logits never go to
//   shared memory, so a single pass has no context-length limit.
// Kept from vLLM: 16-byte vector loads (8-byte for fp8 values), warp-shuffle reductions, split-K
// partitions + a reduce kernel for long contexts (their size is a launch parameter, so it can be tuned by
// measurement), fp32 softmax.
#pragma once

#include "device_utils.cuh"

namespace pagedllm {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kTileTokens = 16;    // cached tokens per mma tile (M of S^T = K Q^T)
constexpr int kHeadsPerCta = 8;    // query heads per thread block (N of the mma)
constexpr int kWarpSmemBudget = 24 * 1024;  // bytes of cp.async ring per warp
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct DecodeParams {
  void* out;                    // [num_seqs, num_heads, head_size], strided
  const void* query;            // [num_seqs, num_heads, head_size], strided
  const void* key_cache;
  const void* value_cache;
  const int* block_tables;      // [num_seqs, block_table_stride]
  const int* seq_lens;          // [num_seqs]
  const float* alibi_slopes;    // [num_heads] or nullptr
  const float* k_scale;         // [1], read only for fp8 caches
  const float* v_scale;
  // Split-K partials (max_partitions > 0): [num_seqs, num_heads, max_partitions(, head_size)], dense.
  float* exp_sums;
  float* max_logits;
  void* tmp_out;                // float32 or the query type (tmp_is_float)
  bool tmp_is_float;
  int max_partitions;           // 0: single pass, the result goes straight to `out`
  int partition_size;           // tokens per thread block, a multiple of kTileTokens
  int64_t q_stride_seq, q_stride_head, out_stride_seq, out_stride_head;
  int64_t k_stride_block, k_stride_head, v_stride_block, v_stride_head;
  int64_t block_table_stride;
  int num_heads, heads_per_kv, head_chunks;
  int block_size;               // any multiple of 8: a tile's 8-token halves each lie in one block
  float scale;
  // vLLM's block-sparse pattern (active when sparse_vert_stride > 1)
  int tp_rank, num_kv_heads, sparse_local_blocks, sparse_vert_stride, sparse_block_size,
      sparse_head_sliding_step;
};

template <typename T, CacheKind KIND, int HEAD>
struct DecodeShape {
  using C = cache_elem_t<T, KIND>;
  static constexpr int CS = sizeof(C);
  static constexpr int X = 16 / CS;                             // elements per 16-byte key chunk
  static constexpr int K_CHUNKS = HEAD / X;
  static constexpr int K_TILE_BYTES = kTileTokens * HEAD * CS;  // = V tile bytes
  static constexpr int V_ROW_BYTES = kTileTokens * CS;          // one head dim of the tile's values
  static constexpr int V_UNIT = 8;  // value tokens per cp.async (8 | block_size: one block's)
  static constexpr int V_UNIT_BYTES = V_UNIT * CS;
  static constexpr int STAGE_BYTES = 2 * K_TILE_BYTES;
  static constexpr int STAGES_FIT = kWarpSmemBudget / STAGE_BYTES;
  static constexpr int STAGES = STAGES_FIT < 2 ? 2 : (STAGES_FIT > 8 ? 8 : STAGES_FIT);
  static constexpr int WARP_SMEM = STAGES * STAGE_BYTES;
  static constexpr int O_STRIDE = HEAD + 4;  // padded merge row: the 4 lanes of a row hit distinct banks
  static constexpr int SMEM = kDecodeWarps * WARP_SMEM;
  static_assert(HEAD % 16 == 0, "head sizes are multiples of 16");
  static_assert((2 * kHeadsPerCta + kHeadsPerCta * O_STRIDE) * 4 <= WARP_SMEM,
                "a warp's merge buffer must fit in its own ring");
};

template <typename T, CacheKind KIND, int HEAD>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_kernel(const DecodeParams p) {
  using S = DecodeShape<T, KIND, HEAD>;
  using C = typename S::C;
  constexpr int KT = HEAD / 16;  // mma k-steps of QK^T = m-tiles of PV
  constexpr bool FP8 = KIND != CacheKind::kAuto;
  extern __shared__ __align__(16) unsigned char smem[];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates
  const int seq = blockIdx.z, part = blockIdx.x;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int chunk = blockIdx.y % p.head_chunks;
  const int head0 = kv_head * p.heads_per_kv + chunk * kHeadsPerCta;
  const int nheads = min(kHeadsPerCta, p.heads_per_kv - chunk * kHeadsPerCta);

  const int seq_len = p.seq_lens[seq];
  const int BS = p.block_size;
  const int tok_begin = part * p.partition_size;
  if (part > 0 && tok_begin >= seq_len) return;  // (the reduce never reads these partitions)
  const int tok_end = min(seq_len, tok_begin + p.partition_size);
  const int n_tiles = max(0, (tok_end - tok_begin + kTileTokens - 1) / kTileTokens);

  const int* block_table = p.block_tables + seq * p.block_table_stride;
  const C* k_base = static_cast<const C*>(p.key_cache) + kv_head * p.k_stride_head;
  const C* v_base = static_cast<const C*>(p.value_cache) + kv_head * p.v_stride_head;

  // Query heads of the B fragment: row g is head head0 + g, zero past the group.
  uint32_t qf[KT][2];
  {
    const T* q = static_cast<const T*>(p.query) + seq * p.q_stride_seq + (head0 + g) * p.q_stride_head;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      qf[kk][0] = g < nheads ? *reinterpret_cast<const uint32_t*>(q + 16 * kk + 2 * t) : 0u;
      qf[kk][1] = g < nheads ? *reinterpret_cast<const uint32_t*>(q + 16 * kk + 8 + 2 * t) : 0u;
    }
  }

  // This lane's two accumulator columns: heads 2t and 2t + 1 of the chunk.
  const float qk_scale = p.scale * (FP8 ? *p.k_scale : 1.f) * kLog2e;  // logits kept in log2 units
  const bool sparse = p.sparse_vert_stride > 1;
  const int q_sparse_block = sparse ? (seq_len - 1) / p.sparse_block_size : 0;
  bool head_ok[2];
  float alibi[2];
  int sparse_offset[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = 2 * t + j;
    head_ok[j] = h < nheads;
    alibi[j] = (p.alibi_slopes != nullptr && head_ok[j]) ? p.alibi_slopes[head0 + h] * kLog2e : 0.f;
    sparse_offset[j] = p.sparse_head_sliding_step >= 0
                           ? (p.tp_rank * p.num_heads + head0 + h) * p.sparse_head_sliding_step + 1
                           : (p.tp_rank * p.num_kv_heads + kv_head) * (-p.sparse_head_sliding_step) + 1;
  }
  // vLLM's rule: a cache block is attended when it is local to the query's sparse block or on the
  // head's vertical stride; the sparse block id is taken at the cache block's first token.
  auto sparse_keep = [&](int block_idx, int j) {
    const int k_sparse_block = block_idx * BS / p.sparse_block_size;
    return k_sparse_block > q_sparse_block - p.sparse_local_blocks ||
           (k_sparse_block + sparse_offset[j]) % p.sparse_vert_stride == 0;
  };
  // First tile >= `tile` (stepping by the warp count) with an attended token; n_tiles if none.
  auto next_tile = [&](int tile) {
    if (!sparse) return tile;
    for (; tile < n_tiles; tile += kDecodeWarps) {
      const int tok0 = tok_begin + tile * kTileTokens;
      const int last = min(tok0 + kTileTokens, tok_end) - 1;
      bool keep = false;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        keep |= head_ok[j] && (sparse_keep(tok0 / BS, j) || sparse_keep(last / BS, j));
      }
      if (__any_sync(0xffffffffu, keep)) break;
    }
    return min(tile, n_tiles);
  };

  unsigned char* ring = smem + warp * S::WARP_SMEM;

  // cp.async one tile into a stage: keys as [chunk][token][16 bytes], values as [dim][16 tokens]
  // (16-bit values: the two 16-byte halves of a row swapped on every 4th row, so ldmatrix's 8 row
  // reads hit 32 distinct banks). Slots past the partition's end are zero-filled.
  auto load_tile = [&](int tile, unsigned char* stage) {
    const int tok0 = tok_begin + tile * kTileTokens;
    {
      const int r = lane & 15;  // each lane copies one token's chunks
      const bool ok = tok0 + r < tok_end;
      const int tok = ok ? tok0 + r : tok0;
      const C* src = k_base + block_table[tok / BS] * p.k_stride_block + (tok % BS) * S::X;
      unsigned char* dst = stage + r * 16;
#pragma unroll
      for (int i = 0; i < (S::K_CHUNKS + 1) / 2; ++i) {
        const int c = (lane >> 4) + 2 * i;
        if (S::K_CHUNKS % 2 == 0 || c < S::K_CHUNKS) {
          cp_async<16>(dst + c * kTileTokens * 16, src + c * BS * S::X, ok ? 16 : 0);
        }
      }
    }
    {
      const int h = lane & 1;  // each lane copies one 8-token half of its rows
      const int n_ok = min(max(tok_end - (tok0 + h * S::V_UNIT), 0), S::V_UNIT);
      const int tok = n_ok > 0 ? tok0 + h * S::V_UNIT : tok0;
      const C* src = v_base + block_table[tok / BS] * p.v_stride_block + tok % BS;
      unsigned char* dst = stage + S::K_TILE_BYTES;
#pragma unroll
      for (int i = 0; i < HEAD / 16; ++i) {
        const int d = (lane >> 1) + 16 * i;
        const int slot = S::CS == 2 ? (h ^ ((d >> 2) & 1)) : h;
        cp_async<S::V_UNIT_BYTES>(dst + d * S::V_ROW_BYTES + slot * S::V_UNIT_BYTES, src + d * BS,
                                  n_ok * S::CS);
      }
    }
  };

  // A fragment (16 tokens x 16 dims) of K for k-step kk.
  auto k_fragment = [&](const unsigned char* stage, int kk, uint32_t (&a)[4]) {
    if constexpr (!FP8) {
      const int m = lane >> 3;
      const int tok = (m & 1) * 8 + (lane & 7), c = 2 * kk + (m >> 1);
      ldmatrix_x4(a, stage + (c * kTileTokens + tok) * 16);
    } else {
      const unsigned char* base = stage + kk * kTileTokens * 16 + g * 16 + 2 * t;
      a[0] = fp8x2_to_pair<T, KIND>(*reinterpret_cast<const uint16_t*>(base));
      a[1] = fp8x2_to_pair<T, KIND>(*reinterpret_cast<const uint16_t*>(base + 8 * 16));
      a[2] = fp8x2_to_pair<T, KIND>(*reinterpret_cast<const uint16_t*>(base + 8));
      a[3] = fp8x2_to_pair<T, KIND>(*reinterpret_cast<const uint16_t*>(base + 8 * 16 + 8));
    }
  };
  // A fragment (16 dims x 16 tokens) of V for dim tile i.
  auto v_fragment = [&](const unsigned char* vstage, int i, uint32_t (&a)[4]) {
    if constexpr (!FP8) {
      const int m = lane >> 3;
      const int d = 16 * i + (m & 1) * 8 + (lane & 7), half = m >> 1;
      ldmatrix_x4(a, vstage + d * S::V_ROW_BYTES + ((half ^ ((d >> 2) & 1)) * 16));
    } else {
      const unsigned char* base = vstage + (16 * i + g) * S::V_ROW_BYTES + 2 * t;
      a[0] = fp8x2_to_pair<T, KIND>(*reinterpret_cast<const uint16_t*>(base));
      a[1] = fp8x2_to_pair<T, KIND>(*reinterpret_cast<const uint16_t*>(base + 8 * S::V_ROW_BYTES));
      a[2] = fp8x2_to_pair<T, KIND>(*reinterpret_cast<const uint16_t*>(base + 8));
      a[3] = fp8x2_to_pair<T, KIND>(*reinterpret_cast<const uint16_t*>(base + 8 * S::V_ROW_BYTES + 8));
    }
  };

  // Online softmax state of heads 2t, 2t+1 (max in log2 units; row sums partial over this lane's rows).
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float o[KT][4];  // O^T fragment: dims 16i + g (+8 for [2],[3]) x heads 2t, 2t+1
#pragma unroll
  for (int i = 0; i < KT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  auto compute_tile = [&](int tile, const unsigned char* stage) {
    const int tok0 = tok_begin + tile * kTileTokens;
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // S^T: tokens g, g+8 x heads 2t, 2t+1
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      uint32_t a[4];
      k_fragment(stage, kk, a);
      mma_16816<T>(s, a, qf[kk]);
    }
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = e & 1, pos = tok0 + g + 8 * (e >> 1);
      bool keep = head_ok[j] && pos < tok_end;
      if (sparse) keep = keep && sparse_keep(pos / BS, j);
      x[e] = keep ? s[e] * qk_scale + alibi[j] * static_cast<float>(pos - seq_len + 1) : -INFINITY;
    }
    float pr[4], corr[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float m_new = fmaxf(m_run[j], warp_max_xor(fmaxf(x[j], x[j + 2]), 16, 4));
      const float base = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: avoid inf - inf
      corr[j] = exp2f(m_run[j] - base);
      m_run[j] = m_new;
      pr[j] = exp2f(x[j] - base);
      pr[j + 2] = exp2f(x[j + 2] - base);
      l_run[j] = l_run[j] * corr[j] + pr[j] + pr[j + 2];
    }
    // P^T as the B fragment of V P^T: transpose the two 8x8 halves of the S^T accumulator.
    const uint32_t pb[2] = {movmatrix_trans(pack2<T>(pr[0], pr[1])),
                            movmatrix_trans(pack2<T>(pr[2], pr[3]))};
    const unsigned char* vstage = stage + S::K_TILE_BYTES;
#pragma unroll
    for (int i = 0; i < KT; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][e] *= corr[e & 1];
      uint32_t a[4];
      v_fragment(vstage, i, a);
      mma_16816<T>(o[i], a, pb);
    }
  };

  // Software pipeline over this warp's tiles (warp w takes tiles w, w + 4, ...): STAGES - 1 tiles in
  // flight while one is computed. Every iteration commits a group (maybe empty) so the wait count holds.
  int load_at = next_tile(warp);
#pragma unroll
  for (int s = 0; s < S::STAGES - 1; ++s) {
    if (load_at < n_tiles) {
      load_tile(load_at, ring + s * S::STAGE_BYTES);
      load_at = next_tile(load_at + kDecodeWarps);
    }
    cp_async_commit();
  }
  int stage = 0;
#pragma unroll 1
  for (int tile = next_tile(warp); tile < n_tiles; tile = next_tile(tile + kDecodeWarps)) {
    const int fill = stage == 0 ? S::STAGES - 1 : stage - 1;  // the stage computed last iteration
    if (load_at < n_tiles) {
      load_tile(load_at, ring + fill * S::STAGE_BYTES);
      load_at = next_tile(load_at + kDecodeWarps);
    }
    cp_async_commit();
    cp_async_wait<S::STAGES - 1>();
    __syncwarp();
    compute_tile(tile, ring + stage * S::STAGE_BYTES);
    __syncwarp();
    stage = stage + 1 == S::STAGES ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  __syncwarp();

  // Merge the warps: each publishes (max, sum, O) of its heads in its own ring, then the block combines.
#pragma unroll
  for (int j = 0; j < 2; ++j) l_run[j] = warp_sum_xor(l_run[j], 16, 4);
  float* mine = reinterpret_cast<float*>(ring);
  if (g == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      mine[2 * t + j] = m_run[j];
      mine[kHeadsPerCta + 2 * t + j] = l_run[j];
    }
  }
#pragma unroll
  for (int i = 0; i < KT; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      mine[2 * kHeadsPerCta + (2 * t + (e & 1)) * S::O_STRIDE + 16 * i + g + 8 * (e >> 1)] = o[i][e];
    }
  }
  __syncthreads();

  const float v_scale = FP8 ? *p.v_scale : 1.f;
  const bool split = p.max_partitions > 0;
  for (int idx = threadIdx.x; idx < nheads * (HEAD / 2); idx += kDecodeThreads) {
    const int hh = idx / (HEAD / 2), d = 2 * (idx % (HEAD / 2));
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      m_all = fmaxf(m_all, reinterpret_cast<const float*>(smem + w * S::WARP_SMEM)[hh]);
    }
    float l_all = 0.f, v0 = 0.f, v1 = 0.f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float* src = reinterpret_cast<const float*>(smem + w * S::WARP_SMEM);
        const float f = exp2f(src[hh] - m_all);
        const float* row = src + 2 * kHeadsPerCta + hh * S::O_STRIDE + d;
        l_all += src[kHeadsPerCta + hh] * f;
        v0 += row[0] * f;
        v1 += row[1] * f;
      }
    }
    const float inv = l_all > 0.f ? v_scale / l_all : 0.f;  // no attended token: 0, as the reference
    const int head = head0 + hh;
    if (!split) {
      T* dst = static_cast<T*>(p.out) + seq * p.out_stride_seq + head * p.out_stride_head + d;
      *reinterpret_cast<uint32_t*>(dst) = pack2<T>(v0 * inv, v1 * inv);
    } else {
      const int64_t row = (static_cast<int64_t>(seq) * p.num_heads + head) * p.max_partitions + part;
      if (p.tmp_is_float) {
        *reinterpret_cast<float2*>(static_cast<float*>(p.tmp_out) + row * HEAD + d) =
            make_float2(v0 * inv, v1 * inv);
      } else {
        *reinterpret_cast<uint32_t*>(static_cast<T*>(p.tmp_out) + row * HEAD + d) =
            pack2<T>(v0 * inv, v1 * inv);
      }
      if (d == 0) {
        p.max_logits[row] = m_all * kLn2;  // natural-log units, as vLLM's
        p.exp_sums[row] = l_all;
      }
    }
  }
}

// Merge of the split-K partitions of one (sequence, head): out = sum_p w_p * tmp_out_p / sum_p w_p with
// w_p = exp_sum_p * exp(max_logit_p - max). Partitions past the sequence's end are not read.
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_reduce_kernel(const DecodeParams p, int head_size) {
  extern __shared__ float weights[];  // [max_partitions]
  __shared__ float red[kDecodeWarps];
  const int head = blockIdx.x, seq = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_parts = max(1, (p.seq_lens[seq] + p.partition_size - 1) / p.partition_size);
  const int64_t row = (static_cast<int64_t>(seq) * p.num_heads + head) * p.max_partitions;

  auto block_reduce = [&](float v, bool is_max) {
    v = is_max ? warp_max_xor(v, 16, 1) : warp_sum_xor(v, 16, 1);
    __syncthreads();  // `red` may still be read from a previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int w = 1; w < kDecodeWarps; ++w) v = is_max ? fmaxf(v, red[w]) : v + red[w];
    return v;
  };

  float m = -INFINITY;
  for (int i = threadIdx.x; i < n_parts; i += kDecodeThreads) m = fmaxf(m, p.max_logits[row + i]);
  m = block_reduce(m, true);
  float total = 0.f;
  for (int i = threadIdx.x; i < n_parts; i += kDecodeThreads) {
    const float w = m == -INFINITY ? 0.f : p.exp_sums[row + i] * __expf(p.max_logits[row + i] - m);
    weights[i] = w;
    total += w;
  }
  total = block_reduce(total, false);  // (its barriers also publish `weights`)
  const float inv = total > 0.f ? 1.f / total : 0.f;

  T* out = static_cast<T*>(p.out) + seq * p.out_stride_seq + head * p.out_stride_head;
  for (int d = 2 * threadIdx.x; d < head_size; d += 2 * kDecodeThreads) {
    float a0 = 0.f, a1 = 0.f;
    for (int i = 0; i < n_parts; ++i) {
      float2 v;
      if (p.tmp_is_float) {
        v = *reinterpret_cast<const float2*>(static_cast<const float*>(p.tmp_out) + (row + i) * head_size + d);
      } else {
        const T* src = static_cast<const T*>(p.tmp_out) + (row + i) * head_size + d;
        v = make_float2(to_float(src[0]), to_float(src[1]));
      }
      a0 += weights[i] * v.x;
      a1 += weights[i] * v.y;
    }
    *reinterpret_cast<uint32_t*>(out + d) = pack2<T>(a0 * inv, a1 * inv);
  }
}

}  // namespace pagedllm
