"""Triton backend of pagedllm.ops: the vLLM-compatible paged attention ops (same signatures as
``pagedllm.ops.reference``). Importing needs Triton but no GPU; on CPU tensors the kernels run under
TRITON_INTERPRET=1 (fp16/fp32 only)."""
from .cache import reshape_and_cache
from .decode import paged_attention, paged_attention_v1, paged_attention_v2
from .prefill import paged_prefill

__all__ = ["reshape_and_cache", "paged_attention_v1", "paged_attention_v2", "paged_attention", "paged_prefill"]
