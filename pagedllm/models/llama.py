"""Llama-family decoder: LlamaForCausalLM (SmolLM2 is one), Qwen2ForCausalLM (qkv bias) and Qwen3ForCausalLM
(per-head q/k RMSNorm before RoPE, free head_dim). Flat batch: input_ids [T], positions [T], no padding.

Module names follow HF checkpoints, except that q/k/v and gate/up are fused into one matmul each;
`load_weights` writes HF's separate tensors into their row ranges of the fused weights.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention, Rope
from pagedllm.layers.linear import ResidualLinear
from pagedllm.layers.norm import RMSNorm, fused_kernels
from pagedllm.layers.rotary import RotaryEmbedding, rope_config
from pagedllm.models.fused_decode import fused_decode


class MergedLinear(nn.Linear):
    """Projections of the same input stacked along the output dim; `shards` maps each HF name to its rows."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.shards[name] = (start, size)
            start += size


# HF projection name -> the fused module holding it.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


class LlamaAttention(nn.Module):

    def __init__(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size,
                                     {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
                                     bias=qkv_bias)
        self.o_proj = ResidualLinear(self.q_size, config.hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        rope = Rope(positions, self.rotary_emb, (self.q_norm, self.k_norm) if self.qk_norm else None)
        return self.o_proj(self.attn(q, k, v, rope))


class LlamaMLP(nn.Module):

    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size},
            bias=bias)
        self.down_proj = ResidualLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), self.act_fn)


class LlamaDecoderLayer(nn.Module):

    def __init__(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, qkv_bias, o_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        theta, scaling = rope_config(config)
        self.rotary_emb = RotaryEmbedding(head_dim(config), config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.rotary_emb, qkv_bias, o_bias, qk_norm)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        decode = fused_decode(self, input_ids)
        if decode is not None:  # a decode step of few sequences: the decoder-layer kernel
            hidden, residual = decode(input_ids, positions)
        else:
            hidden, residual = self.embed_tokens(input_ids), None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # Per-architecture differences, overridden by the subclasses below.
    qkv_bias_default = False  # Llama: config.attention_bias sets q/k/v/o biases together
    qk_norm = False

    def __init__(self, config) -> None:
        super().__init__()
        _check_supported(config)
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = self.qkv_bias_default or attention_bias
        o_bias = attention_bias
        self.config = config
        self.model = LlamaModel(config, qkv_bias, o_bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab, hidden]: the embedding's where they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden] (only the positions to sample) -> logits [N, vocab] in the model's dtype (into out
        where given): a greedy step takes the argmax as it is, and the sampler upcasts only when it has more to
        do."""
        weight = self.head_weight()
        kernels = fused_kernels(hidden)
        if kernels is not None and kernels.head_supported(hidden, weight):  # decode steps of few sequences
            return kernels.head_linear(hidden, weight, out)
        return nn.functional.linear(hidden, weight) if out is None else torch.matmul(hidden, weight.t(), out=out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters (cast and moved by copy_, one tensor at a time).
        Raises ValueError on an unknown name, a shape mismatch or a parameter left unloaded."""
        params = dict(self.named_parameters())
        expected = {(n, None) for n in params if not _is_fused(n)}
        expected |= {(f"{m}.{p}", shard) for m, mod in self.named_modules() if isinstance(mod, MergedLinear)
                     for p, _ in mod.named_parameters() for shard in mod.shards}
        loaded = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue  # HF buffers we recompute; the head is the embedding when tied
            prefix, _, leaf = name.rpartition(".")
            module_path, _, proj = prefix.rpartition(".")
            fused_name = f"{module_path}.{_FUSED.get(proj)}.{leaf}"
            if fused_name in params:
                start, size = self.get_submodule(f"{module_path}.{_FUSED[proj]}").shards[proj]
                key, target = (fused_name, proj), params[fused_name].data.narrow(0, start, size)
            elif name in params:
                key, target = (name, None), params[name].data
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(key)
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


def head_dim(config) -> int:
    # Qwen3 sets head_dim independently of hidden_size / num_heads; older configs leave it out.
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _is_fused(param_name: str) -> bool:
    return param_name.rsplit(".", 2)[-2] in ("qkv_proj", "gate_up_proj")


def _check_supported(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True  # q/k/v carry biases, o_proj does not


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
