"""The attention half of a batch-1 decoder layer (norm, qkv, q/k norm + RoPE, the cache write, attention,
o_proj) as one launch of 8-block thread-block clusters, one per kv head (``csrc/decode_cluster.cu``: why). The
Triton decoder-layer kernel (pagedllm/ops/triton/decode_layer.py) runs it in place of its first three phases
where PAGEDLLM_DECODE_LAYER=cluster.
"""
from __future__ import annotations

import torch

from pagedllm.ops.cuda import CudaOpsUnavailable, load


def unsupported(hidden_size: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                device: torch.device) -> str | None:
    """Why the kernel cannot run this model's layers here, or None (builds the CUDA op library)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return "thread-block clusters need an NVIDIA GPU"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "thread-block clusters need a Hopper GPU or newer"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (float16 or bfloat16)"
    try:
        load(device)
        torch.ops.pagedllm.decode_cluster_check(hidden_size, num_heads, num_kv_heads, head_size, dtype.itemsize)
    except CudaOpsUnavailable as e:
        return f"the CUDA op library is unavailable ({e})"
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def attention(x, residual, res_mid, o_out, w, key_cache, value_cache, scale, cos_sin_cache, positions, slot_mapping,
              seq_lens, block_table) -> None:
    """One layer's attention half for one token: x (float32, or the model dtype for layer 0) and residual its
    input; writes res_mid (the residual stream after the add), o_out [hidden, kv_heads] (o_proj's partial sums
    per kv head) and the token's K/V into the caches. w: the layer's LayerWeights."""
    torch.ops.pagedllm.decode_cluster_attention(
        x, residual, res_mid, o_out, w.input_norm, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, w.o, key_cache,
        value_cache, cos_sin_cache, positions, slot_mapping, seq_lens, block_table, w.eps, w.qk_eps, scale)
