"""Host-side helpers shared by the Triton op wrappers: argument decoding that costs no device work."""
import functools

import torch
import triton

# kv_cache_dtype string -> fp8 format code used by the kernels (0: cache holds the query dtype).
_FP8_KIND = {"auto": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2}


def fp8_kind(kv_cache_dtype: str) -> int:
    try:
        return _FP8_KIND[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected one of {sorted(_FP8_KIND)}")


def scale_args(k_scale, v_scale):
    """Return (k_scale, v_scale, is_pointer). Tensors are read inside the kernel so no host sync happens."""
    k_is_tensor = isinstance(k_scale, torch.Tensor)
    if k_is_tensor != isinstance(v_scale, torch.Tensor):
        raise TypeError("k_scale and v_scale must both be tensors or both be floats")
    if k_is_tensor:
        return k_scale, v_scale, True
    return float(k_scale), float(v_scale), False


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 queries (CPU tests, debugging) should not silently drop to tf32 on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2_at_least(n: int, floor: int = 1) -> int:
    return max(triton.next_power_of_2(n), floor)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter has no SMs; behave like an H100 so the split logic still runs
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def cache_layout(key_cache: torch.Tensor, value_cache: torch.Tensor):
    """(LAYOUT, BLOCK_SIZE, X) of a cache pair for the kernels' `cache_offsets`: LAYOUT 0 is vLLM's
    K [blocks, heads, D/x, block_size, x] / V [blocks, heads, D, block_size], 1 is "hnd" (both
    [blocks, heads, block_size, D]). The kernels vectorise along the innermost dims, so those must be dense;
    the outer dims are read through the caches' first three strides."""
    if key_cache.dim() == 4:
        if value_cache.shape != key_cache.shape or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
            raise ValueError("'hnd' caches must both be [blocks, kv_heads, block_size, head_size] with a dense "
                             f"head_size dim; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
        return 1, key_cache.shape[2], 1
    x = key_cache.shape[-1]
    if key_cache.stride(-1) != 1 or key_cache.stride(-2) != x:
        raise ValueError("key_cache must be dense in its [block_size, x] dims")
    bs = value_cache.shape[-1]
    if value_cache.stride(-1) != 1 or any(st % bs for st in value_cache.stride()[:-1]):
        raise ValueError("value_cache must be dense in its block_size dim with block-aligned outer strides")
    return 0, bs, x
