"""Pure-PyTorch XAttention ops: the oracles the Triton kernels are tested against, and the CPU backend.

XAttention (Xu et al., 2025) decides which (query block, key block) pairs of a long causal prefill are worth
computing by scoring each stride x stride tile of the attention matrix with the sum of its antidiagonal: Q is
sampled backwards ``(stride-1-s)::stride``, K forwards ``s::stride``, so one GEMM of the "reshaped" Q and K
(each row the concatenation of ``stride`` tokens) adds ``stride`` antidiagonal products per tile. Every
row and column of the tile meets the antidiagonal once, so vertical and slash patterns are not missed.
The reshaped scores go through a softmax; their mass per (block_size x block_size) block drives the choice.
With ``fp8_estimate`` Q and K are scored as fp8 e4m3 with one scale per reshaped row (``fp8_rows``): on
SmolLM2's real text ~1% of the kept blocks change and the attention error does not (benchmarks/results).

Block geometry (shared by every op here). Queries are the last ``q_len`` of ``k_len`` positions; blocks are
aligned to absolute positions, so the query block ``j`` covers positions ``[(f + j) * bs, (f + j + 1) * bs)``
(clipped to the queries) with ``f = (k_len - q_len) // bs`` and its diagonal key block is ``f + j``. A mask
is ``[B, H, k_blocks - f, k_blocks]`` with ``k_blocks = ceil(k_len / bs)`` (square for a whole prompt).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedllm.ops.reference import as_vllm_layout, check_prefill_args, dequantize_kv

LOG2E = 1.4426950408889634
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_CHUNK_ELEMS = 1 << 24  # bound on the logits materialized at once by block_sparse_attention


# ----------------------------------------------------------------------------------------------------
# Geometry, validation and block selection (shared with the Triton backend)
# ----------------------------------------------------------------------------------------------------
def block_layout(q_len: int, k_len: int, block_size: int) -> tuple[int, int, int]:
    """``(first_q_block, num_q_blocks, num_k_blocks)`` of queries that are the last q_len of k_len."""
    if not 0 < q_len <= k_len:
        raise ValueError(f"need 0 < q_len <= k_len (queries are the last q_len keys), got {q_len}, {k_len}")
    k_blocks = -(-k_len // block_size)
    first = (k_len - q_len) // block_size
    return first, k_blocks - first, k_blocks


def check_qkv(q, k, v=None):
    """Validate ``q [B, H, q_len, D]``, ``k``/``v [B, H_kv, k_len, D]``; return (B, H, H_kv, q_len, k_len, D)."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"query and key must be 4-D [B, heads, len, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    b, h, q_len, d = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or h % hkv:
        raise ValueError(f"key {tuple(k.shape)} does not fit query {tuple(q.shape)} (same batch and head "
                         "size; key heads must divide query heads)")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"value shape {tuple(v.shape)} differs from key shape {tuple(k.shape)}")
    block_layout(q_len, k_len, 1)
    return b, h, hkv, q_len, k_len, d


def check_estimate_args(block_size: int, stride: int, chunk_size: int):
    for name, val in (("block_size", block_size), ("stride", stride)):
        if not isinstance(val, int) or val <= 0 or val & (val - 1):
            raise ValueError(f"{name} must be a positive power of two, got {val!r}")
    if block_size % stride:
        raise ValueError(f"stride {stride} must divide block_size {block_size}")
    if chunk_size < block_size:
        raise ValueError(f"chunk_size {chunk_size} must be at least block_size {block_size}")


def check_mask(block_mask, b, h, q_len, k_len, block_size):
    _, q_blocks, k_blocks = block_layout(q_len, k_len, block_size)
    if block_mask.dtype != torch.bool or tuple(block_mask.shape) != (b, h, q_blocks, k_blocks):
        raise ValueError(f"block_mask must be bool [{b}, {h}, {q_blocks}, {k_blocks}] for q_len {q_len}, "
                         f"k_len {k_len}, block_size {block_size}; got {block_mask.dtype} "
                         f"{tuple(block_mask.shape)}")


def _thresholds(threshold, b, h, device):
    """A float or a per-head tensor ([H] or [B, H]) as a [B, H, 1] float tensor. A float is filled in on the
    device: as_tensor(float, device=cuda) is a blocking copy, which stalled the host until the estimate's kernels
    were done, leaving the GPU idle while the rest of the op was launched."""
    if isinstance(threshold, (int, float)):
        return torch.full((b, h, 1), float(threshold), dtype=torch.float32, device=device)
    t = torch.as_tensor(threshold, dtype=torch.float32).to(device, non_blocking=True)
    if t.dim() == 1:
        t = t[None, :]
    return t.expand(b, h).reshape(b, h, 1)


def visible_blocks(first_q_block, q_blocks, k_blocks, causal, device):
    """[q_blocks, k_blocks] bool: key blocks a query block can see at all."""
    if not causal:
        return torch.ones(q_blocks, k_blocks, dtype=torch.bool, device=device)
    kb = torch.arange(k_blocks, device=device)
    return kb[None, :] <= first_q_block + torch.arange(q_blocks, device=device)[:, None]


def visible_count(first_q_block, q_blocks, k_blocks, causal):
    """How many (query block, key block) pairs visible_blocks holds, computed on the host."""
    if not causal:
        return q_blocks * k_blocks
    n = min(max(k_blocks - first_q_block, 0), q_blocks)  # rows that do not reach the last key block
    return n * first_q_block + n * (n + 1) // 2 + (q_blocks - n) * k_blocks


def select_blocks(block_sums, first_q_block, threshold, causal=True):
    """Per query block, the fewest key blocks whose mass reaches ``threshold`` x the row's total: the sink
    (block 0) and the diagonal block are always kept (and counted), the others join in descending order of
    mass; blocks of equal mass join together (so the rule does not depend on a sort order). ``threshold >= 1``
    keeps every visible block (float rounding cannot drop one). Returns ``(block_mask, density)``: bool
    ``[B, H, q_blocks, k_blocks]`` and the kept fraction of visible blocks (a 0-dim float tensor, so nothing
    waits for the device)."""
    b, h, q_blocks, k_blocks = block_sums.shape
    dev = block_sums.device
    thr = _thresholds(threshold, b, h, dev)
    visible = visible_blocks(first_q_block, q_blocks, k_blocks, causal, dev)
    sums = block_sums.float() * visible
    kb = torch.arange(k_blocks, device=dev)
    diag = (first_q_block + torch.arange(q_blocks, device=dev))[:, None]
    forced = ((kb[None, :] == 0) | (kb[None, :] == diag)) & visible
    goal = thr * sums.sum(-1)  # [B, H, q_blocks]
    rest = torch.where(forced | ~visible, torch.full_like(sums, -1.0), sums)  # only candidates are >= 0
    vals, order = rest.sort(dim=-1, descending=True)
    before = (sums * forced).sum(-1, keepdim=True) + vals.cumsum(-1) - vals  # mass kept before this one
    # a block joins iff the forced mass plus all strictly larger masses fall short of the goal: for a run of
    # equal masses, take the "before" of the run's first member
    starts = torch.ones_like(vals, dtype=torch.bool)
    starts[..., 1:] = vals[..., 1:] != vals[..., :-1]
    before = torch.where(starts, before, torch.full_like(before, float("-inf"))).cummax(-1).values
    take = (before < goal[..., None]) & (vals >= 0)
    mask = torch.zeros_like(take).scatter_(-1, order, take) | forced
    mask = (mask | (thr[..., None] >= 1.0)) & visible
    return mask, density(mask, visible)


def density(mask, visible):
    """Kept fraction of the visible (query block, key block) pairs, a 0-dim float32 tensor."""
    return (mask.sum() / (visible.sum() * mask.shape[0] * mask.shape[1])).float()


# ----------------------------------------------------------------------------------------------------
# The two estimation stages, as the seed's kernels define them
# ----------------------------------------------------------------------------------------------------
def _antidiag_scores(q, k, stride):
    """fp32 ``[B, H, q_len/stride, k_len/stride]`` antidiagonal sums; k's heads are grouped under q's."""
    qr = torch.cat([q[..., stride - 1 - s::stride, :] for s in range(stride)], dim=-1).float()
    kr = torch.cat([k[..., s::stride, :] for s in range(stride)], dim=-1).float()
    b, h, rows, dd = qr.shape
    hkv = kr.shape[1]
    out = torch.matmul(qr.view(b, hkv, h // hkv, rows, dd), kr[:, :, None].transpose(-1, -2))
    return out.view(b, h, rows, kr.shape[2])


def flat_group_gemm_fuse_reshape(query_states, key_states, stride, chunk_start, chunk_end, is_causal=True):
    """``[B, H, q_len/stride, kv_len/stride]`` antidiagonal sums of the stride x stride tiles of Q K^T, in the
    query dtype. Reshaped query row r sits at reshaped key position ``chunk_start + r``; with is_causal the
    entries of columns past it may hold anything (the reference computes them all)."""
    _check_gemm_args(query_states, key_states, stride, chunk_start, chunk_end)
    return _antidiag_scores(query_states, key_states, stride).to(query_states.dtype)


def _check_gemm_args(q, k, stride, chunk_start, chunk_end):
    check_qkv(q, k)
    if q.shape[2] % stride or k.shape[2] % stride:
        raise ValueError(f"q_len {q.shape[2]} and kv_len {k.shape[2]} must be multiples of stride {stride}")
    if chunk_end - chunk_start != q.shape[2] // stride or chunk_start < 0 or chunk_end > k.shape[2] // stride:
        raise ValueError(f"chunk [{chunk_start}, {chunk_end}) must span the {q.shape[2] // stride} reshaped "
                         f"query rows inside the {k.shape[2] // stride} reshaped keys")


def _block_sums(x, row_ok, rbs):
    """Softmax over the last dim of log2-domain scores ``x`` (-inf = masked), rows where ``row_ok`` is False
    zeroed, then summed over rbs x rbs blocks."""
    m = x.amax(-1, keepdim=True)
    p = torch.exp2(x - torch.where(m == float("-inf"), torch.zeros_like(m), m))
    total = p.sum(-1, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total)) * row_ok[:, None]
    b, h, rows, cols = p.shape
    return p.view(b, h, rows // rbs, rbs, cols // rbs, rbs).sum(dim=(3, 5))


def softmax_fuse_block_sum(attn_weights_slice, reshaped_block_size, segment_size, chunk_start, chunk_end,
                           real_q_len, scale, is_causal=True):
    """Softmax (base 2, of ``scores * scale``) over keys, with reshaped row r seeing keys up to
    ``chunk_start + r`` when causal; rows ``r >= real_q_len`` contribute nothing; the probabilities are
    summed per rbs x rbs block: fp32 ``[B, H, rows/rbs, cols/rbs]``. ``segment_size`` is the kernel's key
    tile and changes nothing."""
    b, h, rows, cols = attn_weights_slice.shape
    rbs = reshaped_block_size
    if rows % rbs or cols % rbs or segment_size % rbs or segment_size <= 0:
        raise ValueError(f"rows {rows}, cols {cols} and segment_size {segment_size} must be positive "
                         f"multiples of reshaped_block_size {rbs}")
    if chunk_end - chunk_start != rows or chunk_start < 0:
        raise ValueError(f"chunk [{chunk_start}, {chunk_end}) must span the {rows} rows")
    x = attn_weights_slice.float() * scale
    r = torch.arange(rows, device=x.device)
    if is_causal:
        hidden = torch.arange(cols, device=x.device)[None, :] > chunk_start + r[:, None]
        x = x.masked_fill(hidden, float("-inf"))
    return _block_sums(x, r < real_q_len, rbs)


# ----------------------------------------------------------------------------------------------------
# Estimation and sparse attention
# ----------------------------------------------------------------------------------------------------
def estimate_scale(head_dim: int, stride: int) -> float:
    """log2(e) / sqrt(D) / stride: softmax scale of the reshaped scores in the exp2 domain."""
    return LOG2E / math.sqrt(head_dim) / stride


def fp8_rows(x, front, stride):
    """x ``[B, H, n, D]`` as the fp8 estimate scores it, in float32: each reshaped row (``stride`` consecutive
    tokens of a head, counted from ``front`` tokens before x's first) divided by its largest magnitude / 448,
    rounded to float8_e4m3fn and scaled back."""
    b, h, n, d = x.shape
    total = -(-(front + n) // stride) * stride
    rows = F.pad(x.float(), (0, 0, front, total - front - n)).reshape(b, h, total // stride, stride * d)
    # times the reciprocal, not divided: torch divides by a scalar that way on CUDA, and the kernel must match
    scale = rows.abs().amax(-1, keepdim=True) * (1.0 / FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    rows = (rows / scale).to(torch.float8_e4m3fn).float() * scale
    return rows.view(b, h, total, d)[:, :, front:front + n]


def block_sums(query, key, block_size, stride, chunk_size, causal, fp8_estimate=False):
    """``(sums, first_q_block)``: fp32 ``[B, H, q_blocks, k_blocks]`` softmax mass of the reshaped scores per
    block (geometry in the module docstring); each query block sums to its count of real reshaped rows.

    Any lengths: the queries are zero-padded onto the absolute block grid, and reshaped rows holding no real
    query (or columns past the keys) are left out of the softmax. ``chunk_size`` query tokens are scored at a
    time (bounds memory only). ``fp8_estimate``: Q and K as ``fp8_rows`` gives them."""
    b, h, hkv, q_len, k_len, d = check_qkv(query, key)
    check_estimate_args(block_size, stride, chunk_size)
    if fp8_estimate:
        query, key = fp8_rows(query, (k_len - q_len) % stride, stride), fp8_rows(key, 0, stride)
    first, q_blocks, k_blocks = block_layout(q_len, k_len, block_size)
    rbs = block_size // stride
    q_start, padded = k_len - q_len, k_blocks * block_size
    qp = F.pad(query, (0, 0, q_start - first * block_size, padded - k_len))
    kp = F.pad(key, (0, 0, 0, padded - k_len))
    cols = torch.arange(padded // stride, device=query.device)
    chunk_rows = max(chunk_size // block_size, 1) * rbs
    sums = []
    for r0 in range(0, q_blocks * rbs, chunk_rows):
        r1 = min(r0 + chunk_rows, q_blocks * rbs)
        x = _antidiag_scores(qp[:, :, r0 * stride:r1 * stride], kp, stride) * estimate_scale(d, stride)
        rows = first * rbs + torch.arange(r0, r1, device=query.device)  # absolute reshaped rows
        hidden = (cols * stride >= k_len)[None, :]
        if causal:
            hidden = hidden | (cols[None, :] > rows[:, None])
        row_ok = (rows * stride + stride - 1 >= q_start) & (rows * stride < k_len)
        sums.append(_block_sums(x.masked_fill(hidden, float("-inf")), row_ok, rbs))
    return torch.cat(sums, dim=2), first


def kv_head_sums(block_sums, num_kv_heads):
    """The block sums of each kv head's query heads added together and given to each of them, so that the group
    selects one set of blocks (``share_kv_heads``): its heads then read the same K/V blocks. (With per-head
    thresholds that differ within a group, each head applies its own to the group's sums.)"""
    b, h = block_sums.shape[:2]
    grouped = block_sums.view(b, num_kv_heads, h // num_kv_heads, *block_sums.shape[2:]).sum(2, keepdim=True)
    return grouped.expand(-1, -1, h // num_kv_heads, -1, -1).reshape(block_sums.shape)


def xattn_estimate(query, key, block_size=128, stride=8, threshold=0.9, chunk_size=16384, causal=True,
                   share_kv_heads=False, fp8_estimate=False):
    """``(block_mask, density)`` of :func:`select_blocks` over :func:`block_sums`; ``threshold`` is a float
    or a per-head tensor ([H] or [B, H]). ``share_kv_heads``: select over :func:`kv_head_sums`.
    ``fp8_estimate``: score fp8 Q and K (:func:`fp8_rows`)."""
    sums, first = block_sums(query, key, block_size, stride, chunk_size, causal, fp8_estimate)
    if share_kv_heads:
        sums = kv_head_sums(sums, key.shape[1])
    return select_blocks(sums, first, threshold, causal)


def block_sparse_attention(q, k, v, block_mask, block_size=128, causal=True, scale=None):
    """Attention of ``q [B, H, q_len, D]`` (the last q_len positions) over ``k``/``v [B, H_kv, k_len, D]``
    restricted to the (query block, key block) pairs of ``block_mask``; query rows that see no key get 0.
    Computed in float32 (float64 for float64 inputs), returned in q's dtype."""
    b, h, hkv, q_len, k_len, d = check_qkv(q, k, v)
    check_mask(block_mask, b, h, q_len, k_len, block_size)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    first = (k_len - q_len) // block_size
    kf, vf = k.to(cdt)[:, :, None], v.to(cdt)[:, :, None]  # [B, Hkv, 1, L, D]
    k_pos = torch.arange(k_len, device=q.device)
    out = torch.empty_like(q)
    step = max(1, _CHUNK_ELEMS // (b * h * k_len))
    for s in range(0, q_len, step):
        e = min(q_len, s + step)
        q_pos = torch.arange(k_len - q_len + s, k_len - q_len + e, device=q.device)
        keep = block_mask[:, :, q_pos // block_size - first][..., k_pos // block_size]  # [B, H, m, L]
        if causal:
            keep = keep & (k_pos[None, :] <= q_pos[:, None])
        qq = q[:, :, s:e].to(cdt).view(b, hkv, h // hkv, e - s, d)
        logits = torch.matmul(qq, kf.transpose(-1, -2)).view(b, h, e - s, k_len) * scale
        logits = logits.masked_fill(~keep, float("-inf"))
        m = logits.amax(-1, keepdim=True)
        p = torch.exp(logits - torch.where(m == float("-inf"), torch.zeros_like(m), m))
        total = p.sum(-1, keepdim=True)
        p = p / torch.where(total > 0, total, torch.ones_like(total))
        o = torch.matmul(p.view(b, hkv, h // hkv, e - s, k_len), vf)
        out[:, :, s:e] = o.view(b, h, e - s, d).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------------
# Paged prefill
# ----------------------------------------------------------------------------------------------------
def prefill_plan(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, query_start_loc,
                 max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype):
    """Validate paged-prefill arguments (as ``pagedllm.ops.paged_prefill`` defines them); return the
    ``(seq, query_start, q_len, seq_len)`` of each sequence that has new tokens."""
    if alibi_slopes is not None:
        raise ValueError("XAttention prefill does not support ALiBi; use paged_prefill")
    _, qsl, q_lens, lens = check_prefill_args(out, query, key_cache, value_cache, num_kv_heads, block_tables,
                                              seq_lens, query_start_loc, max_query_len, max_seq_len,
                                              alibi_slopes, kv_cache_dtype)
    num_seqs = len(lens)
    return [(i, qsl[i], q_lens[i], lens[i]) for i in range(num_seqs) if q_lens[i] > 0]


def gather_sequence(cache, block_table_row, seq_len, kv_cache_dtype, scale, dtype, is_key):
    """One sequence's K (``is_key``) or V from its paged cache, token-major ``[H_kv, seq_len, D]``,
    dequantized to ``dtype``."""
    page = cache.shape[3]
    blocks = block_table_row[:-(-seq_len // page)].long()
    c = cache[blocks]
    if is_key:  # [n, Hkv, D/x, page, x] -> [Hkv, n, page, D/x, x]
        c = c.permute(1, 0, 3, 2, 4)
    else:  # [n, Hkv, D, page] -> [Hkv, n, page, D]
        c = c.permute(1, 0, 3, 2)
    c = c.reshape(cache.shape[1], blocks.numel() * page, -1)[:, :seq_len]
    return dequantize_kv(c, kv_cache_dtype, scale, dtype)


def xattention_paged_prefill(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                             query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype,
                             k_scale, v_scale, threshold=0.9, stride=8, block_size=128, share_kv_heads=False,
                             fp8_estimate=False):
    """``paged_prefill`` restricted per sequence to the blocks XAttention selects for its new tokens against
    its whole context (``share_kv_heads`` and ``fp8_estimate`` as ``xattn_estimate``'s); equals
    ``paged_prefill`` for ``threshold >= 1``."""
    plan = prefill_plan(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                        query_start_loc, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype)
    key_cache, value_cache = as_vllm_layout(key_cache, value_cache)
    cdt = torch.float64 if query.dtype == torch.float64 else torch.float32
    for seq, q0, q_len, seq_len in plan:
        k = gather_sequence(key_cache, block_tables[seq], seq_len, kv_cache_dtype, k_scale, cdt, True)[None]
        v = gather_sequence(value_cache, block_tables[seq], seq_len, kv_cache_dtype, v_scale, cdt, False)[None]
        q = query[q0:q0 + q_len].transpose(0, 1)[None].to(cdt)  # [1, H, q_len, D]
        mask, _ = xattn_estimate(q, k, block_size, stride, threshold, share_kv_heads=share_kv_heads,
                                 fp8_estimate=fp8_estimate)
        o = block_sparse_attention(q, k, v, mask, block_size, True, scale)
        out[q0:q0 + q_len] = o[0].transpose(0, 1).to(out.dtype)
