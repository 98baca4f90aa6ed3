"""EngineConfig: every engine knob, named like vLLM's, validated once with clear errors."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
CUDAGRAPH_MODES = ("full_and_piecewise", "full_decode_only", "piecewise", "none")


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str | None = None
    seed: int = 0
    load_format: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # On the CPU there is no device memory to fill: the pool gets this many bytes unless num_kv_blocks is set.
    cpu_kv_cache_space_gb: float = 1.0
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # The most logprobs a request may ask for per token (vLLM's default: 20).
    max_logprobs: int = 20
    # Where requests' sampling defaults come from, as vLLM's --generation-config: "auto" the model's
    # generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "vllm"
    # SamplingParams' own, or a folder holding a generation_config.json.
    generation_config: str = "auto"
    attention_backend: str | None = None
    # No CUDA graphs at all (same as cudagraph_mode="none").
    enforce_eager: bool = False
    # vLLM's names: "full_and_piecewise" replays whole-step graphs for decode-only steps and piecewise graphs
    # (everything but attention) for the others; "full_decode_only", "piecewise" or "none" keep one or neither.
    cudagraph_mode: str = "full_and_piecewise"
    # Schedule and queue step N+1 before reading back step N's tokens, so the host's work overlaps the
    # device's (vLLM's --async-scheduling). Steps with repetition/frequency/presence penalties still wait.
    async_scheduling: bool = True
    # XAttention block-sparse prefill for prompts of at least xattn_min_prompt_len tokens (off by default).
    sparse_prefill: str | None = None
    xattn_threshold: float = 0.9
    xattn_stride: int = 8
    xattn_block_size: int = 128
    xattn_min_prompt_len: int = 8192
    # One block selection per kv head, from its query heads' block scores added together, so that a group's heads
    # read the same K/V blocks (benchmarks/results/README.md, sixteenth session: on real text ~6% more blocks and
    # a lower error than per-head selection; eighteenth: on the H100 the sparse attention 3-9% faster).
    xattn_share_kv_heads: bool = False
    # Score Q and K in fp8 (e4m3, a scale per stride tokens) in the estimate (nineteenth session: ~1% of the kept
    # blocks change on real text, the attention error does not).
    xattn_fp8_estimate: bool = False

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} requested but CUDA is not available")
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        self.cudagraph_mode = str(self.cudagraph_mode).lower()
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        if self.attention_backend not in (None, "reference", "triton", "cuda"):
            raise ValueError(f"attention_backend must be reference, triton or cuda, got {self.attention_backend!r}")

        if self.sparse_prefill not in (None, "xattention"):
            raise ValueError(f"sparse_prefill must be None or 'xattention', got {self.sparse_prefill!r}")
        if not 0.0 < self.xattn_threshold <= 1.0:
            raise ValueError(f"xattn_threshold must be in (0, 1], got {self.xattn_threshold}")
        if self.xattn_stride < 1 or self.xattn_block_size < 1 or self.xattn_block_size % self.xattn_stride:
            raise ValueError(f"xattn_block_size ({self.xattn_block_size}) must be a positive multiple of "
                             f"xattn_stride ({self.xattn_stride})")
        if self.xattn_min_prompt_len < 1:
            raise ValueError(f"xattn_min_prompt_len must be >= 1, got {self.xattn_min_prompt_len}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {sorted(names - {'model'})}")
        return cls(model=model, **kwargs)

    def graph_modes(self) -> tuple[bool, bool]:
        """(decode-only steps in whole-step graphs, other steps in piecewise graphs)."""
        mode = "none" if self.enforce_eager else self.cudagraph_mode
        return mode in ("full_and_piecewise", "full_decode_only"), mode in ("full_and_piecewise", "piecewise")

    def torch_dtype(self, model_dtype: torch.dtype | None) -> torch.dtype:
        """'auto' keeps a half-precision checkpoint's dtype on the GPU and uses float32 on the CPU."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.device == "cpu":
            return torch.float32
        return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16

    def resolve_lengths(self, model_max_len: int) -> None:
        """Fix max_model_len and the token budget once the model's own limit is known."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's limit {model_max_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.block_size)
