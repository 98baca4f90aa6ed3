"""Pure-PyTorch reference attention ops: the oracle every fast kernel is tested against.

Runs on any device (it is also the CPU backend of the engine). Argument order and meaning follow vLLM's
``_custom_ops`` (seeds 001 and 004). Cache layouts (declared once, in :func:`kv_cache_shapes`):

* "vllm" (the seeds'; this backend's and the CUDA backend's own):
  key_cache ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``, x = 16 bytes / element size,
  value_cache ``[num_blocks, num_kv_heads, head_size, block_size]``;
* "hnd" (the Triton backend's own): both ``[num_blocks, num_kv_heads, block_size, head_size]``, so a
  page of one head is one dense run of rows, what Triton's tiled loads and tensor-core operands want.

Every op here accepts either (told apart by the key cache's rank) through :func:`as_vllm_layout` views.

Token ``t`` of a sequence lives in physical block ``block_table[t // block_size]`` at offset
``t % block_size``; a slot is ``block * block_size + offset``. With an fp8 ``kv_cache_dtype`` the caches
are uint8 tensors (float8 tensors of the right kind are accepted too) holding float8 bits of
``value / scale``, saturated to the finite range; reading multiplies by the scale again.

Numerics: logits, softmax and the value reduction run in float32 (float64 for float64 queries); the
result is cast to ``out``'s dtype. Work is vectorized over sequences (decode, in length-sorted chunks of
bounded memory) or over the query tokens of one sequence (prefill); nothing loops per token.
"""
from __future__ import annotations

import math

import torch

PARTITION_SIZE = 512  # tokens per split-K partition of paged_attention_v2
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_LAYOUTS = ("vllm", "hnd")
_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_AUTO_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CHUNK_ELEMS = 1 << 24  # bound on the padded K (or V, or logits) elements gathered at once


# ----------------------------------------------------------------------------------------------------
# Layout and quantization helpers (reused by every backend)
# ----------------------------------------------------------------------------------------------------
def fp8_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The torch float8 dtype an fp8 ``kv_cache_dtype`` stores, or None for "auto"."""
    if kv_cache_dtype == "auto":
        return None
    try:
        return _FP8_DTYPES[kv_cache_dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES}") from None


def cache_x(cache_dtype: torch.dtype) -> int:
    """Elements of ``cache_dtype`` per 16 bytes: the innermost dimension of the key cache."""
    size = cache_dtype.itemsize
    if 16 % size:
        raise ValueError(f"cache dtype {cache_dtype} has an element size that does not divide 16 bytes")
    return 16 // size


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                    dtype: torch.dtype, kv_cache_dtype: str, layout: str = "vllm"):
    """``(key_cache_shape, value_cache_shape, cache_torch_dtype)`` of the paged KV cache of one layer in
    ``layout`` ("vllm" or "hnd", see the module doc).

    ``dtype`` is the model dtype; the cache holds it for "auto" and uint8 (float8 bits) for fp8."""
    if layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"unknown KV cache layout {layout!r}; expected one of {KV_CACHE_LAYOUTS}")
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if fp8_dtype(kv_cache_dtype) is None:
        if dtype not in _AUTO_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype 'auto' needs a floating model dtype, got {dtype}")
        cache_dtype = dtype
    else:
        cache_dtype = torch.uint8
    x = cache_x(cache_dtype)
    if head_size % x:
        raise ValueError(f"head_size {head_size} is not divisible by x={x} "
                         f"(16 bytes of {cache_dtype}, kv_cache_dtype {kv_cache_dtype!r})")
    if layout == "hnd":
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        return shape, shape, cache_dtype
    return ((num_blocks, num_kv_heads, head_size // x, block_size, x),
            (num_blocks, num_kv_heads, head_size, block_size), cache_dtype)


def _hnd_shape(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(num_blocks, num_kv_heads, block_size, head_size, x) of an "hnd" cache pair (a 4-D key cache), checked."""
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"an 'hnd' key_cache {tuple(key_cache.shape)} needs a value_cache of the same "
                         f"shape, got {tuple(value_cache.shape)}")
    nb, hkv, bs, head_size = key_cache.shape
    x = cache_x(key_cache.dtype)
    if head_size % x or key_cache.stride(-1) != 1:
        raise ValueError(f"an 'hnd' key_cache needs a dense head_size dim divisible by x={x}, got shape "
                         f"{tuple(key_cache.shape)} strides {key_cache.stride()}")
    return nb, hkv, bs, head_size, x


def as_vllm_layout(key_cache: torch.Tensor, value_cache: torch.Tensor):
    """The cache pair as "vllm"-layout tensors: itself, or views of an "hnd" pair (a 4-D key cache)."""
    if key_cache.dim() != 4:
        return key_cache, value_cache
    *_, head_size, x = _hnd_shape(key_cache, value_cache)
    return (key_cache.unflatten(-1, (head_size // x, x)).transpose(2, 3), value_cache.transpose(2, 3))


def _scale_value(scale, device):
    """k_scale / v_scale: a Python number or a one-element float tensor (kept on device: no sync)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"KV cache scales must have one element, got shape {tuple(scale.shape)}")
        return scale.reshape(()).to(device=device, dtype=torch.float32)
    scale = float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"KV cache scales must be positive and finite, got {scale}")
    return scale


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str, scale, cache_dtype: torch.dtype | None = None):
    """Values as the cache stores them: uint8 float8 bits of ``x / scale`` (saturated to the finite
    range, so nothing overflows to inf/NaN) for fp8; ``x`` cast to ``cache_dtype`` for "auto"."""
    f8 = fp8_dtype(kv_cache_dtype)
    if f8 is None:
        return x.to(cache_dtype or x.dtype)
    fmax = torch.finfo(f8).max
    y = (x.float() / _scale_value(scale, x.device)).clamp_(-fmax, fmax)
    return y.to(f8).view(torch.uint8)


def dequantize_kv(c: torch.Tensor, kv_cache_dtype: str, scale, dtype: torch.dtype = torch.float32):
    """Inverse of :func:`quantize_kv`: cache elements (uint8 bits or float8 values) times ``scale``."""
    f8 = fp8_dtype(kv_cache_dtype)
    if f8 is None:
        return c.to(dtype)
    if c.dtype == torch.uint8:
        c = c.view(f8)
    elif c.dtype != f8:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs a uint8 or {f8} cache, got {c.dtype}")
    return (c.float() * _scale_value(scale, c.device)).to(dtype)


# ----------------------------------------------------------------------------------------------------
# Validation and gathering
# ----------------------------------------------------------------------------------------------------
def _check_caches(key_cache, value_cache, kv_cache_dtype):
    """Validate the cache pair (either layout) from its shapes, making no views (the Triton ops check every call);
    return (num_blocks, num_kv_heads, head_size, block_size)."""
    f8 = fp8_dtype(kv_cache_dtype)
    hnd = key_cache.dim() == 4
    if hnd:
        nb, hkv, bs, head_size, _ = _hnd_shape(key_cache, value_cache)
    elif key_cache.dim() != 5 or value_cache.dim() != 4:
        raise ValueError("key_cache must be [num_blocks, num_kv_heads, head_size/x, block_size, x] and "
                         "value_cache [num_blocks, num_kv_heads, head_size, block_size]; got shapes "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) "
                         "differ in dtype")
    if f8 is None and key_cache.dtype not in _AUTO_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype 'auto' needs a floating cache, got {key_cache.dtype} "
                         "(an fp8 cache needs kv_cache_dtype 'fp8', 'fp8_e4m3' or 'fp8_e5m2')")
    if f8 is not None and key_cache.dtype not in (torch.uint8, f8):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs a uint8 or {f8} cache, "
                         f"got {key_cache.dtype}")
    if hnd:
        return nb, hkv, head_size, bs
    nb, hkv, d_x, bs, x = key_cache.shape
    if x != cache_x(key_cache.dtype):
        raise ValueError(f"key_cache's last dim is {x}, expected x={cache_x(key_cache.dtype)} "
                         f"(16 bytes of {key_cache.dtype})")
    if tuple(value_cache.shape) != (nb, hkv, d_x * x, bs):
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} does not match key_cache shape "
                         f"{tuple(key_cache.shape)} (expected {(nb, hkv, d_x * x, bs)})")
    return nb, hkv, d_x * x, bs


def check_attention_args(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                         block_size, alibi_slopes, kv_cache_dtype, num_seqs):
    """Validate an attention op's tensors from their shapes and dtypes alone, reading no values (so every backend
    can afford it: no host synchronisation); return (num_blocks, num_kv_heads, head_size, block_size,
    num_heads)."""
    nb, hkv, head_size, bs = _check_caches(key_cache, value_cache, kv_cache_dtype)
    if query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(f"query must be [*, num_heads, {head_size}], got {tuple(query.shape)}")
    if tuple(out.shape) != tuple(query.shape):
        raise ValueError(f"out shape {tuple(out.shape)} differs from query shape {tuple(query.shape)}")
    num_heads = query.shape[1]
    if num_kv_heads != hkv or num_heads % hkv:
        raise ValueError(f"num_kv_heads={num_kv_heads} must equal the cache's {hkv} and divide "
                         f"num_heads={num_heads}")
    if block_size is not None and block_size != bs:
        raise ValueError(f"block_size={block_size} differs from the cache's block size {bs}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks_per_seq], "
                         f"got {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (num_heads,):
        raise ValueError(f"alibi_slopes must be [{num_heads}], got {tuple(alibi_slopes.shape)}")
    return nb, hkv, head_size, bs, num_heads


def check_split_workspace(exp_sums, max_logits, tmp_out, query) -> int:
    """Validate paged_attention_v2's partition workspace for query's shape; return its number of partitions."""
    num_seqs, num_heads, head_size = query.shape
    parts = tmp_out.shape[2] if tmp_out.dim() == 4 else -1
    if tuple(tmp_out.shape) != (num_seqs, num_heads, parts, head_size) or \
            tuple(exp_sums.shape) != (num_seqs, num_heads, parts) or exp_sums.shape != max_logits.shape:
        raise ValueError("tmp_out must be [num_seqs, num_heads, max_num_partitions, head_size] and "
                         "exp_sums/max_logits [num_seqs, num_heads, max_num_partitions]; got "
                         f"{tuple(tmp_out.shape)}, {tuple(exp_sums.shape)}, {tuple(max_logits.shape)}")
    return parts


def _check_lens(lens, max_seq_len, block_tables, bs):
    if not lens:
        return
    if min(lens) < 0:
        raise ValueError("seq_lens must be non-negative")
    if max(lens) > max_seq_len:
        raise ValueError(f"a sequence has {max(lens)} tokens, more than max_seq_len={max_seq_len}")
    need = -(-max(lens) // bs)
    if need > block_tables.shape[1]:
        raise ValueError(f"block table too short: a sequence of {max(lens)} tokens needs {need} blocks "
                         f"of {bs}, block_tables has {block_tables.shape[1]} columns")


def _block_rows(block_tables, rows, lens_t, n_blocks, bs, num_blocks):
    """Physical block ids [n, n_blocks] of the listed sequences; entries past a sequence's last
    block are never read from the table (replaced by 0, masked later)."""
    table = block_tables[rows, :n_blocks].long()
    used = torch.arange(n_blocks, device=table.device)[None, :] < ((lens_t + bs - 1) // bs)[:, None]
    vals = table[used]
    if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= num_blocks):
        raise ValueError(f"block_tables holds a block id outside [0, {num_blocks}) for a used block")
    return torch.where(used, table, torch.zeros_like(table))


def _gather_kv(key_cache, value_cache, blocks, kv_cache_dtype, k_scale, v_scale, dtype):
    """K and V of whole blocks, token-major: [n, num_kv_heads, n_blocks * block_size, head_size]."""
    n, n_blocks = blocks.shape
    _, hkv, d_x, bs, x = key_cache.shape
    if key_cache.dtype in _FP8_DTYPES.values():  # gather float8 caches as raw bytes
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    k = key_cache[blocks].permute(0, 2, 1, 4, 3, 5).reshape(n, hkv, n_blocks * bs, d_x * x)
    v = value_cache[blocks].permute(0, 2, 1, 4, 3).reshape(n, hkv, n_blocks * bs, d_x * x)
    return (dequantize_kv(k, kv_cache_dtype, k_scale, dtype),
            dequantize_kv(v, kv_cache_dtype, v_scale, dtype))


def _compute_dtype(query):
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def _decode_chunks(query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                   block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sparse):
    """Yield ``(seq_idx, lens, logits [n, H, L], values [n, Hkv, L, D])`` for chunks of sequences of
    similar length; masked logits are -inf and values past a sequence's end are zeroed (unwritten
    cache slots may hold NaN). Arguments were validated by the caller."""
    (num_seqs, num_heads, head_size), (nb, hkv, _, bs) = query.shape, value_cache.shape
    lens = [int(v) for v in seq_lens.tolist()]
    _check_lens(lens, max_seq_len, block_tables, bs)
    dev, cdt, group = query.device, _compute_dtype(query), num_heads // hkv
    per_token = max(hkv * head_size, num_heads)
    order = sorted(range(num_seqs), key=lens.__getitem__)
    start = 0
    while start < num_seqs:
        # a chunk: consecutive lengths within 2x of its shortest (bounded padding), bounded memory
        end, cap = start + 1, 2 * max(lens[order[start]], 64)
        while end < num_seqs and lens[order[end]] <= cap and \
                (end - start + 1) * lens[order[end]] * per_token <= _CHUNK_ELEMS:
            end += 1
        rows = order[start:end]
        start = end
        seq_idx = torch.tensor(rows, device=dev, dtype=torch.long)
        lens_t = torch.tensor([lens[r] for r in rows], device=dev, dtype=torch.long)
        max_len = max(lens[r] for r in rows)
        if max_len == 0:
            continue
        n_blocks = -(-max_len // bs)
        blocks = _block_rows(block_tables, seq_idx, lens_t, n_blocks, bs, nb)
        k, v = _gather_kv(key_cache, value_cache, blocks, kv_cache_dtype, k_scale, v_scale, cdt)
        k, v = k[:, :, :max_len], v[:, :, :max_len]
        n = len(rows)
        q = query[seq_idx].to(cdt).view(n, hkv, group, head_size)
        logits = torch.matmul(q, k.transpose(-1, -2)).view(n, num_heads, max_len) * scale
        pos = torch.arange(max_len, device=dev)
        if alibi_slopes is not None:
            rel = (pos[None, :] - (lens_t[:, None] - 1)).to(cdt)
            logits = logits + alibi_slopes.to(cdt)[None, :, None] * rel[:, None, :]
        valid = pos[None, :] < lens_t[:, None]  # [n, L]
        keep = valid[:, None, :]
        if sparse is not None:
            keep = keep & _sparse_keep(sparse, pos, lens_t, bs, num_heads, hkv, dev)
        logits = logits.masked_fill(~keep, float("-inf"))
        v = v.masked_fill(~valid[:, None, :, None], 0.0)
        yield seq_idx, lens_t, logits, v


def _sparse_keep(sparse, pos, lens_t, bs, num_heads, hkv, dev):
    """vLLM's block-sparse rule (seed 001) as a [n, H, L] keep mask. The key's sparse block id is
    taken from the start of its cache block, exactly as the kernel does."""
    tp_rank, local_blocks, vert_stride, sp_block, step = sparse
    k_bs = (pos // bs * bs) // sp_block  # [L]
    q_bs = (lens_t - 1) // sp_block  # [n]
    heads = torch.arange(num_heads, device=dev)
    if step >= 0:  # sliding on query heads
        offset = (tp_rank * num_heads + heads) * step + 1
    else:  # sliding on kv heads
        offset = (tp_rank * hkv + heads // (num_heads // hkv)) * (-step) + 1
    remote = (k_bs[None, :] + offset[:, None]) % vert_stride == 0  # [H, L]
    local = k_bs[None, :] > (q_bs[:, None] - local_blocks)  # [n, L]
    return remote[None, :, :] | local[:, None, :]


def _sparse_args(tp_rank, local_blocks, vert_stride, sp_block, step):
    if vert_stride <= 1:  # vLLM's rule: block-sparse only when vert_stride > 1
        return None
    if sp_block <= 0 or local_blocks < 0 or tp_rank < 0:
        raise ValueError("block-sparse attention needs blocksparse_block_size > 0, "
                         "blocksparse_local_blocks >= 0 and tp_rank >= 0")
    return (tp_rank, local_blocks, vert_stride, sp_block, step)


def _weighted_values(probs, v, num_heads, hkv):
    """probs [n, H, L] times V [n, Hkv, L, D], query heads grouped per kv head -> [n, H, D]."""
    n, _, length = probs.shape
    o = torch.matmul(probs.view(n, hkv, num_heads // hkv, length), v)  # [n, Hkv, G, D]
    return o.view(n, num_heads, v.shape[-1])


def _safe_max(m):
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


# ----------------------------------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------------------------------
def check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype):
    """Validate reshape_and_cache's tensors from their shapes alone (as check_attention_args); return
    (num_blocks, num_kv_heads, head_size, block_size)."""
    nb, hkv, head_size, bs = _check_caches(key_cache, value_cache, kv_cache_dtype)
    if key.dim() != 3 or tuple(key.shape[1:]) != (hkv, head_size) or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, {hkv}, {head_size}], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(f"slot_mapping must be 1-D with at most {key.shape[0]} entries, "
                         f"got {tuple(slot_mapping.shape)}")
    return nb, hkv, head_size, bs


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Write ``key``/``value`` [num_tokens, num_kv_heads, head_size] into the paged caches at
    ``slot_mapping`` [n] (n <= num_tokens: extra trailing tokens, e.g. CUDA-graph padding, are
    ignored); slot -1 is skipped."""
    key_cache, value_cache = as_vllm_layout(key_cache, value_cache)
    nb, hkv, head_size, bs = check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    idx = torch.nonzero(slots >= 0).squeeze(1)
    if bool((slots < -1).any()) or idx.numel() and int(slots.max()) >= nb * bs:
        raise ValueError(f"slot_mapping entries must be -1 (skip) or in [0, {nb * bs}) "
                         f"({nb} blocks of {bs} slots)")
    if idx.numel() == 0:
        return
    slots = slots[idx]
    blk, off = slots // bs, slots % bs
    x = key_cache.shape[4]
    f8 = fp8_dtype(kv_cache_dtype)
    kc = key_cache.view(torch.uint8) if f8 is not None and key_cache.dtype != torch.uint8 else key_cache
    vc = value_cache.view(torch.uint8) if f8 is not None and value_cache.dtype != torch.uint8 else value_cache
    k = quantize_kv(key[idx], kv_cache_dtype, k_scale, kc.dtype)
    v = quantize_kv(value[idx], kv_cache_dtype, v_scale, vc.dtype)
    kc[blk, :, :, off, :] = k.reshape(-1, hkv, head_size // x, x)
    vc[blk, :, :, off] = v


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                       tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0):
    """Single-pass decode attention: one query token per sequence, attending to its ``seq_len``
    cached tokens through ``block_tables``. Writes ``out`` [num_seqs, num_heads, head_size] in place."""
    key_cache, value_cache = as_vllm_layout(key_cache, value_cache)
    check_attention_args(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                         block_size, alibi_slopes, kv_cache_dtype, query.shape[0])
    sparse = _sparse_args(tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                          blocksparse_block_size, blocksparse_head_sliding_step)
    hkv, num_heads = key_cache.shape[1], query.shape[1]
    out.zero_()  # sequences of length 0 (and fully masked rows) give 0
    for seq_idx, _, logits, v in _decode_chunks(
            query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
            max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sparse):
        m = _safe_max(logits.amax(dim=-1, keepdim=True))
        e = torch.exp(logits - m)
        total = e.sum(dim=-1, keepdim=True)
        probs = e / torch.where(total > 0, total, torch.ones_like(total))
        out[seq_idx] = _weighted_values(probs, v, num_heads, hkv).to(out.dtype)


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                       scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                       kv_cache_dtype, k_scale, v_scale, tp_rank=0, blocksparse_local_blocks=0,
                       blocksparse_vert_stride=0, blocksparse_block_size=64,
                       blocksparse_head_sliding_step=0):
    """Split-K decode attention over PARTITION_SIZE-token partitions, then a reduction into ``out``.

    Per (seq, head, partition): ``max_logits`` the partition's max logit, ``exp_sums`` the sum of
    exp(logit - that max), ``tmp_out`` the partition's normalized softmax @ V. A partition with no
    attended token (past the sequence's end, or fully masked by block-sparsity) gets max_logits=-inf,
    exp_sums=0, tmp_out=0. (vLLM's kernel leaves such entries unwritten or arbitrary: kernel tests
    should compare only partitions that hold an attended token.)"""
    key_cache, value_cache = as_vllm_layout(key_cache, value_cache)
    num_seqs, num_heads, head_size = query.shape
    check_attention_args(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                         block_size, alibi_slopes, kv_cache_dtype, num_seqs)
    parts = check_split_workspace(exp_sums, max_logits, tmp_out, query)
    need = -(-max(seq_lens.tolist(), default=0) // PARTITION_SIZE)
    if need > parts:
        raise ValueError(f"{need} partitions of {PARTITION_SIZE} tokens are needed, tmp_out has {parts}")
    sparse = _sparse_args(tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                          blocksparse_block_size, blocksparse_head_sliding_step)
    hkv = key_cache.shape[1]
    out.zero_()
    exp_sums.zero_()
    max_logits.fill_(float("-inf"))
    tmp_out.zero_()
    for seq_idx, _, logits, v in _decode_chunks(
            query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
            max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sparse):
        n, length = logits.shape[0], logits.shape[-1]
        p = -(-length // PARTITION_SIZE)
        pad = p * PARTITION_SIZE - length
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
        logits = logits.view(n, num_heads, p, PARTITION_SIZE)
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
        v = v.view(n, hkv, p, PARTITION_SIZE, head_size)
        m = logits.amax(dim=-1)  # [n, H, p], -inf where empty
        e = torch.exp(logits - _safe_max(m)[..., None])
        sums = e.sum(dim=-1)
        # per-partition softmax @ V: group query heads per kv head, partitions batched
        e_g = e.view(n, hkv, num_heads // hkv, p, PARTITION_SIZE).transpose(2, 3)  # [n, Hkv, p, G, T]
        part = torch.matmul(e_g, v)  # [n, Hkv, p, G, D]
        part = part.transpose(2, 3).reshape(n, num_heads, p, head_size)
        part = part / torch.where(sums > 0, sums, torch.ones_like(sums))[..., None]
        max_logits[seq_idx, :, :p] = m.to(max_logits.dtype)
        exp_sums[seq_idx, :, :p] = sums.to(exp_sums.dtype)
        tmp_out[seq_idx, :, :p] = part.to(tmp_out.dtype)
        # reduce (from the float32 partition results, not the possibly rounded tmp_out)
        g = _safe_max(m.amax(dim=-1, keepdim=True))
        w = sums * torch.exp(m - g)  # 0 for empty partitions
        total = w.sum(dim=-1, keepdim=True)
        w = w / torch.where(total > 0, total, torch.ones_like(total))
        out[seq_idx] = (w[..., None] * part).sum(dim=2).to(out.dtype)


def paged_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                    block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale):
    """The engine's decode op; the reference always takes the single-pass path."""
    paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale)


def check_prefill_shapes(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                         query_start_loc, alibi_slopes, kv_cache_dtype):
    """The part of check_prefill_args that reads no values (as check_attention_args); returns its dims."""
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    dims = check_attention_args(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                                None, alibi_slopes, kv_cache_dtype, num_seqs)
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    return dims


def check_prefill_args(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                       query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype):
    """Validate paged-prefill arguments; returns ``((num_blocks, num_kv_heads, head_size, block_size,
    num_heads), query_start_loc, q_lens, seq_lens)`` with the last three as Python lists."""
    dims = check_prefill_shapes(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                                query_start_loc, alibi_slopes, kv_cache_dtype)
    qsl = [int(v) for v in query_start_loc.tolist()]
    lens = [int(v) for v in seq_lens.tolist()]
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    if qsl[0] != 0 or min(q_lens, default=0) < 0 or qsl[-1] > query.shape[0]:
        raise ValueError(f"query_start_loc must start at 0, not decrease and end at most at "
                         f"{query.shape[0]} (the query rows); got {qsl}")
    if any(ql > sl for ql, sl in zip(q_lens, lens)):
        raise ValueError("a sequence has more new tokens than its seq_len (seq_lens include the new tokens)")
    if max(q_lens, default=0) > max_query_len:
        raise ValueError(f"a sequence has {max(q_lens)} new tokens, more than max_query_len={max_query_len}")
    _check_lens(lens, max_seq_len, block_tables, dims[3])
    return dims, qsl, q_lens, lens


def paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                  query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype,
                  k_scale, v_scale):
    """Causal attention of a varlen batch of new tokens over the paged cache.

    Sequence i owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` (q_len_i tokens), which
    sit at positions ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``; their K/V are already cached. The
    query at position p attends to cache positions 0..p. Rows past ``query_start_loc[-1]`` (padding)
    are left untouched. Covers plain prefill, chunked prefill and prefix-cache hits."""
    key_cache, value_cache = as_vllm_layout(key_cache, value_cache)
    (nb, hkv, head_size, bs, num_heads), qsl, q_lens, lens = check_prefill_args(
        out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, query_start_loc,
        max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype)
    num_seqs = len(lens)
    dev, cdt, group = query.device, _compute_dtype(query), num_heads // hkv
    slopes = alibi_slopes.to(cdt).view(hkv, group, 1, 1) if alibi_slopes is not None else None
    for i in range(num_seqs):
        q_len, seq_len = q_lens[i], lens[i]
        if q_len == 0:
            continue
        n_blocks = -(-seq_len // bs)
        blocks = _block_rows(block_tables, torch.tensor([i], device=dev),
                             torch.tensor([seq_len], device=dev), n_blocks, bs, nb)
        k, v = _gather_kv(key_cache, value_cache, blocks, kv_cache_dtype, k_scale, v_scale, cdt)
        k, v = k[0, :, None, :seq_len], v[0, :, None, :seq_len]  # [Hkv, 1, L, D]
        ctx = seq_len - q_len
        q = query[qsl[i]:qsl[i + 1]].to(cdt)
        step = max(1, _CHUNK_ELEMS // (num_heads * seq_len))
        for s in range(0, q_len, step):
            e = min(q_len, s + step)
            n_keys = ctx + e  # the chunk's last query sits at position ctx + e - 1
            qq = q[s:e].view(e - s, hkv, group, head_size).permute(1, 2, 0, 3)  # [Hkv, G, m, D]
            logits = torch.matmul(qq, k[:, :, :n_keys].transpose(-1, -2)) * scale  # [Hkv, G, m, keys]
            q_pos = torch.arange(ctx + s, ctx + e, device=dev)
            k_pos = torch.arange(n_keys, device=dev)
            if slopes is not None:
                logits = logits + slopes * (k_pos[None, :] - q_pos[:, None]).to(cdt)
            logits = logits.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
            o = torch.matmul(torch.softmax(logits, dim=-1), v[:, :, :n_keys])  # [Hkv, G, m, D]
            o = o.permute(2, 0, 1, 3).reshape(e - s, num_heads, head_size)
            out[qsl[i] + s:qsl[i] + e] = o.to(out.dtype)
