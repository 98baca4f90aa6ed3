"""Decode steps of one sequence through the decoder-layer kernel (pagedllm.ops.triton.decode_layer): five
launches per layer instead of ~9 kernels, for Llama-family models with 16-bit weights on the fused path.

LlamaModel.forward asks `fused_decode` on every forward pass; it answers only for a decode-only step of one
token (the forward context says so) whose layers the kernel covers, so everything else (prefills, batches,
fp8 caches, ALiBi, biases outside q/k/v) keeps the layers' own path. PAGEDLLM_DECODE_LAYER: 0 turns it off
(the layers' fused path then runs those steps, as before), "persistent" runs each layer as one launch with
grid barriers (decode_layer says why that is not the default). Read at every step, so a test or an A/B run
can switch it between steps.
"""
from __future__ import annotations

import os

import torch

from pagedllm.layers.attention import Attention, get_forward_context
from pagedllm.layers.linear import SplitKSums
from pagedllm.layers.norm import fused_kernels

ENV_VAR = "PAGEDLLM_DECODE_LAYER"


class FusedDecode:
    """The model's layers as the kernel reads them, and the kernel's plan; built once per model and mode."""

    def __init__(self, model, kernel) -> None:
        self.kernel = kernel
        self.cos_sin_cache = model.rotary_emb.cos_sin_cache
        self.weights = [_layer_weights(layer) for layer in model.layers]
        self.attns: list[Attention] = [layer.self_attn.attn for layer in model.layers]

    def __call__(self, embedded: torch.Tensor, positions: torch.Tensor):
        """(the last layer's output as SplitKSums, residual): what the model's final norm takes."""
        meta = get_forward_context()
        k = self.kernel
        k.begin_step()
        x = embedded
        for i, (w, attn) in enumerate(zip(self.weights, self.attns)):
            k(i, x, w, attn.key_cache, attn.value_cache, attn.scale, self.cos_sin_cache, positions,
              meta.slot_mapping, meta.decode_seq_lens, meta.decode_block_tables)
            x = k.x
        return SplitKSums(k.x.view(1, 1, -1)), k.residual.view(1, -1)


def _layer_weights(layer):
    from pagedllm.ops.triton.decode_layer import LayerWeights
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        input_norm=layer.input_layernorm.weight, qkv=attn.qkv_proj.weight, qkv_bias=attn.qkv_proj.bias,
        q_norm=attn.q_norm.weight if attn.qk_norm else None, k_norm=attn.k_norm.weight if attn.qk_norm else None,
        o=attn.o_proj.weight, post_norm=layer.post_attention_layernorm.weight, gate_up=mlp.gate_up_proj.weight,
        down=mlp.down_proj.weight, eps=layer.input_layernorm.eps, post_eps=layer.post_attention_layernorm.eps,
        qk_eps=attn.q_norm.eps if attn.qk_norm else 0.0)


def _build(model, device: torch.device, persistent: bool) -> FusedDecode | None:
    from pagedllm.ops.triton.decode_layer import DecoderLayerKernel, default_programs
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    dtype = attn.qkv_proj.weight.dtype
    shape = (layer.input_layernorm.weight.shape[0], mlp.down_proj.in_features, attn.num_heads, attn.num_kv_heads,
             attn.head_dim, dtype)
    if (dtype not in (torch.float16, torch.bfloat16) or attn.attn.alibi_slopes is not None
            or any(p.bias is not None for p in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            or DecoderLayerKernel.unsupported(*shape, default_programs(device)) is not None):
        return None
    return FusedDecode(model, DecoderLayerKernel(*shape, device, persistent=persistent))


def fused_decode(model, input_ids: torch.Tensor) -> FusedDecode | None:
    """The model's FusedDecode if this forward pass is a step it runs, else None."""
    if input_ids.shape[0] != 1 or fused_kernels(input_ids) is None:
        return None
    mode = os.environ.get(ENV_VAR, "1").strip().lower()
    if mode in ("0", "false", "off", "no"):
        return None
    meta = get_forward_context()
    if (meta.num_decode_tokens != 1 or meta.graph_split is not None
            or model.layers[0].self_attn.attn.kv_cache_dtype != "auto"):
        return None
    persistent = mode == "persistent"
    plans = getattr(model, "_fused_decode", None)
    if plans is None:
        plans = model._fused_decode = {}  # mode -> FusedDecode, or None where the kernel does not apply
    if persistent not in plans:
        plans[persistent] = _build(model, input_ids.device, persistent)
    return plans[persistent]
