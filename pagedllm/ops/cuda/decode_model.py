"""A decode step of one sequence through every decoder layer of a Llama-family model as ONE CUDA launch
(``csrc/decode_model.cu``: why, and how the weights stream). This is its plan, built once per model: the
table of each layer's weight and cache pointers, the scratch buffers every step reuses (so CUDA graphs can
capture the launch) and the grid (one block per SM).
"""
from __future__ import annotations

import torch

from pagedllm.ops.cuda import load

# The order of a layer's pointers in the table (csrc/decode_model.cu, enum kLn ... kVCache).
_POINTERS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down")
MAX_GEMV_INPUT = 3072  # kMaxK: hidden, intermediate and q widths
MAX_GROUP = 8  # query heads per kv head


class DecodeModelKernel:
    """weights: each layer's LayerWeights (pagedllm.ops.triton.decode_layer); attns: each layer's attention
    (its key_cache and value_cache, "hnd" [blocks, kv_heads, block_size, head_size], read at every call)."""

    def __init__(self, weights, attns, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 device: torch.device) -> None:
        w0, k0 = weights[0], attns[0].key_cache
        self.hidden_size, self.intermediate_size = w0.input_norm.shape[0], w0.down.shape[1]
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        reason = self.unsupported(self.hidden_size, self.intermediate_size, num_heads, num_kv_heads, head_size,
                                  w0.qkv.dtype, k0)
        if reason:
            raise ValueError(f"CUDA decode-model kernel: {reason}")
        load(device)
        self.weights, self.attns, self.scale = weights, attns, scale
        self.eps, self.post_eps, self.qk_eps = w0.eps, w0.post_eps, w0.qk_eps
        self.qk_norm, self.qkv_bias = w0.q_norm is not None, w0.qkv_bias is not None
        self.num_blocks = torch.cuda.get_device_properties(device).multi_processor_count
        partitions = self.num_blocks // num_kv_heads
        group = num_heads // num_kv_heads
        dtype = w0.qkv.dtype

        def buf(n, dtype=dtype):
            return torch.zeros(n, dtype=dtype, device=device)
        self.x = buf(self.hidden_size, torch.float32)  # the last layer's MLP output
        self.residual = buf(self.hidden_size)
        self.res_mid = buf(self.hidden_size)
        self.qkv = buf((num_heads + 2 * num_kv_heads) * head_size)
        self.attn_part = buf(num_kv_heads * partitions * group * (head_size + 2), torch.float32)
        self.attn_out = buf(num_heads * head_size)
        self.o_out = buf(self.hidden_size, torch.float32)
        self.act = buf(self.intermediate_size)
        self.sync = buf(1 + num_kv_heads, torch.int64)  # grid barrier counter, kv heads' arrival counters
        # Weights stay where they are; a layer's cache may be rebound (tests do), so those are checked per call.
        self._weight_pointers = [[getattr(w, name).data_ptr() if getattr(w, name) is not None else 0
                                  for name in _POINTERS] for w in weights]
        self.table = torch.zeros(len(weights), len(_POINTERS) + 2, dtype=torch.int64, device=device)
        self._cache_pointers = None
        self._update_table()
        # int64 [num_blocks, layers, 14] to receive each launch's phase timestamps (decode_model.cu, kTracePoints):
        # benchmarks/decode_layer.py sets it.
        self.trace: torch.Tensor | None = None

    @staticmethod
    def unsupported(hidden_size, intermediate_size, num_heads, num_kv_heads, head_size, dtype,
                    key_cache: torch.Tensor) -> str | None:
        """Why the kernel cannot run this model, or None."""
        if dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {dtype} (float16 or bfloat16)"
        if key_cache.is_cuda and torch.cuda.get_device_capability(key_cache.device)[0] < 9:
            return "bulk copies need a Hopper GPU or newer"
        if (key_cache.dtype != dtype or key_cache.dim() != 4 or key_cache.stride(3) != 1
                or key_cache.stride(2) != head_size):
            return "the KV cache must be 'hnd' [blocks, kv_heads, block_size, head_size], dense, in the model dtype"
        if head_size not in (64, 128):
            return f"head size {head_size} (64 or 128)"
        if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
            return f"{num_heads} heads over {num_kv_heads} kv heads (at most {MAX_GROUP} per kv head)"
        for name, k in (("hidden size", hidden_size), ("intermediate size", intermediate_size),
                        ("q width", num_heads * head_size)):
            if k % 8 or k > MAX_GEMV_INPUT:
                return f"{name} {k} (a multiple of 8 up to {MAX_GEMV_INPUT})"
        return None

    def _update_table(self) -> None:
        """The pointer table, rewritten when a layer's cache was rebound to other memory."""
        caches = [(a.key_cache.data_ptr(), a.value_cache.data_ptr()) for a in self.attns]
        if caches != self._cache_pointers:
            k0 = self.attns[0].key_cache
            if any(t.shape != k0.shape or t.stride() != k0.stride()
                   for a in self.attns for t in (a.key_cache, a.value_cache)):
                raise ValueError("CUDA decode-model kernel: every layer's caches must have one shape and strides")
            self.table.copy_(torch.tensor([w + list(c) for w, c in zip(self._weight_pointers, caches)]))
            self._cache_pointers = caches

    def __call__(self, embedded: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor):
        """(x, residual) after the last layer (x float32 [hidden], residual [hidden]) for one token: embedded
        [1, hidden], its position, cache slot, sequence length and block-table row. Writes the token's K/V
        into every layer's cache."""
        self._update_table()
        k0 = self.attns[0].key_cache
        torch.ops.pagedllm.decode_model_b1(
            embedded, self.x, self.residual, self.res_mid, self.qkv, self.attn_part, self.attn_out, self.o_out,
            self.act, self.sync, self.table, cos_sin_cache, positions, slot_mapping, seq_lens, block_table,
            self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_size,
            k0.shape[2], k0.stride(0), k0.stride(1), self.num_blocks, self.eps, self.post_eps, self.qk_eps,
            self.scale, self.qk_norm, self.qkv_bias, self.trace)
        return self.x, self.residual
