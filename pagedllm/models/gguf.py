"""GGUF file -> Hugging Face model directory (config.json, safetensors, tokenizer, generation_config.json).

Our own reader over the `gguf` package: metadata gives the config, tensors are dequantized with
gguf.quants.dequantize and renamed to HF names, and llama.cpp's Q/K row permutation is undone for the
llama architecture. Imported only on the GGUF path: the `gguf` package is optional.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

# Part of the conversion cache key: bump when the output of convert_gguf changes.
CONVERTER_VERSION = 1

# GGUF general.architecture -> (HF architectures[0], HF model_type)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Bounds host memory while converting: tensors are written in shards of about this many bytes.
_SHARD_BYTES = 2 << 30


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF form of `gguf_path` into the existing directory `out_dir`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = gguf.GGUFReader(gguf_path)
    config = gguf_config(reader)
    AutoConfig.for_model(**config).save_pretrained(out_dir)
    _write_weights(reader, config, out_dir)

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)
    eos = [_get(reader.fields, "tokenizer.ggml.eos_token_id")]
    # The end-of-turn token ends a chat reply too, when the model has a distinct one.
    eot = _get(reader.fields, "tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos:
        eos.append(eot)
    GenerationConfig(bos_token_id=_get(reader.fields, "tokenizer.ggml.bos_token_id"),
                     eos_token_id=eos[0] if len(eos) == 1 else eos,
                     pad_token_id=_get(reader.fields, "tokenizer.ggml.padding_token_id")).save_pretrained(out_dir)


def gguf_config(reader: gguf.GGUFReader) -> dict:
    """HF config fields from the GGUF metadata, model_type included (AutoConfig.for_model takes them as is)."""
    fields = reader.fields
    arch = _get(fields, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}")
    hf_arch, model_type = _ARCHITECTURES[arch]

    def field(key, default=None):
        return _get(fields, f"{arch}.{key}", default)

    num_heads = field("attention.head_count")
    hidden = field("embedding_length")
    vocab = field("vocab_size") or len(fields["tokenizer.ggml.tokens"].data)
    config = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "intermediate_size": field("feed_forward_length"),
        "num_hidden_layers": field("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": field("attention.head_count_kv", num_heads),
        "head_dim": field("attention.key_length") or field("rope.dimension_count") or hidden // num_heads,
        "rms_norm_eps": field("attention.layer_norm_rms_epsilon"),
        "rope_theta": field("rope.freq_base", 10000.0),
        "max_position_embeddings": field("context_length"),
        "vocab_size": vocab,
        # llama.cpp drops output.weight when the head shares the embedding.
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _get(fields, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _get(fields, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _get(fields, "tokenizer.ggml.padding_token_id"),
    }
    scaling = field("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported (only 'linear')")
        config["rope_scaling"] = {"rope_type": "linear", "factor": field("rope.scaling.factor")}
    return config


def iter_gguf_tensors(reader: gguf.GGUFReader, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) one at a time: F16 stays float16, everything else is dequantized to float32."""
    permute = config["model_type"] == "llama"
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if t.tensor_type == gguf.GGMLQuantizationType.F16:
            w = np.asarray(t.data).view(np.float16)
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims innermost first
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rows(w, config["num_attention_heads"])
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rows(w, config["num_key_value_heads"])
        yield name, torch.from_numpy(np.array(w))  # a copy: F32/F16 data are read-only views of the file


def hf_tensor_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m is None or m[2] not in _LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not supported by the converter")
    return f"model.layers.{m[1]}.{_LAYER_TENSORS[m[2]]}.{suffix}"


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores each head's rows interleaved (pairs (i, i + D/2) adjacent) for its GPT-J style RoPE;
    HF's rotate_half wants the two halves contiguous. This reverses llama.cpp's permute()."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_weights(reader: gguf.GGUFReader, config: dict, out_dir: Path) -> None:
    """One model.safetensors, or shards + index when the dequantized weights exceed _SHARD_BYTES."""
    sizes = [t.n_elements * (2 if t.tensor_type == gguf.GGMLQuantizationType.F16 else 4) for t in reader.tensors]
    shard_of, shard, filled = [], 0, 0
    for size in sizes:
        if filled and filled + size > _SHARD_BYTES:
            shard, filled = shard + 1, 0
        shard_of.append(shard)
        filled += size
    num_shards = shard + 1
    names = (["model.safetensors"] if num_shards == 1 else
             [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)])
    weight_map, pending = {}, {}
    for i, (name, tensor) in enumerate(iter_gguf_tensors(reader, config)):
        pending[name] = tensor
        weight_map[name] = names[shard_of[i]]
        if i + 1 == len(sizes) or shard_of[i + 1] != shard_of[i]:
            save_file(pending, out_dir / names[shard_of[i]], metadata={"format": "pt"})
            pending = {}
    if num_shards > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _get(fields: dict, key: str, default=None):
    return fields[key].contents() if key in fields else default
