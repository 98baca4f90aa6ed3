"""Decode steps of a few sequences through a fused kernel, for Llama-family models with 16-bit weights on the fused
path: by default the Triton decoder-layer kernel (pagedllm.ops.triton.decode_layer: five launches per layer instead of
~9 kernels, for up to its MAX_ROWS sequences).

LlamaModel.forward asks `fused_decode` on every forward pass; it answers only for a decode-only step (the forward
context says so) of few enough sequences whose layers the kernel covers, so everything else (prefills, larger batches,
fp8 caches, ALiBi, biases outside q/k/v, a row reading a block another row writes in the step) keeps the layers' own
path. The CUDA kernel takes one sequence.
PAGEDLLM_DECODE_LAYER: unset or 1 takes the kernel only where it requests each program's weight shares whole (where they
would stream in slices, as Llama 3 8B's do, the layers are faster); "triton" takes it wherever it runs; 0 turns it off
(the layers' fused path then runs those steps, as before); "persistent" runs each layer as one launch with grid barriers
(decode_layer says why that is not the default); "cuda" runs the whole model as one CUDA launch whose weights stream
independently of the layers' dependency chain (pagedllm/ops/cuda/decode_model.py; slower than the default so far,
benchmarks/results/README.md), where the CUDA op library builds and the model fits it. Read at every step, so a test or
an A/B run can switch it between steps.
"""
from __future__ import annotations

import logging
import os

import torch

from pagedllm.layers.attention import Attention, get_forward_context
from pagedllm.layers.linear import SplitKSums
from pagedllm.layers.norm import fused_kernels

logger = logging.getLogger(__name__)

ENV_VAR = "PAGEDLLM_DECODE_LAYER"
MODES = ("auto", "triton", "persistent", "cuda")


class FusedDecode:
    """The model's layers as the Triton kernel reads them, and the kernel's plan; built once per model and mode."""

    def __init__(self, model, kernel) -> None:
        self.max_rows = kernel.max_rows
        self.kernel = kernel
        self.cos_sin_cache = model.rotary_emb.cos_sin_cache
        self.embedding = model.embed_tokens.weight
        self.weights = [_layer_weights(layer) for layer in model.layers]
        self.attns: list[Attention] = [layer.self_attn.attn for layer in model.layers]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """(the last layer's output as SplitKSums, residual): what the model's final norm takes."""
        meta = get_forward_context()
        k = self.kernel
        x, embedding, rows = input_ids, self.embedding, input_ids.shape[0]
        for i, (w, attn) in enumerate(zip(self.weights, self.attns)):
            k(i, x, w, attn.key_cache, attn.value_cache, attn.scale, self.cos_sin_cache, positions,
              meta.slot_mapping, meta.decode_seq_lens, meta.decode_block_tables, meta.decode_max_seq_len,
              embedding=embedding)
            x, embedding = k.x[:rows], None
        return SplitKSums(x[None]), k.residual[:rows]


def _layer_weights(layer):
    from pagedllm.ops.triton.decode_layer import LayerWeights
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        input_norm=layer.input_layernorm.weight, qkv=attn.qkv_proj.weight, qkv_bias=attn.qkv_proj.bias,
        q_norm=attn.q_norm.weight if attn.qk_norm else None, k_norm=attn.k_norm.weight if attn.qk_norm else None,
        o=attn.o_proj.weight, post_norm=layer.post_attention_layernorm.weight, gate_up=mlp.gate_up_proj.weight,
        down=mlp.down_proj.weight, eps=layer.input_layernorm.eps, post_eps=layer.post_attention_layernorm.eps,
        qk_eps=attn.q_norm.eps if attn.qk_norm else 0.0)


class CudaDecode:
    """The whole-model CUDA kernel's plan; built once per model."""
    max_rows = 1

    def __init__(self, model, kernel) -> None:
        self.kernel = kernel
        self.cos_sin_cache = model.rotary_emb.cos_sin_cache
        self.embed_tokens = model.embed_tokens

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor):
        meta = get_forward_context()
        x, residual = self.kernel(self.embed_tokens(input_ids), self.cos_sin_cache, positions, meta.slot_mapping,
                                  meta.decode_seq_lens, meta.decode_block_tables)
        return SplitKSums(x.view(1, 1, -1)), residual.view(1, -1)


def _build(model, device: torch.device, mode: str) -> FusedDecode | CudaDecode | None:
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    dtype = attn.qkv_proj.weight.dtype
    shape = (layer.input_layernorm.weight.shape[0], mlp.down_proj.in_features, attn.num_heads, attn.num_kv_heads,
             attn.head_dim, dtype)
    if (dtype not in (torch.float16, torch.bfloat16) or attn.attn.alibi_slopes is not None
            or any(p.bias is not None for p in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj))):
        return None
    if mode == "cuda":
        return _build_cuda(model, device, shape)
    from pagedllm.ops.triton.decode_layer import DecoderLayerKernel, default_programs
    programs = default_programs(device)
    if (DecoderLayerKernel.unsupported(*shape, programs) is not None
            or mode == "auto" and DecoderLayerKernel.streams_weights(*shape, programs)):
        return None
    return FusedDecode(model, DecoderLayerKernel(*shape, device, persistent=mode == "persistent"))


def _build_cuda(model, device: torch.device, shape) -> CudaDecode | None:
    from pagedllm.ops.cuda import CudaOpsUnavailable
    from pagedllm.ops.cuda.decode_model import DecodeModelKernel
    attn = model.layers[0].self_attn
    attns = [layer.self_attn.attn for layer in model.layers]
    if device.type != "cuda" or DecodeModelKernel.unsupported(*shape, attns[0].key_cache) is not None:
        return None
    try:
        return CudaDecode(model, DecodeModelKernel([_layer_weights(layer) for layer in model.layers], attns,
                                                   attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                   attn.attn.scale, device))
    except CudaOpsUnavailable as e:
        logger.warning("%s=cuda: the CUDA op library is unavailable (%s); decode steps take the layers' path",
                       ENV_VAR, e)
        return None


def fused_decode(model, input_ids: torch.Tensor) -> FusedDecode | CudaDecode | None:
    """The model's fused decode plan if this forward pass is a step it runs, else None."""
    mode = os.environ.get(ENV_VAR, "1").strip().lower()
    if mode in ("0", "false", "off", "no"):
        return None
    mode = "auto" if mode in ("1", "true", "on", "yes") else mode
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected 0, 1 or one of " + ", ".join(MODES))
    rows = input_ids.shape[0]
    if fused_kernels(input_ids) is None:
        return None
    meta = get_forward_context()
    if (meta.num_decode_tokens != rows or meta.graph_split is not None or meta.decode_rows_share_blocks
            or model.layers[0].self_attn.attn.kv_cache_dtype != "auto"):
        return None
    plans = getattr(model, "_fused_decode", None)
    if plans is None:
        plans = model._fused_decode = {}  # mode -> plan, or None where no kernel applies
    if mode not in plans:
        plans[mode] = _build(model, input_ids.device, mode)
    plan = plans[mode]
    return plan if plan is not None and rows <= plan.max_rows else None
