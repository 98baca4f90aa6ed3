"""The Triton kernels against pagedllm.ops.reference, on CPU under the Triton interpreter (fp16/fp32;
the interpreter mishandles bf16). tests/gpu/test_triton_gpu.py runs the same checks on CUDA at scale."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (the ops import it lazily)

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm.ops import reference  # noqa: E402
from paged_cases import alibi, assert_close, make_caches, nan_like  # noqa: E402

pytest.importorskip("triton")


def _ops():
    import pagedllm.ops.triton as ops
    return ops


def _decode_case(seed, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, kv_cache_dtype,
                 use_alibi, scale_as_tensor=True, layout="vllm"):
    gen = torch.Generator().manual_seed(seed)
    k_scale, v_scale = (0.05, 0.04) if kv_cache_dtype != "auto" else (1.0, 1.0)
    if scale_as_tensor:
        k_scale, v_scale = torch.tensor([k_scale]), torch.tensor([v_scale])
    kc, vc, tables, lens, _, _ = make_caches(seq_lens, num_kv_heads, head_size, block_size, dtype,
                                             kv_cache_dtype, "cpu", gen, k_scale, v_scale, layout=layout)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype)
    slopes = alibi(num_heads, "cpu") if use_alibi else None
    args = (query, kc, vc, num_kv_heads, head_size ** -0.5, tables, lens, block_size, max(seq_lens), slopes,
            kv_cache_dtype, k_scale, v_scale)
    return query, args


# (seed, seq_lens, heads, kv_heads, head_size, block_size, dtype, kv_cache_dtype, alibi)
DECODE_CASES = [
    (0, [1, 16, 37], 4, 4, 64, 16, torch.float32, "auto", False),
    (1, [8, 9, 530], 8, 2, 80, 8, torch.float16, "auto", False),
    (2, [513, 1, 64], 8, 2, 64, 8, torch.float32, "auto", True),
    (3, [100, 17], 4, 1, 80, 16, torch.float16, "fp8_e4m3", False),
    (4, [31, 600], 4, 4, 64, 16, torch.float32, "fp8_e5m2", True),
    (5, [2, 47, 64], 4, 1, 64, 8, torch.float16, "fp8", True),
]


@pytest.mark.parametrize("layout", reference.KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"seed{c[0]}")
@pytest.mark.parametrize("kernel", ["v1", "v2", "auto"])
def test_decode_matches_reference(case, kernel, layout):
    dtype = case[6]
    query, args = _decode_case(*case, layout=layout)
    expected = torch.empty_like(query)
    reference.paged_attention_v1(expected, *args)
    out = nan_like(query)
    ops = _ops()
    if kernel == "v1":
        ops.paged_attention_v1(out, *args)
    elif kernel == "v2":
        _run_v2_and_check_workspace(ops, out, query, args)
    else:
        ops.paged_attention(out, *args)
    assert_close(out, expected, dtype)


def _v2_workspace(query, max_seq_len, fill):
    parts = -(-max_seq_len // reference.PARTITION_SIZE)
    s, h, d = query.shape
    return (torch.full((s, h, parts), fill), torch.full((s, h, parts), fill),
            torch.full((s, h, parts, d), fill, dtype=query.dtype))


def _run_v2_and_check_workspace(ops, out, query, args, sparse=()):
    max_seq_len, lens = args[8], args[6]
    ours = _v2_workspace(query, max_seq_len, float("nan"))
    theirs = _v2_workspace(query, max_seq_len, 0.0)
    ops.paged_attention_v2(out, *ours, *args, *sparse)
    reference.paged_attention_v2(torch.empty_like(query), *theirs, *args, *sparse)
    # Only partitions holding tokens are defined (vLLM leaves the others unwritten too).
    parts = torch.arange(ours[0].shape[-1])
    live = parts[None, :] * reference.PARTITION_SIZE < lens[:, None].long()
    for name, a, b in zip(("exp_sums", "max_logits", "tmp_out"), ours, theirs):
        a, b = a[live.nonzero(as_tuple=True)[0], :, live.nonzero(as_tuple=True)[1]], \
            b[live.nonzero(as_tuple=True)[0], :, live.nonzero(as_tuple=True)[1]]
        torch.testing.assert_close(a.float(), b.float(), atol=5e-3, rtol=5e-3, msg=name)


@pytest.mark.parametrize("kernel", ["v1", "v2"])
@pytest.mark.parametrize("step", [0, 1, -2])
def test_decode_block_sparse(kernel, step):
    # 8 query heads over 2 kv heads; sparse blocks of 32 tokens over pages of 8; lengths past 512 for v2.
    query, args = _decode_case(10 + step, [200, 577, 33], 8, 2, 64, 8, torch.float32, "auto", step == 1,
                               layout=reference.KV_CACHE_LAYOUTS[step % 2])
    sparse = (0, 2, 3, 32, step)  # tp_rank, local_blocks, vert_stride, block_size, head_sliding_step
    expected = torch.empty_like(query)
    reference.paged_attention_v1(expected, *args, *sparse)
    out = nan_like(query)
    if kernel == "v1":
        _ops().paged_attention_v1(out, *args, *sparse)
    else:
        _run_v2_and_check_workspace(_ops(), out, query, args, sparse)
    assert_close(out, expected, torch.float32)


def test_decode_float_scales_and_empty_sequence():
    # Scales given as Python floats; a zero-length sequence yields 0 (as the reference) on both paths.
    query, args = _decode_case(20, [0, 300], 4, 2, 64, 16, torch.float32, "fp8_e4m3", False,
                               scale_as_tensor=False)
    expected = torch.empty_like(query)
    reference.paged_attention_v1(expected, *args)
    for fn in (_ops().paged_attention_v1, _ops().paged_attention):
        out = nan_like(query)
        fn(out, *args)
        assert_close(out, expected, torch.float32)


def test_split_plan():
    from pagedllm.ops.triton.decode import split_plan
    # Few (sequence, kv head) pairs and a long context: split; partitions are whole tiles covering it.
    parts, tokens = split_plan(1, 8, 32768, 64, 132)
    assert parts > 8 and tokens % 64 == 0 and parts * tokens >= 32768 > (parts - 1) * tokens
    # Enough pairs to fill the GPU, or too short to be worth it: single pass.
    assert split_plan(256, 8, 2048, 64, 132)[0] == 1
    assert split_plan(24, 8, 1024, 64, 132)[0] == 1
    assert split_plan(4, 8, 100, 64, 132)[0] == 1
    # Less work splits finer (the floor scales with programs x context, up to 512 tokens).
    assert split_plan(1, 8, 1024, 64, 132) == (8, 128)
    assert split_plan(8, 8, 1024, 64, 132) == (8, 128)
    assert split_plan(1, 8, 16384, 64, 132) == (64, 256)
    assert split_plan(1, 8, 32768, 64, 132) == (64, 512)
    # Never past one wave of 4 programs an SM: 16 x 8 pairs split 4 ways (528 slots), not 5.
    assert split_plan(16, 8, 4096, 64, 132) == (4, 1024)


@pytest.mark.parametrize("layout", reference.KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("kv_cache_dtype,dtype,head_size,block_size",
                         [("auto", torch.float16, 64, 16), ("auto", torch.float32, 80, 8),
                          ("fp8_e4m3", torch.float16, 80, 16), ("fp8_e5m2", torch.float32, 64, 8)])
def test_reshape_and_cache_matches_reference(kv_cache_dtype, dtype, head_size, block_size, layout):
    gen = torch.Generator().manual_seed(head_size + block_size)
    num_tokens, num_kv_heads, num_blocks = 12, 2, 5
    kshape, vshape, cdtype = reference.kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_size, dtype,
                                                       kv_cache_dtype, layout)
    key = (4 * torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    scales = (1.0, 1.0)
    if kv_cache_dtype != "auto":
        # The interpreter's float->fp8 cast mis-rounds values that round up to a power of two (the GPU's
        # cast is right; the GPU test covers rounding). Here: fp8-representable values, power-of-2 scales.
        scales = (torch.tensor([0.0625]), torch.tensor([0.03125]))
        f8 = reference.fp8_dtype(kv_cache_dtype)
        fmax = torch.finfo(f8).max
        key = (key.float() / scales[0]).clamp(-fmax, fmax).to(f8).float().mul(scales[0]).to(dtype)
        value = (value.float() / scales[1]).clamp(-fmax, fmax).to(f8).float().mul(scales[1]).to(dtype)
    key[0, 0, 0] = 1e4  # past the fp8 range: must saturate, not become NaN
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens - 2]
    slots[3] = -1  # skipped; the last two tokens have no slot (padding)
    caches = []
    for impl in (reference, _ops()):
        kc = torch.randint(0, 100, kshape, generator=torch.Generator().manual_seed(7)).to(cdtype)
        vc = torch.randint(0, 100, vshape, generator=torch.Generator().manual_seed(8)).to(cdtype)
        impl.reshape_and_cache(key, value, kc, vc, slots, kv_cache_dtype, *scales)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("layout", reference.KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("kv_cache_dtype,dtype,head_size,block_size",
                         [("auto", torch.float16, 64, 16), ("auto", torch.float32, 80, 8),
                          ("fp8_e4m3", torch.float16, 80, 16), ("fp8_e5m2", torch.float32, 64, 8)])
def test_gather_cache_reads_back_a_sequence(kv_cache_dtype, dtype, head_size, block_size, layout):
    """A sequence's K/V out of shuffled pages, dequantized, zeros past its end: the XAttention reference's gather."""
    from pagedllm.ops.triton.cache import gather_cache
    from pagedllm.ops.xattention.reference import gather_sequence
    gen = torch.Generator().manual_seed(head_size)
    num_kv_heads, num_blocks, seq_len, length = 2, 9, 5 * block_size - 3, 6 * block_size + 1
    kshape, vshape, cdtype = reference.kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_size, dtype,
                                                       kv_cache_dtype, layout)
    kc, vc = (torch.randint(0, 100, shape, generator=gen).to(cdtype) for shape in (kshape, vshape))
    table = torch.randperm(num_blocks, generator=gen)[:6].to(torch.int32)
    scales = (0.5, 0.25) if kv_cache_dtype != "auto" else (1.0, 1.0)
    k_out, v_out = (torch.full((num_kv_heads, length, head_size), float("nan"), dtype=dtype) for _ in range(2))
    gather_cache(kc, vc, table, seq_len, k_out, v_out, kv_cache_dtype, *scales)
    vk, vv = reference.as_vllm_layout(kc, vc)
    for out, cache, scale, is_key in ((k_out, vk, scales[0], True), (v_out, vv, scales[1], False)):
        want = gather_sequence(cache, table, seq_len, kv_cache_dtype, scale, dtype, is_key)
        assert torch.equal(out[:, :seq_len], want)
        assert not out[:, seq_len:].any()


# (seed, [(context, new tokens)], heads, kv_heads, head_size, block_size, dtype, kv_cache_dtype, alibi)
PREFILL_CASES = [
    (0, [(0, 37), (0, 1), (0, 16)], 4, 4, 64, 16, torch.float32, "auto", False),  # plain prefill
    (1, [(40, 23), (5, 1), (16, 50)], 8, 2, 80, 8, torch.float16, "auto", False),  # prefix hits / chunks
    (2, [(0, 45), (33, 12)], 8, 2, 64, 8, torch.float32, "auto", True),
    (3, [(24, 30), (0, 9)], 4, 1, 64, 16, torch.float16, "fp8_e4m3", True),
    (4, [(7, 20), (64, 0), (1, 33)], 4, 4, 80, 16, torch.float32, "fp8_e5m2", False),
]


@pytest.mark.parametrize("layout", reference.KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"seed{c[0]}")
def test_prefill_matches_reference(case, layout):
    seed, parts, num_heads, num_kv_heads, head_size, block_size, dtype, kv_cache_dtype, use_alibi = case
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in parts]
    scales = (torch.tensor([0.05]), torch.tensor([0.04])) if kv_cache_dtype != "auto" else (1.0, 1.0)
    kc, vc, tables, lens, _, _ = make_caches(seq_lens, num_kv_heads, head_size, block_size, dtype,
                                             kv_cache_dtype, "cpu", gen, *scales, layout=layout)
    q_lens = [n for _, n in parts]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    num_tokens = sum(q_lens) + 2  # two padding rows past the last sequence stay untouched
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    slopes = alibi(num_heads, "cpu") if use_alibi else None
    args = (query, kc, vc, num_kv_heads, head_size ** -0.5, tables, lens, qsl, max(q_lens), max(seq_lens),
            slopes, kv_cache_dtype, *scales)
    expected = nan_like(query)
    reference.paged_prefill(expected, *args)
    out = nan_like(query)
    _ops().paged_prefill(out, *args)
    assert torch.isnan(out[-2:]).all(), "padding rows past query_start_loc[-1] were written"
    assert_close(out[:-2], expected[:-2], dtype)


@pytest.mark.parametrize("layout", reference.KV_CACHE_LAYOUTS)
def test_bad_shapes_are_named_before_any_launch(layout):
    """The kernels index with their arguments' shapes unchecked, so each op checks them first, as the reference and
    the CUDA ops do: a wrong shape is a ValueError naming it, and nothing is written (on the GPU it would have read
    or written out of bounds)."""
    ops = _ops()
    query, args = _decode_case(30, [20, 40], 8, 2, 64, 16, torch.float32, "auto", False, layout=layout)
    (kc, vc, hkv, scale, tables, lens, bs, max_len), rest = args[1:9], args[9:]
    cache = (kc.clone(), vc.clone())

    def decode(fn, q=query, out=None, **over):
        a = dict(kv=hkv, tables=tables, lens=lens, bs=bs, max_len=max_len, slopes=None) | over
        fn(nan_like(q) if out is None else out, q, kc, vc, a["kv"], scale, a["tables"], a["lens"], a["bs"],
           a["max_len"], a["slopes"], *rest[1:])

    bad = [("query", dict(q=query[..., :32])), ("query", dict(q=query[0])),
           ("out shape", dict(out=torch.empty(2, 8, 32))), ("num_kv_heads", dict(kv=4)), ("block_size", dict(bs=8)),
           ("block_tables", dict(tables=tables[:1])), ("seq_lens", dict(lens=lens[:1])),
           ("alibi_slopes", dict(slopes=torch.ones(4)))]
    for fn in (ops.paged_attention_v1, ops.paged_attention):
        for name, over in bad:
            with pytest.raises(ValueError, match=name):
                decode(fn, **over)
    exp_sums, max_logits, tmp_out = _v2_workspace(query, max_len, float("nan"))
    with pytest.raises(ValueError, match="partitions"):  # max_seq_len past what the workspace holds
        decode(lambda out, *a: ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, *a), max_len=10_000)
    with pytest.raises(ValueError, match="tmp_out"):
        decode(lambda out, *a: ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out[:1], *a))
    assert torch.isnan(tmp_out).all()
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.paged_prefill(nan_like(query), query, kc, vc, hkv, scale, tables, lens, qsl[:2], 3, max_len, None,
                          *rest[1:])
    with pytest.raises(ValueError, match="num_kv_heads"):
        ops.paged_prefill(nan_like(query), query, kc, vc, 4, scale, tables, lens, qsl, 3, max_len, None, *rest[1:])
    key = torch.ones(3, hkv, 64)
    for k, slots in ((key[..., :32], torch.tensor([0, 1, 2])), (key, torch.arange(4))):
        with pytest.raises(ValueError, match="key and value|slot_mapping"):
            ops.reshape_and_cache(k, k, kc, vc, slots, "auto", 1.0, 1.0)
    for now, before in zip((kc, vc), cache):  # unwritten slots hold NaN
        torch.testing.assert_close(now, before, rtol=0, atol=0, equal_nan=True)


def test_programmatic_launch_only_on_cuda_and_switchable(monkeypatch):
    """CPU tensors (the interpreter) never launch as programmatic dependents, and PAGEDLLM_PDL=0 turns them off
    everywhere (the kernels then run exactly as plain launches; tests/gpu run them with it on). Without PDL
    the launch carries no launch_pdl keyword at all, which backends without the option reject."""
    from pagedllm.ops.triton import pdl
    x = torch.zeros(4)
    assert not pdl.enabled(x) and pdl.options(x) == {"PDL": False}

    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(FakeCuda())  # the interpreter has no grid dependency control
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(pdl.ENV_VAR, "0")
    assert not pdl.enabled(FakeCuda())  # switched off before the device is asked anything
