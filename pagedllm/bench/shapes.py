"""Model shapes for benchmarks: config.json contents of well-known models, run with random weights
(load_format="dummy"), so a benchmark needs no checkpoint."""
from __future__ import annotations

import json
import os
import tempfile

QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    dtype="bfloat16")
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    dtype="bfloat16")
# Small enough that a CPU runs a whole benchmark in seconds (the tests use it).
TINY = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)

SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "llama3-8b": LLAMA3_8B, "tiny": TINY}


def model_dir_for(model: str) -> str:
    """A directory the engine can load: a shape name gets a fresh temp dir holding only its config.json; a
    config.json path gives its directory; anything else (a model directory) is returned as is."""
    if model in SHAPES:
        path = tempfile.mkdtemp(prefix=f"pagedllm-{model}-")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(SHAPES[model], f, indent=1)
        return path
    if os.path.basename(model) == "config.json":
        return os.path.dirname(os.path.abspath(model))
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model must be one of {sorted(SHAPES)}, a config.json or a model directory, "
                                f"got {model!r}")
    return model
