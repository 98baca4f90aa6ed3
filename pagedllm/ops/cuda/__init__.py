"""pagedllm's CUDA C++ ops backend (``csrc/``), registered as the torch operators ``torch.ops.pagedllm.*``.

The functions here have the signatures of :mod:`pagedllm.ops` (vLLM's ``_custom_ops`` order; semantics in
:mod:`pagedllm.ops.reference`) and take CUDA tensors: float16/bfloat16 activations, "auto" or fp8
(uint8 bits) caches in the seed layout, head sizes 64/80/96/112/128/256, block sizes that are multiples
of 8. Importing this module is free; the library is built (cached, see :mod:`.build`) and loaded on the
first op call or by :func:`load`, which raises :class:`CudaOpsUnavailable` (an ImportError) when that
cannot work here, so a caller choosing backends can fall back to Triton.

``paged_prefill`` has no CUDA kernel: it is the Triton op, so ``attention_backend="cuda"`` runs the whole
engine. ``paged_attention`` (the engine's decode) picks a single pass or split-K with
:func:`decode_partition_size`, whose knobs (:data:`TUNING`) and the explicit
:func:`paged_attention_split` exist so that benchmarks can sweep them.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import torch

from pagedllm.ops.cuda.build import CudaOpsUnavailable, load_library
from pagedllm.ops.reference import PARTITION_SIZE

__all__ = ["CudaOpsUnavailable", "load", "reshape_and_cache", "paged_attention_v1", "paged_attention_v2",
           "paged_attention_split", "paged_attention", "paged_prefill", "xattn_sparse_supported",
           "xattn_sparse_attention", "decode_partition_size",
           "DecodeTuning", "TUNING", "PARTITION_SIZE", "HEADS_PER_CTA"]

OPS = ("paged_attention_v1", "paged_attention_v2", "paged_attention_split", "reshape_and_cache",
       "xattn_sparse_attention")
HEADS_PER_CTA = 8  # query heads of one kv head per thread block (kHeadsPerCta in csrc/decode_kernel.cuh)
_fakes_registered = False
_ready: set = set()  # devices whose library is loaded: the per-call fast path


def load(device: torch.device | int | None = None) -> None:
    """Build (first time) and load the op library for ``device`` and register the ops' fake
    implementations; raises CudaOpsUnavailable with the reason when that is impossible."""
    global _fakes_registered
    load_library(device)
    if not _fakes_registered:
        for name in OPS:
            torch.library.register_fake(f"pagedllm::{name}")(_writes_only)
        _fakes_registered = True
    _ready.add(device)


def _writes_only(*args, **kwargs) -> None:
    """Fake (meta) implementation of every op: they only write into their `Tensor!` arguments."""
    return None


def _ops(device: torch.device):
    if device not in _ready:
        load(device)
    return torch.ops.pagedllm


_scale_tensors: dict = {}


def _scale(scale, device: torch.device) -> torch.Tensor:
    """k_scale / v_scale as the ops take them: a one-element float32 tensor on ``device``. Tensors for
    Python floats are cached, except while a CUDA graph is captured: a tensor filled during capture
    holds its value only once the graph replays."""
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32).reshape(1)
    key = (float(scale), device)
    tensor = _scale_tensors.get(key)
    if tensor is None:
        tensor = torch.full((1,), key[0], dtype=torch.float32, device=device)
        if not torch.cuda.is_current_stream_capturing():
            _scale_tensors[key] = tensor
    return tensor


def _slopes(alibi_slopes):
    return None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous()


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    dev = key.device
    _ops(dev).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                _scale(k_scale, dev), _scale(v_scale, dev))


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                       tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0):
    dev = query.device
    _ops(dev).paged_attention_v1(
        out, query, key_cache, value_cache, num_kv_heads, float(scale), block_tables, seq_lens, block_size,
        max_seq_len, _slopes(alibi_slopes), kv_cache_dtype, _scale(k_scale, dev), _scale(v_scale, dev),
        tp_rank, blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
        blocksparse_head_sliding_step)


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                       scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                       kv_cache_dtype, k_scale, v_scale, tp_rank=0, blocksparse_local_blocks=0,
                       blocksparse_vert_stride=0, blocksparse_block_size=64,
                       blocksparse_head_sliding_step=0):
    dev = query.device
    _ops(dev).paged_attention_v2(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, float(scale),
        block_tables, seq_lens, block_size, max_seq_len, _slopes(alibi_slopes), kv_cache_dtype,
        _scale(k_scale, dev), _scale(v_scale, dev), tp_rank, blocksparse_local_blocks,
        blocksparse_vert_stride, blocksparse_block_size, blocksparse_head_sliding_step)


def paged_attention_split(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                          block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                          partition_size: int):
    """Decode with an explicit split: ``partition_size`` tokens (a multiple of 16) per thread block and
    float32 partials merged by the reduce kernel; 0 runs the single pass (v1)."""
    if partition_size == 0:
        paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                           block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale)
        return
    num_seqs, num_heads, head_size = query.shape
    dev = query.device
    parts = max(1, -(-max_seq_len // partition_size))
    stats = torch.empty((2, num_seqs, num_heads, parts), dtype=torch.float32, device=dev)
    tmp_out = torch.empty((num_seqs, num_heads, parts, head_size), dtype=torch.float32, device=dev)
    _ops(dev).paged_attention_split(
        out, stats[0], stats[1], tmp_out, query, key_cache, value_cache, num_kv_heads, float(scale),
        block_tables, seq_lens, block_size, max_seq_len, _slopes(alibi_slopes), kv_cache_dtype,
        _scale(k_scale, dev), _scale(v_scale, dev), partition_size)


@dataclasses.dataclass
class DecodeTuning:
    """How :func:`paged_attention` splits a decode batch over the sequence (see decode_partition_size)."""
    min_partition: int = 512          # shortest partition considered (tokens, a multiple of 16)
    cta_overhead_tokens: int = 256    # fixed cost of a thread block (prologue, merge, reduce), in tokens
    ctas_per_sm: int = 1              # thread blocks one SM runs side by side at full bandwidth


TUNING = DecodeTuning()
_MAX_WAVES = 8  # past this many waves, wave quantization costs < 1/8: not worth more candidates


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_partition_size(num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int,
                          num_sms: int, tuning: DecodeTuning = TUNING) -> int:
    """Tokens per split-K partition for a decode batch, or 0 for the single pass.

    Model: a thread block streams its partition at a fixed rate, so the batch takes as long as the
    busiest SM's tokens, ceil(blocks / slots) * (partition + overhead) with slots = SMs x ctas_per_sm
    (a GPU-filling wave of single-pass blocks needs no split). For each wave count up to
    _MAX_WAVES the most partitions that still fit it is a candidate; the least time wins, ties go to
    fewer partitions."""
    ctas = max(1, num_seqs * num_kv_heads * -(-(num_heads // num_kv_heads) // HEADS_PER_CTA))
    slots = num_sms * tuning.ctas_per_sm
    max_parts = max(1, max_seq_len // tuning.min_partition)
    candidates = sorted({1} | {min(max_parts, w * slots // ctas) for w in range(1, _MAX_WAVES + 1)} - {0})
    best, best_cost = 0, None
    for parts in candidates:
        size = 0 if parts == 1 else (-(-max_seq_len // parts) + 15) // 16 * 16
        cost = -(-ctas * parts // slots) * ((size or max_seq_len) + tuning.cta_overhead_tokens)
        if best_cost is None or cost < best_cost:
            best, best_cost = size, cost
    return best


def paged_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                    block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale):
    """The engine's decode op: single pass or split-K, as :func:`decode_partition_size` says."""
    dev = query.device
    load(dev)
    size = decode_partition_size(query.shape[0], query.shape[1], num_kv_heads, max_seq_len,
                                 _num_sms(dev.index if dev.index is not None else torch.cuda.current_device()))
    paged_attention_split(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                          block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, size)


def xattn_sparse_supported(query, key, block_size) -> bool:
    """Whether :func:`xattn_sparse_attention` runs these shapes: bf16, head 128, 128-token blocks, on Hopper."""
    return (query.dtype == key.dtype == torch.bfloat16 and query.shape[-1] == 128 and block_size == 128
            and torch.cuda.get_device_capability(query.device)[0] == 9)


def xattn_sparse_attention(out, query, key, value, kv_idx, kv_count, stride_ob, stride_ot, stride_oh, group, qk_scale,
                           causal):
    """XAttention's block-sparse attention over listed key blocks (csrc/sparse_attention.cu): the CUDA twin of
    the Triton kernel in :mod:`pagedllm.ops.xattention.sparse_attention`, which builds the arguments."""
    _ops(query.device).xattn_sparse_attention(out, query, key, value, kv_idx, kv_count, stride_ob, stride_ot,
                                              stride_oh, group, qk_scale, causal)


def paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                  query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
                  v_scale):
    """No CUDA C++ prefill kernel: the Triton op (same cache layout) serves prefills."""
    triton_ops = importlib.import_module("pagedllm.ops.triton")
    triton_ops.paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                             seq_lens, query_start_loc, max_query_len, max_seq_len, alibi_slopes,
                             kv_cache_dtype, k_scale, v_scale)
