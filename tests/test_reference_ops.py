"""pagedllm.ops.reference against a naive dense attention written here, plus the op dispatch layer.

The naive side reads K/V token by token through the block table (its own index arithmetic), expands
GQA with repeat_interleave, and runs an explicit masked softmax in float32.
"""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

import pagedllm.ops as ops
from pagedllm.ops import reference as ref

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HEADS = [(2, 2), (8, 2), (16, 2)]  # (num_heads, num_kv_heads): GQA ratios 1, 4, 8
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-3, rtol=1e-3)}


# ----------------------------------------------------------------------------------------------------
# Naive side (independent of reference.py)
# ----------------------------------------------------------------------------------------------------
def own_quant(x, kv_dtype, scale):
    f8 = FP8[kv_dtype]
    fmax = torch.finfo(f8).max
    return (x.float() / float(scale)).clamp(-fmax, fmax).to(f8).view(torch.uint8)


def own_dequant(c, kv_dtype, scale):
    if kv_dtype == "auto":
        return c.float()
    return c.view(FP8[kv_dtype]).float() * float(scale)


def token_kv(case, seq, n_tokens, source=False):
    """K, V [n_tokens, Hkv, D] in float32 for sequence ``seq``, gathered token by token."""
    bs = case["block_size"]
    row = case["block_tables"][seq].tolist()
    blocks = [row[t // bs] for t in range(n_tokens)]
    offs = [t % bs for t in range(n_tokens)]
    kc, vc = (case["k_src"], case["v_src"]) if source else (case["key_cache"], case["value_cache"])
    kv_dtype = "auto" if source else case["kv_dtype"]
    k = kc[blocks, :, :, offs, :]  # [T, Hkv, D/x, x]
    k = own_dequant(k.reshape(n_tokens, k.shape[1], -1), kv_dtype, case["k_scale"])
    v = own_dequant(vc[blocks, :, :, offs], kv_dtype, case["v_scale"])  # [T, Hkv, D]
    return k, v


def dense_attention(q, k, v, scale, mask, bias=None):
    """q [M, H, D]; k, v [T, Hkv, D]; mask [H or 1, M, T]; bias broadcastable to [H, M, T].
    Returns out [M, H, D] and the masked logits [H, M, T]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("mhd,thd->hmt", q.float(), k) * scale
    if bias is not None:
        logits = logits + bias
    logits = logits.masked_fill(~mask, float("-inf"))
    top = logits.max(dim=-1, keepdim=True).values
    p = torch.exp(logits - top)
    p = p / p.sum(dim=-1, keepdim=True)
    return torch.einsum("hmt,thd->mhd", p, v), logits


def sparse_mask(seq_len, num_heads, num_kv_heads, tp_rank, local, vert, sp_block, step):
    """Block-sparse keep mask [H, seq_len] built straight from the rule of seed 001."""
    q_blk = (seq_len - 1) // sp_block
    mask = torch.zeros(num_heads, seq_len, dtype=torch.bool)
    for h in range(num_heads):
        if step >= 0:
            off = (tp_rank * num_heads + h) * step + 1
        else:
            off = (tp_rank * num_kv_heads + h // (num_heads // num_kv_heads)) * (-step) + 1
        for kb in range(q_blk + 1):
            if (kb + off) % vert == 0 or kb > q_blk - local:
                mask[h, kb * sp_block:(kb + 1) * sp_block] = True
    return mask


def alibi(num_heads):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)])


def naive_decode(case, alibi_slopes=None, sparse=None, source=False):
    """out [S, H, D] float32 and per-sequence logits [H, L]."""
    q = case["query"]
    outs, all_logits = [], []
    for s, seq_len in enumerate(case["seq_lens"].tolist()):
        k, v = token_kv(case, s, seq_len, source)
        pos = torch.arange(seq_len, dtype=torch.float32)
        bias = None if alibi_slopes is None else alibi_slopes[:, None, None] * (pos - (seq_len - 1))
        mask = torch.ones(1, 1, seq_len, dtype=torch.bool)
        if sparse is not None:
            mask = sparse_mask(seq_len, q.shape[1], k.shape[1], *sparse)[:, None, :]
        o, logits = dense_attention(q[s:s + 1], k, v, case["scale"], mask, bias)
        outs.append(o[0])
        all_logits.append(logits[:, 0])
    return torch.stack(outs), all_logits


def make_case(seed, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, kv_dtype="auto",
              k_scale=1.0, v_scale=1.0, magnitude=1.0, num_queries=None):
    """Random paged caches with permuted block tables (a strided view, unused entries stale or -1),
    NaN in unwritten slots ("auto"), and a non-contiguous query sliced from a qkv tensor."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need) + 2
    wide = torch.full((len(seq_lens), 2 * width), -1, dtype=torch.int32)
    tables = wide[:, ::2]
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
        if s % 2:  # stale ids in unused entries
            tables[s, n:] = torch.randint(0, num_blocks, (width - n,), generator=gen, dtype=torch.int32)
    cache_dtype = dtype if kv_dtype == "auto" else torch.uint8
    x = 16 // torch.empty((), dtype=cache_dtype).element_size()
    kshape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    vshape = (num_blocks, num_kv_heads, head_size, block_size)
    k_src = torch.randn(kshape, generator=gen) * magnitude
    v_src = torch.randn(vshape, generator=gen) * magnitude
    if kv_dtype == "auto":
        k_src, v_src = k_src.to(dtype), v_src.to(dtype)
        key_cache, value_cache = k_src.clone(), v_src.clone()
        written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for s, n in enumerate(seq_lens):
            row = tables[s].tolist()
            slots = [row[t // block_size] * block_size + t % block_size for t in range(n)]
            written.view(-1)[slots] = True
        key_cache.permute(0, 3, 1, 2, 4)[~written] = float("nan")
        value_cache.permute(0, 3, 1, 2)[~written] = float("nan")
    else:
        key_cache, value_cache = own_quant(k_src, kv_dtype, k_scale), own_quant(v_src, kv_dtype, v_scale)
    n_q = len(seq_lens) if num_queries is None else num_queries
    qkv = torch.randn(n_q, num_heads + 2 * num_kv_heads, head_size, generator=gen).to(dtype)
    return dict(query=qkv[:, :num_heads], key_cache=key_cache, value_cache=value_cache,
                k_src=k_src.float(), v_src=v_src.float(), block_tables=tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_size=block_size,
                num_kv_heads=num_kv_heads, scale=1.0 / math.sqrt(head_size), kv_dtype=kv_dtype,
                k_scale=k_scale, v_scale=v_scale, dtype=dtype, max_seq_len=max(seq_lens))


def run_v1(case, alibi_slopes=None, sparse_kw=None):
    out = torch.full_like(case["query"], 7.0)
    ref.paged_attention_v1(out, case["query"], case["key_cache"], case["value_cache"], case["num_kv_heads"],
                           case["scale"], case["block_tables"], case["seq_lens"], case["block_size"],
                           case["max_seq_len"], alibi_slopes, case["kv_dtype"], case["k_scale"],
                           case["v_scale"], **(sparse_kw or {}))
    return out


def run_v2(case, alibi_slopes=None, sparse_kw=None, extra_partitions=1):
    s, h, d = case["query"].shape
    parts = -(-case["max_seq_len"] // ref.PARTITION_SIZE) + extra_partitions
    out = torch.full_like(case["query"], 7.0)
    exp_sums = torch.full((s, h, parts), 7.0, device=case["query"].device)
    max_logits = torch.full((s, h, parts), 7.0, device=case["query"].device)
    tmp_out = torch.full((s, h, parts, d), 7.0, dtype=case["query"].dtype, device=case["query"].device)
    ref.paged_attention_v2(out, exp_sums, max_logits, tmp_out, case["query"], case["key_cache"],
                           case["value_cache"], case["num_kv_heads"], case["scale"], case["block_tables"],
                           case["seq_lens"], case["block_size"], case["max_seq_len"], alibi_slopes,
                           case["kv_dtype"], case["k_scale"], case["v_scale"], **(sparse_kw or {}))
    return out, exp_sums, max_logits, tmp_out


def sparse_kwargs(tp_rank, local, vert, sp_block, step):
    return dict(tp_rank=tp_rank, blocksparse_local_blocks=local, blocksparse_vert_stride=vert,
                blocksparse_block_size=sp_block, blocksparse_head_sliding_step=step)


# ----------------------------------------------------------------------------------------------------
# Decode: v1 / v2 against dense
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_decode_matches_dense(head_size, num_heads, num_kv_heads, block_size, dtype):
    seq_lens = [1, 3 * block_size, 17, 530]  # one token, a block boundary, > 1 partition
    case = make_case(head_size * 1000 + num_heads * 10 + block_size, seq_lens, num_heads, num_kv_heads,
                     head_size, block_size, dtype)
    expect, _ = naive_decode(case)
    out1 = run_v1(case)
    out2 = run_v2(case)[0]
    assert out1.dtype == dtype and not torch.isnan(out1).any()
    torch.testing.assert_close(out1.float(), expect, **TOL[dtype])
    torch.testing.assert_close(out2.float(), expect, **TOL[dtype])
    torch.testing.assert_close(out1.float(), out2.float(), **TOL[dtype])
    # a one-token context returns that token's value
    k, v = token_kv(case, 0, 1)
    torch.testing.assert_close(out1[0].float(), v[0].repeat_interleave(num_heads // num_kv_heads, 0),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_size,num_heads", [(64, 8), (128, 16)])
def test_decode_alibi(head_size, num_heads, dtype):
    case = make_case(11, [1, 16, 300, 700], num_heads, 2, head_size, 16, dtype)
    slopes = alibi(num_heads)
    expect, _ = naive_decode(case, alibi_slopes=slopes)
    torch.testing.assert_close(run_v1(case, slopes).float(), expect, **TOL[dtype])
    torch.testing.assert_close(run_v2(case, slopes)[0].float(), expect, **TOL[dtype])
    plain, _ = naive_decode(case)
    assert (plain - expect).abs().max() > 1e-2  # the bias matters


# fp8 error bounds vs the un-quantized cache: e4m3 keeps 3 mantissa bits, e5m2 only 2
FP8_LOOSE = {"fp8": 0.08, "fp8_e4m3": 0.08, "fp8_e5m2": 0.16}


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 32), (80, 8)])
def test_decode_fp8(kv_dtype, dtype, head_size, block_size):
    # k_scale as a [1] tensor, v_scale as a Python float: both forms are accepted
    case = make_case(5, [1, 33, 600], 8, 2, head_size, block_size, dtype, kv_dtype,
                     k_scale=torch.tensor([0.02]), v_scale=0.03, magnitude=0.5)
    assert case["key_cache"].dtype == torch.uint8
    expect, _ = naive_decode(case)  # on the dequantized cache
    out1, out2 = run_v1(case), run_v2(case)[0]
    torch.testing.assert_close(out1.float(), expect, **TOL[dtype])
    torch.testing.assert_close(out2.float(), expect, **TOL[dtype])
    f8_case = dict(case, key_cache=case["key_cache"].view(FP8[kv_dtype]),
                   value_cache=case["value_cache"].view(FP8[kv_dtype]))
    assert torch.equal(run_v1(f8_case), out1)  # float8-typed caches read like uint8 ones
    loose, _ = naive_decode(case, source=True)  # on the float values before quantization
    err = (out1.float() - loose).abs().max().item()
    assert err < FP8_LOOSE[kv_dtype] * loose.abs().max().item(), err


SPARSE = [  # (block_size, tp_rank, local_blocks, vert_stride, sparse_block_size, head_sliding_step)
    (16, 0, 2, 4, 64, 0),
    (16, 1, 1, 8, 32, 1),
    (8, 0, 1, 64, 16, -1),  # long sequences get partitions with nothing attended
    (32, 0, 3, 2, 64, 2),
    (16, 1, 2, 3, 16, -2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,tp_rank,local,vert,sp_block,step", SPARSE)
def test_decode_block_sparse(block_size, tp_rank, local, vert, sp_block, step, dtype):
    case = make_case(3, [1, 100, 700, 2000], 8, 2, 64, block_size, dtype)
    sparse = (tp_rank, local, vert, sp_block, step)
    expect, _ = naive_decode(case, sparse=sparse)
    kw = sparse_kwargs(*sparse)
    out1 = run_v1(case, sparse_kw=kw)
    out2, exp_sums, max_logits, _ = run_v2(case, sparse_kw=kw)
    torch.testing.assert_close(out1.float(), expect, **TOL[dtype])
    torch.testing.assert_close(out2.float(), expect, **TOL[dtype])
    dense, _ = naive_decode(case)
    assert (dense - expect).abs().max() > 1e-3  # sparsity changes the result
    if vert == 64:  # partition 0 of the 2000-token sequence attends nothing
        assert max_logits[3, :, 0].eq(float("-inf")).all() and exp_sums[3, :, 0].eq(0).all()


@pytest.mark.parametrize("vert", [0, 1])
def test_block_sparse_inactive_when_vert_stride_le_1(vert):
    case = make_case(4, [5, 300], 8, 2, 64, 16, torch.float32)
    expect, _ = naive_decode(case)
    kw = sparse_kwargs(0, 1, vert, 16, 0)
    torch.testing.assert_close(run_v1(case, sparse_kw=kw), expect, **TOL[torch.float32])
    torch.testing.assert_close(run_v2(case, sparse_kw=kw)[0], expect, **TOL[torch.float32])


@pytest.mark.parametrize("sparse", [None, (0, 1, 64, 16, 0)])
@pytest.mark.parametrize("use_alibi", [False, True])
def test_v2_partition_outputs(sparse, use_alibi):
    """exp_sums / max_logits / tmp_out per partition, unused partitions, and their reduction."""
    seq_lens = [1, 511, 512, 513, 1024, 1500]
    case = make_case(9, seq_lens, 8, 2, 64, 16, torch.float32)
    slopes = alibi(8) if use_alibi else None
    expect, logits = naive_decode(case, alibi_slopes=slopes, sparse=sparse)
    kw = sparse_kwargs(*sparse) if sparse else None
    out, exp_sums, max_logits, tmp_out = run_v2(case, slopes, kw, extra_partitions=2)
    part = ref.PARTITION_SIZE
    for s, seq_len in enumerate(seq_lens):
        _, v = token_kv(case, s, seq_len)
        v = v.repeat_interleave(4, dim=1)  # [L, H, D]
        n_parts = -(-seq_len // part)
        for p in range(max_logits.shape[2]):
            if p >= n_parts:
                assert max_logits[s, :, p].eq(float("-inf")).all()
                assert exp_sums[s, :, p].eq(0).all() and tmp_out[s, :, p].eq(0).all()
                continue
            lg = logits[s][:, p * part:(p + 1) * part]  # [H, T]
            m = lg.max(dim=-1).values
            attended = torch.isfinite(m)
            e = torch.exp(lg - torch.where(attended, m, 0)[:, None])
            sums = e.sum(-1)
            t = torch.einsum("ht,thd->hd", e, v[p * part:(p + 1) * part]) / sums.clamp_min(1e-30)[:, None]
            torch.testing.assert_close(max_logits[s, :, p], m)
            torch.testing.assert_close(exp_sums[s, :, p], sums, atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(tmp_out[s, :, p], t, atol=1e-5, rtol=1e-4)
    # vLLM's reduce kernel, from the stored partition results
    g = max_logits.amax(-1, keepdim=True)
    w = exp_sums * torch.exp(max_logits - g)
    reduced = (w[..., None] * tmp_out).sum(2) / w.sum(-1)[..., None]
    torch.testing.assert_close(reduced, expect, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-4)


def test_paged_attention_is_v1_and_chunking_is_invisible(monkeypatch):
    case = make_case(21, [3, 40, 900, 128, 1, 77], 16, 2, 64, 16, torch.float32)
    out1, out2 = run_v1(case), run_v2(case)[0]
    out = torch.empty_like(out1)
    ref.paged_attention(out, case["query"], case["key_cache"], case["value_cache"], 2, case["scale"],
                        case["block_tables"], case["seq_lens"], 16, case["max_seq_len"], None, "auto",
                        1.0, 1.0)
    assert torch.equal(out, out1)
    monkeypatch.setattr(ref, "_CHUNK_ELEMS", 20000)  # many small chunks
    torch.testing.assert_close(run_v1(case), out1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(run_v2(case)[0], out2, atol=1e-6, rtol=1e-6)


def test_zero_length_sequence_gives_zeros():
    case = make_case(2, [5, 1], 8, 2, 64, 16, torch.float32)
    case["seq_lens"] = torch.tensor([5, 0], dtype=torch.int32)
    out1, out2 = run_v1(case), run_v2(case)[0]
    assert out1[1].eq(0).all() and out2[1].eq(0).all()
    assert torch.isfinite(out1).all() and torch.isfinite(out2).all()


# ----------------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------------
CHUNKS = [(0, 7), (5, 1), (16, 16), (37, 20), (100, 45), (0, 1)]  # (cached tokens, new tokens)


def run_prefill(case, q_lens, alibi_slopes=None, pad_rows=3):
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = case["query"]
    out = torch.full_like(query, 7.0)
    ref.paged_prefill(out, query, case["key_cache"], case["value_cache"], case["num_kv_heads"],
                      case["scale"], case["block_tables"], case["seq_lens"],
                      torch.tensor(starts, dtype=torch.int32), max(q_lens), case["max_seq_len"],
                      alibi_slopes, case["kv_dtype"], case["k_scale"], case["v_scale"])
    return out, starts


def naive_prefill(case, q_lens, starts, alibi_slopes=None, source=False):
    query, outs = case["query"], []
    for s, seq_len in enumerate(case["seq_lens"].tolist()):
        k, v = token_kv(case, s, seq_len, source)
        ctx = seq_len - q_lens[s]
        q_pos = torch.arange(ctx, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        bias = None if alibi_slopes is None else alibi_slopes[:, None, None] * (k_pos - q_pos).float()
        o, _ = dense_attention(query[starts[s]:starts[s + 1]], k, v, case["scale"],
                               (k_pos <= q_pos)[None], bias)
        outs.append(o)
    return torch.cat(outs)


def prefill_case(seed, chunks, num_heads, num_kv_heads, head_size, block_size, dtype, pad_rows=3, **kw):
    seq_lens = [c + n for c, n in chunks]
    return make_case(seed, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                     num_queries=sum(n for _, n in chunks) + pad_rows, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_prefill_matches_dense_causal(head_size, num_heads, num_kv_heads, block_size, dtype):
    case = prefill_case(head_size + block_size, CHUNKS, num_heads, num_kv_heads, head_size,
                        block_size, dtype)
    q_lens = [n for _, n in CHUNKS]
    out, starts = run_prefill(case, q_lens)
    expect = naive_prefill(case, q_lens, starts)
    torch.testing.assert_close(out[:starts[-1]].float(), expect, **TOL[dtype])
    assert out[starts[-1]:].eq(7.0).all()  # padding rows untouched


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("use_alibi", [False, True])
def test_prefill_alibi_and_fp8(kv_dtype, use_alibi):
    kw = dict(kv_dtype=kv_dtype, k_scale=0.02, v_scale=torch.tensor([0.03]), magnitude=0.5) \
        if kv_dtype != "auto" else {}
    case = prefill_case(8, CHUNKS, 8, 2, 64, 16, torch.float16, **kw)
    q_lens = [n for _, n in CHUNKS]
    slopes = alibi(8) if use_alibi else None
    out, starts = run_prefill(case, q_lens, slopes)
    expect = naive_prefill(case, q_lens, starts, slopes)
    torch.testing.assert_close(out[:starts[-1]].float(), expect, **TOL[torch.float16])
    if kv_dtype != "auto":
        loose = naive_prefill(case, q_lens, starts, slopes, source=True)
        err = (out[:starts[-1]].float() - loose).abs().max().item()
        assert err < FP8_LOOSE[kv_dtype] * loose.abs().max().item(), err


def test_prefill_of_one_token_equals_decode(monkeypatch):
    chunks = [(0, 1), (40, 1), (511, 1), (700, 1)]
    case = prefill_case(13, chunks, 16, 2, 128, 16, torch.float32, pad_rows=0)
    slopes = alibi(16)
    out, _ = run_prefill(case, [1] * len(chunks), slopes)
    torch.testing.assert_close(out, run_v1(case, slopes), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(ref, "_CHUNK_ELEMS", 50000)
    big = prefill_case(14, [(30, 300)], 8, 2, 64, 16, torch.float32, pad_rows=0)
    out_small_chunks, starts = run_prefill(big, [300])
    torch.testing.assert_close(out_small_chunks, naive_prefill(big, [300], starts), **TOL[torch.float32])


# ----------------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype,dtype", [("auto", torch.float32), ("auto", torch.float16),
                                            ("fp8", torch.float16), ("fp8_e4m3", torch.float32),
                                            ("fp8_e5m2", torch.float16)])
@pytest.mark.parametrize("head_size", [64, 80])
def test_reshape_and_cache_round_trip(kv_dtype, dtype, head_size):
    gen = torch.Generator().manual_seed(head_size)
    num_blocks, block_size, hkv, tokens = 12, 16, 2, 40
    kshape, vshape, cdt = ref.kv_cache_shapes(num_blocks, block_size, hkv, head_size, dtype, kv_dtype)
    if kv_dtype == "auto":
        key_cache = torch.randn(kshape, generator=gen).to(cdt)
        value_cache = torch.randn(vshape, generator=gen).to(cdt)
    else:
        key_cache = torch.randint(0, 256, kshape, generator=gen, dtype=torch.uint8)
        value_cache = torch.randint(0, 256, vshape, generator=gen, dtype=torch.uint8)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    key = torch.randn(tokens + 2, hkv, head_size, generator=gen).to(dtype)  # 2 padding rows
    value = torch.randn(tokens + 2, hkv, head_size, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1
    k_scale, v_scale = torch.tensor([0.05]), 0.02
    ref.reshape_and_cache(key, value, key_cache, value_cache, slots, kv_dtype, k_scale, v_scale)
    x = kshape[-1]
    written_k = torch.zeros(kshape, dtype=torch.bool)
    written_v = torch.zeros(vshape, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = slot // block_size, slot % block_size
        got_k = key_cache[b, :, :, o, :].reshape(hkv, head_size)
        got_v = value_cache[b, :, :, o]
        if kv_dtype == "auto":
            assert torch.equal(got_k, key[t]) and torch.equal(got_v, value[t])
        else:
            assert torch.equal(got_k, own_quant(key[t], kv_dtype, 0.05))
            assert torch.equal(got_v, own_quant(value[t], kv_dtype, v_scale))
            back = ref.dequantize_kv(got_k, kv_dtype, k_scale)
            rel = 2.0 ** -(4 if FP8[kv_dtype] == torch.float8_e4m3fn else 3)
            assert ((back - key[t].float()).abs() <= rel * key[t].float().abs() + 1e-2 * 0.05).all()
        written_k[b, :, :, o, :] = True
        written_v[b, :, :, o] = True
    assert torch.equal(key_cache[~written_k], before_k[~written_k])  # slot -1 / others untouched
    assert torch.equal(value_cache[~written_v], before_v[~written_v])
    assert written_k.sum() == (slots >= 0).sum() * hkv * head_size
    assert x == 16 // torch.empty((), dtype=cdt).element_size()


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_saturates_instead_of_nan(kv_dtype):
    kshape, vshape, _ = ref.kv_cache_shapes(2, 8, 1, 16, torch.float32, kv_dtype)
    kc, vc = torch.zeros(kshape, dtype=torch.uint8), torch.zeros(vshape, dtype=torch.uint8)
    big = torch.full((2, 1, 16), 1e9)
    big[1] = -1e9
    ref.reshape_and_cache(big, big, kc, vc, torch.tensor([0, 9]), kv_dtype, 2.0, torch.tensor([2.0]))
    fmax = torch.finfo(FP8[kv_dtype]).max
    k0 = ref.dequantize_kv(kc[0, 0, :, 0, :], kv_dtype, 2.0)
    v1 = ref.dequantize_kv(vc[1, 0, :, 1], kv_dtype, 2.0)
    assert k0.eq(2.0 * fmax).all() and v1.eq(-2.0 * fmax).all()
    # a float8-typed cache works like the uint8 one
    kc8, vc8 = torch.zeros(kshape, dtype=FP8[kv_dtype]), torch.zeros(vshape, dtype=FP8[kv_dtype])
    ref.reshape_and_cache(big, big, kc8, vc8, torch.tensor([0, 9]), kv_dtype, 2.0, 2.0)
    assert torch.equal(kc8.view(torch.uint8), kc) and torch.equal(vc8.view(torch.uint8), vc)


# ----------------------------------------------------------------------------------------------------
# Helpers and validation
# ----------------------------------------------------------------------------------------------------
def test_layout_helpers():
    assert ref.cache_x(torch.float16) == 8 and ref.cache_x(torch.bfloat16) == 8
    assert ref.cache_x(torch.float32) == 4 and ref.cache_x(torch.uint8) == 16
    assert ref.fp8_dtype("auto") is None and ref.fp8_dtype("fp8") == torch.float8_e4m3fn
    assert ref.fp8_dtype("fp8_e5m2") == torch.float8_e5m2
    assert ref.kv_cache_shapes(10, 16, 4, 128, torch.float16, "auto") == (
        (10, 4, 16, 16, 8), (10, 4, 128, 16), torch.float16)
    assert ref.kv_cache_shapes(3, 8, 2, 80, torch.bfloat16, "fp8") == (
        (3, 2, 5, 8, 16), (3, 2, 80, 8), torch.uint8)
    assert ops.kv_cache_shapes(3, 8, 2, 64, torch.float32, "auto") == ref.kv_cache_shapes(
        3, 8, 2, 64, torch.float32, "auto")
    assert ref.kv_cache_shapes(3, 8, 2, 80, torch.bfloat16, "fp8", "hnd") == (
        (3, 2, 8, 80), (3, 2, 8, 80), torch.uint8)
    with pytest.raises(ValueError, match="layout"):
        ref.kv_cache_shapes(3, 8, 2, 80, torch.bfloat16, "auto", "nhd")
    x = torch.randn(100) * 0.1
    q = ref.quantize_kv(x, "fp8_e4m3", torch.tensor([0.01]))
    assert q.dtype == torch.uint8
    torch.testing.assert_close(ref.dequantize_kv(q, "fp8_e4m3", 0.01), x, atol=1e-3, rtol=0.07)
    assert ref.quantize_kv(x, "auto", 1.0, torch.float16).dtype == torch.float16


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_hnd_layout_holds_the_same_cache(kv_dtype):
    # The same tokens written into both layouts read back identically, and attention over them agrees.
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 40, 2, 64, generator=gen)
    slots = torch.randperm(6 * 8, generator=gen)[:40]
    caches = {}
    for layout in ref.KV_CACHE_LAYOUTS:
        kshape, vshape, cdt = ref.kv_cache_shapes(6, 8, 2, 64, torch.float32, kv_dtype, layout)
        kc, vc = torch.zeros(kshape, dtype=cdt), torch.zeros(vshape, dtype=cdt)
        ref.reshape_and_cache(key, value, kc, vc, slots, kv_dtype, 0.05, 0.05)
        caches[layout] = (kc, vc)
    for a, b in zip(caches["vllm"], ref.as_vllm_layout(*caches["hnd"])):
        assert torch.equal(a, b)
    # Token t of the hnd cache sits at [block, head, offset, :], as the layout promises.
    blk, off = slots[5] // 8, slots[5] % 8
    expected = ref.dequantize_kv(ref.quantize_kv(value[5], kv_dtype, 0.05, caches["hnd"][1].dtype), kv_dtype,
                                 0.05)
    torch.testing.assert_close(ref.dequantize_kv(caches["hnd"][1][blk, :, off], kv_dtype, 0.05), expected)
    query = torch.randn(1, 4, 64, generator=gen)
    table = torch.arange(6, dtype=torch.int32)[None]
    outs = []
    for layout in ref.KV_CACHE_LAYOUTS:
        out = torch.empty_like(query)
        ref.paged_attention_v1(out, query, *caches[layout], 2, 0.125, table, torch.tensor([37], dtype=torch.int32),
                               8, 37, None, kv_dtype, 0.05, 0.05)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def _decode_call(case, **over):
    args = dict(out=torch.empty_like(case["query"]), query=case["query"], key_cache=case["key_cache"],
                value_cache=case["value_cache"], num_kv_heads=case["num_kv_heads"], scale=case["scale"],
                block_tables=case["block_tables"], seq_lens=case["seq_lens"],
                block_size=case["block_size"], max_seq_len=case["max_seq_len"], alibi_slopes=None,
                kv_cache_dtype=case["kv_dtype"], k_scale=1.0, v_scale=1.0)
    args.update(over)
    ref.paged_attention_v1(**args)


def test_validation_errors():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ref.kv_cache_shapes(4, 16, 2, 64, torch.float16, "int8")
    with pytest.raises(ValueError, match="divisible"):
        ref.kv_cache_shapes(4, 16, 2, 72, torch.float16, "fp8")  # x = 16
    case = make_case(1, [20, 40], 8, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _decode_call(case, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="fp8"):
        _decode_call(case, kv_cache_dtype="fp8")  # float cache with an fp8 cache dtype
    with pytest.raises(ValueError, match="block table too short"):
        _decode_call(case, block_tables=case["block_tables"][:, :2])
    with pytest.raises(ValueError, match="max_seq_len"):
        _decode_call(case, max_seq_len=30)
    with pytest.raises(ValueError, match="num_kv_heads"):
        _decode_call(case, num_kv_heads=4)
    with pytest.raises(ValueError, match="block_size"):
        _decode_call(case, block_size=8)
    bad = case["block_tables"].clone()
    bad[1, 0] = 10_000
    with pytest.raises(ValueError, match="block id"):
        _decode_call(case, block_tables=bad)
    s, h, d = case["query"].shape
    with pytest.raises(ValueError, match="partitions"):
        ref.paged_attention_v2(torch.empty(s, h, d), torch.empty(s, h, 0), torch.empty(s, h, 0),
                               torch.empty(s, h, 0, d), case["query"], case["key_cache"],
                               case["value_cache"], 2, 0.1, case["block_tables"], case["seq_lens"], 16,
                               40, None, "auto", 1.0, 1.0)
    kc, vc = case["key_cache"], case["value_cache"]
    with pytest.raises(ValueError, match="slot"):
        ref.reshape_and_cache(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), kc, vc,
                              torch.tensor([kc.shape[0] * 16]), "auto", 1.0, 1.0)
    for slots in ([-5, 3], [-5, -1]):  # below -1, beside a written slot or not
        with pytest.raises(ValueError, match="slot"):
            ref.reshape_and_cache(torch.zeros(2, 2, 64), torch.zeros(2, 2, 64), kc, vc, torch.tensor(slots), "auto",
                                  1.0, 1.0)
    with pytest.raises(ValueError, match="auto"):
        ref.reshape_and_cache(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), kc.view(torch.uint8)[..., :16],
                              vc.view(torch.uint8)[..., :16], torch.tensor([0]), "auto", 1.0, 1.0)
    with pytest.raises(ValueError, match="new tokens"):
        out = torch.empty(3, 8, 64)
        ref.paged_prefill(out, torch.zeros(3, 8, 64), kc, vc, 2, 0.1, case["block_tables"],
                          torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32),
                          2, 40, None, "auto", 1.0, 1.0)


# ----------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_dispatch(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    ops.set_backend(None)
    yield monkeypatch
    ops.set_backend(None)


def _fake_backend(name, calls):
    mod = types.ModuleType(name)

    def paged_attention_v1(out, *args):
        calls.append(("v1", name))
        out.fill_(42.0)

    mod.paged_attention_v1 = paged_attention_v1
    return mod


def test_dispatch_defaults_to_reference_on_cpu_without_importing_triton(fresh_dispatch):
    fresh_dispatch.delitem(sys.modules, "pagedllm.ops.triton", raising=False)
    assert ops.get_backend(torch.device("cpu")) is ref
    case = make_case(1, [5, 9], 8, 2, 64, 16, torch.float32)
    out = torch.empty_like(case["query"])
    ops.paged_attention(out, case["query"], case["key_cache"], case["value_cache"], 2, case["scale"],
                        case["block_tables"], case["seq_lens"], 16, 9, None, "auto", 1.0, 1.0)
    torch.testing.assert_close(out, run_v1(case))
    assert "pagedllm.ops.triton" not in sys.modules


def test_dispatch_env_override(fresh_dispatch):
    calls = []
    fresh_dispatch.setitem(sys.modules, "pagedllm.ops.cuda", _fake_backend("cuda", calls))
    fresh_dispatch.setenv(ops.ENV_VAR, "cuda")
    ops.set_backend(None)
    case = make_case(1, [5, 9], 8, 2, 64, 16, torch.float32)
    out = torch.empty_like(case["query"])
    ops.paged_attention_v1(out, case["query"], case["key_cache"], case["value_cache"], 2, 0.1,
                           case["block_tables"], case["seq_lens"], 16, 9, None, "auto", 1.0, 1.0)
    assert calls == [("v1", "cuda")] and out.eq(42.0).all()
    # paged_attention falls back to the chosen backend's v1, never silently to another backend
    ops.paged_attention(out, case["query"], case["key_cache"], case["value_cache"], 2, 0.1,
                        case["block_tables"], case["seq_lens"], 16, 9, None, "auto", 1.0, 1.0)
    assert calls[-1] == ("v1", "cuda")
    with pytest.raises(NotImplementedError, match="paged_prefill"):
        ops.paged_prefill(out, case["query"], case["key_cache"], case["value_cache"], 2, 0.1,
                          case["block_tables"], case["seq_lens"], torch.tensor([0, 1, 2]), 1, 9, None,
                          "auto", 1.0, 1.0)
    # resolved once: changing the env alone does not re-resolve; set_backend(None) does
    fresh_dispatch.setenv(ops.ENV_VAR, "reference")
    assert ops.get_backend("cpu").__name__ == "cuda"
    ops.set_backend(None)
    assert ops.get_backend("cpu") is ref
    # set_backend pins over the environment
    fresh_dispatch.setenv(ops.ENV_VAR, "cuda")
    ops.set_backend("reference")
    assert ops.get_backend("cpu") is ref and ops.get_backend("cuda") is ref


def test_dispatch_unknown_backend_raises(fresh_dispatch):
    fresh_dispatch.setenv(ops.ENV_VAR, "tpu")
    ops.set_backend(None)
    case = make_case(1, [5], 8, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match=r"'tpu'.*reference, triton, cuda"):
        ops.paged_attention(
            torch.empty_like(case["query"]), case["query"], case["key_cache"], case["value_cache"], 2,
            0.1, case["block_tables"], case["seq_lens"], 16, 5, None, "auto", 1.0, 1.0)
    with pytest.raises(ValueError, match="unknown pagedllm ops backend"):
        ops.get_backend("cpu")
    with pytest.raises(ValueError, match="'bogus'"):
        ops.set_backend("bogus")


def test_dispatch_cuda_auto_choice(fresh_dispatch):
    calls = []
    fresh_dispatch.setitem(sys.modules, "pagedllm.ops.triton", _fake_backend("triton", calls))
    ops.set_backend(None)
    assert ops.get_backend(torch.device("cuda", 0)).__name__ == "triton"
    assert ops.get_backend("cpu") is ref
    # without an importable triton backend, CUDA tensors fall back to the reference (with a warning)
    fresh_dispatch.setitem(sys.modules, "pagedllm.ops.triton", None)
    fresh_dispatch.setattr(ops, "_warned", False)
    ops.set_backend(None)
    with pytest.warns(RuntimeWarning, match="reference"):
        assert ops._resolve("paged_attention_v1", "cuda") is ref.paged_attention_v1
    # an automatically chosen backend that lacks an op falls back to the reference for that op
    fresh_dispatch.setitem(sys.modules, "pagedllm.ops.triton", _fake_backend("triton", calls))
    ops.set_backend(None)
    assert ops._resolve("paged_prefill", "cuda") is ref.paged_prefill
    assert ops._resolve("kv_cache_shapes", "cuda") is ref.kv_cache_shapes
