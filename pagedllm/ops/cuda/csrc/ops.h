// The CUDA implementations behind the `pagedllm::` torch operators (schemas in registration.cpp).
// Argument order and meaning follow vLLM's _custom_ops; see pagedllm/ops/reference.py for semantics.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace pagedllm {

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                        int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t tp_rank, int64_t blocksparse_local_blocks,
                        int64_t blocksparse_vert_stride, int64_t blocksparse_block_size,
                        int64_t blocksparse_head_sliding_step);

// vLLM's v2: split-K over partitions of 512 tokens, then the reduce kernel.
void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits, at::Tensor& tmp_out,
                        const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes, const std::string& kv_cache_dtype,
                        const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t tp_rank,
                        int64_t blocksparse_local_blocks, int64_t blocksparse_vert_stride,
                        int64_t blocksparse_block_size, int64_t blocksparse_head_sliding_step);

// v2 with a chosen partition size (a multiple of 16 tokens) and a float32 or activation-typed tmp_out:
// what the engine's decode uses when it splits, and what the benchmarks sweep.
void paged_attention_split(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                           at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                           int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                           const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                           const at::Tensor& v_scale, int64_t partition_size);

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale);

// One decode step of one sequence through every decoder layer in one launch (decode_model.cu). `layers`: int64
// [num_layers, 11] device pointers per layer (input norm, qkv, qkv bias, q norm, k norm, o, post norm, gate_up,
// down, key cache, value cache); the buffers are the step's scratch and results (x, residual). trace: optional
// int64 [num_blocks, num_layers, 12] phase timestamps (decode_model.cu, kTracePoints).
void decode_model_b1(const at::Tensor& x_in, at::Tensor& x, at::Tensor& residual, at::Tensor& res_mid,
                     at::Tensor& qkv, at::Tensor& attn_part, at::Tensor& attn_out, at::Tensor& o_out,
                     at::Tensor& act, at::Tensor& sync, const at::Tensor& layers, const at::Tensor& cos_sin_cache,
                     const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                     const at::Tensor& block_table, int64_t hidden, int64_t inter, int64_t heads,
                     int64_t kv_heads, int64_t head_size, int64_t block_size, int64_t cache_stride_block,
                     int64_t cache_stride_head, int64_t num_blocks, double eps, double post_eps, double qk_eps,
                     double scale, bool qk_norm, bool qkv_bias, const std::optional<at::Tensor>& trace);

// XAttention's block-sparse attention on Hopper (sparse_attention.cu): query/key/value [batch, heads, len, 128]
// bf16; the listed key blocks as pagedllm/ops/xattention/sparse_attention.py builds them.
void xattn_sparse_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& kv_idx, const at::Tensor& kv_count, int64_t stride_ob, int64_t stride_ot,
                            int64_t stride_oh, int64_t group, double qk_scale, bool causal);

}  // namespace pagedllm
