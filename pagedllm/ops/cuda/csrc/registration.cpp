// The `pagedllm` torch operator library: schemas (with mutation annotations, so torch.compile and
// functionalization know what each op writes) and their CUDA implementations. Loaded from Python with
// torch.ops.load_library; the fake (meta) implementations are registered in pagedllm/ops/cuda/__init__.py.
#include <torch/library.h>

#include "ops.h"

#define PAGEDLLM_DECODE_ARGS                                                                      \
  "Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, float scale, "          \
  "Tensor block_tables, Tensor seq_lens, int block_size, int max_seq_len, Tensor? alibi_slopes, " \
  "str kv_cache_dtype, Tensor k_scale, Tensor v_scale"
#define PAGEDLLM_SPARSE_ARGS                                                                  \
  "int tp_rank=0, int blocksparse_local_blocks=0, int blocksparse_vert_stride=0, "           \
  "int blocksparse_block_size=64, int blocksparse_head_sliding_step=0"

TORCH_LIBRARY(pagedllm, m) {
  m.def("paged_attention_v1(Tensor! out, " PAGEDLLM_DECODE_ARGS ", " PAGEDLLM_SPARSE_ARGS ") -> ()");
  m.def("paged_attention_v2(Tensor! out, Tensor! exp_sums, Tensor! max_logits, Tensor! tmp_out, "
        PAGEDLLM_DECODE_ARGS ", " PAGEDLLM_SPARSE_ARGS ") -> ()");
  m.def("paged_attention_split(Tensor! out, Tensor! exp_sums, Tensor! max_logits, Tensor! tmp_out, "
        PAGEDLLM_DECODE_ARGS ", int partition_size) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
        "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()");
  // Also writes the new token's K/V into the caches that `layers` points to.
  m.def("decode_model_b1(Tensor x_in, Tensor! x, Tensor! residual, Tensor! res_mid, Tensor! qkv, "
        "Tensor! attn_part, Tensor! attn_out, Tensor! o_out, Tensor! act, Tensor! sync, Tensor layers, "
        "Tensor cos_sin_cache, Tensor positions, Tensor slot_mapping, Tensor seq_lens, Tensor block_table, "
        "int hidden, int inter, int heads, int kv_heads, int head_size, int block_size, int cache_stride_block, "
        "int cache_stride_head, int num_blocks, float eps, float post_eps, float qk_eps, float scale, "
        "bool qk_norm, bool qkv_bias, Tensor(t!)? trace=None) -> ()");
  m.def("xattn_sparse_attention(Tensor! out, Tensor query, Tensor key, Tensor value, Tensor kv_idx, Tensor kv_count, "
        "int stride_ob, int stride_ot, int stride_oh, int group, float qk_scale, bool causal) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CUDA, m) {
  m.impl("paged_attention_v1", &pagedllm::paged_attention_v1);
  m.impl("paged_attention_v2", &pagedllm::paged_attention_v2);
  m.impl("paged_attention_split", &pagedllm::paged_attention_split);
  m.impl("reshape_and_cache", &pagedllm::reshape_and_cache);
  m.impl("decode_model_b1", &pagedllm::decode_model_b1);
  m.impl("xattn_sparse_attention", &pagedllm::xattn_sparse_attention);
}
