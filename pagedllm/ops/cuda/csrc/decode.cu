// Host side of paged decode attention: argument checks, the launch grid, and dispatch onto the kernel
// instantiations (activation type x cache kind x head size; the block size is a kernel argument).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "decode_kernel.cuh"
#include "host_utils.h"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int64_t kV2PartitionSize = 512;    // vLLM's, fixed by the v2 interface
constexpr int64_t kSinglePass = 1 << 30;     // v1: one partition covers any sequence

struct SparseArgs {
  int64_t tp_rank, local_blocks, vert_stride, block_size, head_sliding_step;
};

struct SplitArgs {
  at::Tensor* exp_sums;
  at::Tensor* max_logits;
  at::Tensor* tmp_out;
  int64_t partition_size;
};

template <typename T, CacheKind KIND, int HEAD>
void launch_decode(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  using S = DecodeShape<T, KIND, HEAD>;
  auto* kernel = paged_decode_kernel<T, KIND, HEAD>;
  // Per launch (not once per process): the attribute belongs to the current device.
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::SMEM));
  kernel<<<grid, kDecodeThreads, S::SMEM, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_dense_inner(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
  for (int d = 0; d + 1 < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) % 2 == 0, name, " strides must be even (pairs of elements are moved at once)");
  }
  TORCH_CHECK(aligned(t.data_ptr(), 4), name, " must be 4-byte aligned");
}

void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
            int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
            const std::string& kv_cache_dtype, const at::Tensor& k_scale, const at::Tensor& v_scale,
            const SparseArgs& sparse, const SplitArgs* split) {
  const CacheKind kind = parse_cache_kind(kv_cache_dtype);
  TORCH_CHECK(query.is_cuda() && query.dim() == 3, "query must be a CUDA tensor [num_seqs, num_heads, head_size]");
  check_activation_dtype(query.scalar_type());
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&out, "out"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                         {&block_tables, "block_tables"}, {&seq_lens, "seq_lens"}}) {
    check_cuda(*t, query, name);
  }
  check_scale(k_scale, query, "k_scale");
  check_scale(v_scale, query, "v_scale");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must match query in shape and dtype");
  check_dense_inner(query, "query");
  check_dense_inner(out, "out");
  check_cache_dtype(key_cache, query.scalar_type(), kind, "key_cache");
  check_cache_dtype(value_cache, query.scalar_type(), kind, "value_cache");

  TORCH_CHECK(key_cache.dim() == 5 && value_cache.dim() == 4,
              "key_cache must be [num_blocks, num_kv_heads, head_size/x, block_size, x] and value_cache "
              "[num_blocks, num_kv_heads, head_size, block_size]");
  const int64_t elem = key_cache.element_size(), x = 16 / elem;
  const int64_t bs = value_cache.size(3);
  TORCH_CHECK(key_cache.size(4) == x && key_cache.size(2) * x == head_size && key_cache.size(3) == bs &&
                  value_cache.size(2) == head_size && key_cache.size(0) == value_cache.size(0) &&
                  key_cache.size(1) == num_kv_heads && value_cache.size(1) == num_kv_heads,
              "cache shapes ", shape(key_cache), " / ", shape(value_cache), " do not match head_size ",
              str(head_size), ", num_kv_heads ", str(num_kv_heads), " and x = ", str(x));
  TORCH_CHECK(block_size == bs, "block_size ", str(block_size), " differs from the cache's ", str(bs));
  TORCH_CHECK(bs > 0 && bs % 8 == 0, "block_size must be a multiple of 8, got ", str(bs));
  TORCH_CHECK(key_cache.stride(4) == 1 && key_cache.stride(3) == x && key_cache.stride(2) == bs * x &&
                  value_cache.stride(3) == 1 && value_cache.stride(2) == bs,
              "each cache block of a head must be dense");
  for (const at::Tensor* c : {&key_cache, &value_cache}) {
    TORCH_CHECK(c->stride(0) * elem % 16 == 0 && c->stride(1) * elem % 16 == 0 && aligned(c->data_ptr(), 16),
                "cache blocks must start on 16-byte boundaries");
  }
  check_head_size(head_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads ", str(num_heads),
              " must be a multiple of num_kv_heads ", str(num_kv_heads));
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables must be int32 [num_seqs, max_blocks_per_seq], contiguous rows");
  TORCH_CHECK(seq_lens.numel() == num_seqs && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens must be int32 [num_seqs], contiguous");
  if (alibi_slopes) {
    check_cuda(*alibi_slopes, query, "alibi_slopes");
    TORCH_CHECK(alibi_slopes->numel() == num_heads && alibi_slopes->scalar_type() == at::kFloat &&
                    alibi_slopes->is_contiguous(),
                "alibi_slopes must be float32 [num_heads], contiguous");
  }
  if (sparse.vert_stride > 1) {
    TORCH_CHECK(sparse.block_size > 0 && sparse.local_blocks >= 0 && sparse.tp_rank >= 0,
                "block-sparse attention needs blocksparse_block_size > 0, blocksparse_local_blocks >= 0 "
                "and tp_rank >= 0");
  }
  TORCH_CHECK(num_seqs <= 65535, "at most 65535 sequences per call");

  DecodeParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.alibi_slopes = alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr;
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.q_stride_seq = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.out_stride_seq = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_head = key_cache.stride(1);
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_head = value_cache.stride(1);
  p.block_table_stride = block_tables.stride(0);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.heads_per_kv = static_cast<int>(num_heads / num_kv_heads);
  p.head_chunks = (p.heads_per_kv + kHeadsPerCta - 1) / kHeadsPerCta;
  p.block_size = static_cast<int>(bs);
  p.scale = static_cast<float>(scale);
  p.tp_rank = static_cast<int>(sparse.tp_rank);
  p.sparse_local_blocks = static_cast<int>(sparse.local_blocks);
  p.sparse_vert_stride = static_cast<int>(sparse.vert_stride);
  p.sparse_block_size = static_cast<int>(sparse.block_size);
  p.sparse_head_sliding_step = static_cast<int>(sparse.head_sliding_step);

  int64_t num_partitions = 1;
  if (split == nullptr) {
    p.partition_size = static_cast<int>(kSinglePass);
  } else {
    const int64_t ps = split->partition_size;
    TORCH_CHECK(ps > 0 && ps % kTileTokens == 0 && ps < kSinglePass, "partition_size must be a positive "
                "multiple of ", str(kTileTokens), ", got ", str(ps));
    const at::Tensor &es = *split->exp_sums, &ml = *split->max_logits, &tmp = *split->tmp_out;
    const int64_t max_parts = tmp.dim() == 4 ? tmp.size(2) : -1;
    TORCH_CHECK(tmp.dim() == 4 && tmp.size(0) == num_seqs && tmp.size(1) == num_heads &&
                    tmp.size(3) == head_size && tmp.is_contiguous(),
                "tmp_out must be a contiguous [num_seqs, num_heads, max_num_partitions, head_size]");
    TORCH_CHECK(tmp.scalar_type() == at::kFloat || tmp.scalar_type() == query.scalar_type(),
                "tmp_out must be float32 or the query's dtype");
    for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&es, "exp_sums"}, {&ml, "max_logits"}}) {
      check_cuda(*t, query, name);
      TORCH_CHECK(t->dim() == 3 && t->size(0) == num_seqs && t->size(1) == num_heads &&
                      t->size(2) == max_parts && t->scalar_type() == at::kFloat && t->is_contiguous(),
                  name, " must be a contiguous float32 [num_seqs, num_heads, max_num_partitions]");
    }
    check_cuda(tmp, query, "tmp_out");
    num_partitions = std::max<int64_t>(1, (max_seq_len + ps - 1) / ps);
    TORCH_CHECK(num_partitions <= max_parts || (max_seq_len == 0 && max_parts == 0), "max_seq_len ",
                str(max_seq_len), " needs ", str(num_partitions), " partitions of ", str(ps),
                " tokens, tmp_out has ", str(max_parts));
    if (max_parts == 0) {  // every sequence is empty: the result is 0, and there is no workspace
      out.zero_();
      return;
    }
    TORCH_CHECK(max_parts <= 8192, "at most 8192 partitions (the reduce kernel keeps their weights in shared "
                "memory), got ", str(max_parts));
    p.exp_sums = es.data_ptr<float>();
    p.max_logits = ml.data_ptr<float>();
    p.tmp_out = tmp.data_ptr();
    p.tmp_is_float = tmp.scalar_type() == at::kFloat;
    p.max_partitions = static_cast<int>(max_parts);
    p.partition_size = static_cast<int>(ps);
  }
  if (num_seqs == 0 || num_heads == 0) return;

  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(num_partitions), static_cast<unsigned>(num_kv_heads * p.head_chunks),
                  static_cast<unsigned>(num_seqs));
  const int hs = static_cast<int>(head_size);
  dispatch_types(query.scalar_type(), kind, [&](auto t_tag, auto kind_tag) {
    using T = decltype(t_tag);
    constexpr CacheKind K = decltype(kind_tag)::value;
    dispatch_int<PAGEDLLM_HEAD_SIZES>(hs, [&](auto head) {
      launch_decode<T, K, decltype(head)::value>(p, grid, stream);
    });
    if (split != nullptr) {
      const size_t smem = sizeof(float) * p.max_partitions;
      paged_decode_reduce_kernel<T><<<dim3(p.num_heads, static_cast<unsigned>(num_seqs)), kDecodeThreads,
                                      smem, stream>>>(p, hs);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                        int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t tp_rank, int64_t blocksparse_local_blocks,
                        int64_t blocksparse_vert_stride, int64_t blocksparse_block_size,
                        int64_t blocksparse_head_sliding_step) {
  const SparseArgs sparse{tp_rank, blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
                          blocksparse_head_sliding_step};
  decode(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
         max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sparse, nullptr);
}

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits, at::Tensor& tmp_out,
                        const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes, const std::string& kv_cache_dtype,
                        const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t tp_rank,
                        int64_t blocksparse_local_blocks, int64_t blocksparse_vert_stride,
                        int64_t blocksparse_block_size, int64_t blocksparse_head_sliding_step) {
  const SparseArgs sparse{tp_rank, blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
                          blocksparse_head_sliding_step};
  const SplitArgs split{&exp_sums, &max_logits, &tmp_out, kV2PartitionSize};
  decode(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
         max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sparse, &split);
}

void paged_attention_split(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                           at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                           int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                           const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                           const at::Tensor& v_scale, int64_t partition_size) {
  const SparseArgs dense{0, 0, 0, 64, 0};
  const SplitArgs split{&exp_sums, &max_logits, &tmp_out, partition_size};
  decode(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
         max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, dense, &split);
}

}  // namespace pagedllm
