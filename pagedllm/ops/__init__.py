"""pagedllm's attention ops, dispatched per call to a backend.

Public ops (vLLM ``_custom_ops`` argument order, see ``reference.py`` for the semantics):
``reshape_and_cache``, ``paged_attention_v1``, ``paged_attention_v2``, ``paged_attention`` (the engine's
decode op), ``paged_prefill`` and ``kv_cache_shapes`` (the cache layout the chosen backend wants).

Backends are modules exposing the same function names:
``reference`` (pure PyTorch, any device), ``triton`` (``pagedllm.ops.triton``) and ``cuda``
(``pagedllm.ops.cuda``). A backend other than the reference is imported only when chosen, so CPU-only
machines never import Triton or CUDA code.

Choice, highest priority first:
1. ``set_backend(name)`` (the engine pins a backend from its config);
2. the environment variable ``PAGEDLLM_OPS_BACKEND`` = reference | triton | cuda (empty or "auto":
   no override), read once when first needed and again after ``set_backend(...)``;
3. automatic by device: "triton" for CUDA tensors when it imports (else the reference, with a
   warning), "reference" for everything else. In automatic mode an op the backend lacks falls back
   to the reference; an explicitly chosen backend that lacks an op raises NotImplementedError.

The choice is resolved once per (op, device type) and cached; ``set_backend`` (also ``None``, which
returns to env/automatic choice) clears the cache.
"""
from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType
from typing import Callable

from pagedllm.ops import reference as _reference
from pagedllm.ops.reference import KV_CACHE_DTYPES, PARTITION_SIZE  # noqa: F401  (re-exports)

ENV_VAR = "PAGEDLLM_OPS_BACKEND"
BACKENDS = {
    "reference": "pagedllm.ops.reference",
    "triton": "pagedllm.ops.triton",
    "cuda": "pagedllm.ops.cuda",
}
OPS = ("reshape_and_cache", "paged_attention_v1", "paged_attention_v2", "paged_attention",
       "paged_prefill", "kv_cache_shapes")

__all__ = [*OPS, "PARTITION_SIZE", "KV_CACHE_DTYPES", "BACKENDS", "ENV_VAR", "get_backend",
           "set_backend"]

_pinned: str | None = None
_override: tuple[str, str] | None = None  # (backend name, where it came from)
_override_read = False
_modules: dict[str, ModuleType] = {"reference": _reference}
_fns: dict[tuple[str, str], Callable] = {}
_warned = False


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown pagedllm ops backend {name!r} (from {source}); "
                         f"expected one of {', '.join(BACKENDS)}")
    return name


def set_backend(name: str | None) -> None:
    """Pin every op to backend ``name`` ("reference", "triton", "cuda"), or with None go back to the
    environment variable / automatic choice. Clears the cached resolution either way."""
    global _pinned, _override, _override_read
    if name is not None:
        name = _check_name(str(name).strip().lower(), "set_backend()")
    _pinned = name
    _override, _override_read = None, False
    _fns.clear()
    for key in [k for k in _modules if k != "reference"]:
        del _modules[key]


def _get_override() -> tuple[str, str] | None:
    global _override, _override_read
    if not _override_read:
        if _pinned is not None:
            _override = (_pinned, "set_backend()")
        else:
            env = os.environ.get(ENV_VAR, "").strip().lower()
            source = f"environment variable {ENV_VAR}={env!r}"
            _override = None if env in ("", "auto") else (_check_name(env, source), source)
        _override_read = True
    return _override


def _load(name: str, source: str) -> ModuleType:
    mod = _modules.get(name)
    if mod is None:
        try:
            mod = importlib.import_module(BACKENDS[name])
        except ImportError as e:
            raise ImportError(f"pagedllm ops backend {name!r} (chosen by {source}) could not be "
                              f"imported: {e}") from e
        _modules[name] = mod
    return mod


def _device_type(device) -> str:
    if device is None:
        return "cpu"
    return getattr(device, "type", None) or str(device).split(":")[0]


def _auto_module(device_type: str) -> ModuleType:
    global _warned
    if device_type != "cuda":
        return _reference
    try:
        return _load("triton", "automatic choice for CUDA tensors")
    except ImportError as e:
        if not _warned:
            warnings.warn(f"{e}; using the pure-PyTorch reference ops on CUDA", RuntimeWarning,
                          stacklevel=4)
            _warned = True
        return _reference


def get_backend(device=None) -> ModuleType:
    """The backend module chosen for tensors on ``device`` (torch.device, "cpu", "cuda:0", ...)."""
    over = _get_override()
    if over is not None:
        return _load(*over)
    return _auto_module(_device_type(device))


def _v1_as_decode(mod: ModuleType) -> Callable:
    v1 = mod.paged_attention_v1

    def paged_attention(*args):
        return v1(*args)
    return paged_attention


def _resolve(op: str, device_type: str) -> Callable:
    fn = _fns.get((op, device_type))
    if fn is not None:
        return fn
    over = _get_override()
    mod = _load(*over) if over is not None else _auto_module(device_type)
    fn = getattr(mod, op, None)
    if fn is None and op == "paged_attention" and hasattr(mod, "paged_attention_v1"):
        fn = _v1_as_decode(mod)
    if fn is None and op == "kv_cache_shapes":
        fn = _reference.kv_cache_shapes  # a backend that declares no layout uses the seed layout
    if fn is None:
        if over is not None:
            raise NotImplementedError(f"pagedllm ops backend {over[0]!r} (chosen by {over[1]}) "
                                      f"does not implement {op}")
        fn = getattr(_reference, op)
    _fns[(op, device_type)] = fn
    return fn


# ----------------------------------------------------------------------------------------------------
# Public ops
# ----------------------------------------------------------------------------------------------------
def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                      v_scale) -> None:
    _resolve("reshape_and_cache", key.device.type)(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                       tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0) -> None:
    _resolve("paged_attention_v1", query.device.type)(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
        max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank,
        blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
        blocksparse_head_sliding_step)


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                       scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                       kv_cache_dtype, k_scale, v_scale, tp_rank=0, blocksparse_local_blocks=0,
                       blocksparse_vert_stride=0, blocksparse_block_size=64,
                       blocksparse_head_sliding_step=0) -> None:
    _resolve("paged_attention_v2", query.device.type)(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
        block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
        v_scale, tp_rank, blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
        blocksparse_head_sliding_step)


def paged_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                    block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale) -> None:
    """The engine's decode op: the backend picks its own best path (single pass or split-K)."""
    _resolve("paged_attention", query.device.type)(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
        max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale)


def paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                  query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
                  v_scale) -> None:
    _resolve("paged_prefill", query.device.type)(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale)


def kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_size, dtype, kv_cache_dtype, device=None):
    """``(key_shape, value_shape, cache_torch_dtype)`` wanted by the backend chosen for ``device``
    (default: CPU choice, i.e. the seed layout unless a backend is pinned or set by the env var)."""
    return _resolve("kv_cache_shapes", _device_type(device))(
        num_blocks, block_size, num_kv_heads, head_size, dtype, kv_cache_dtype)
