"""Triton backend of pagedllm.ops: the vLLM-compatible paged attention ops (same signatures as
``pagedllm.ops.reference``). Importing needs Triton but no GPU; on CPU tensors the kernels run under
TRITON_INTERPRET=1 (fp16/fp32 only).

Every kernel reads both cache layouts of ``reference.kv_cache_shapes``; the engine's own cache on this
backend is "hnd" (``kv_cache_shapes``), whose dense [block_size, head_size] pages the tiled loads stream
faster than vLLM's 16-byte-interleaved key pages (benchmarks/results/README.md)."""
import functools

from pagedllm.ops.reference import kv_cache_shapes as _kv_cache_shapes

from .cache import reshape_and_cache
from .decode import paged_attention, paged_attention_v1, paged_attention_v2
from .prefill import paged_prefill

kv_cache_shapes = functools.partial(_kv_cache_shapes, layout="hnd")

__all__ = ["reshape_and_cache", "paged_attention_v1", "paged_attention_v2", "paged_attention", "paged_prefill",
           "kv_cache_shapes"]
