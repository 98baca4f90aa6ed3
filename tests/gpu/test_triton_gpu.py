"""The Triton kernels against pagedllm.ops.reference on CUDA over the full parameter grid: head sizes
64/80/96/112/128/256, GQA 1/4/8, block sizes 8/16/32, bf16 and fp16, fp16/bf16/fp8 caches, ALiBi,
block-sparse, ragged lengths up to 32K. Outputs are NaN-poisoned; caches are poisoned outside the
sequences (see tests/paged_cases.py). Every kernel test runs on both cache layouts ("vllm" and the
engine's "hnd"). Skipped as a whole without CUDA."""
import itertools
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/paged_cases.py

import pagedllm.ops.triton as ops  # noqa: E402
from pagedllm.ops import reference  # noqa: E402
from paged_cases import alibi, assert_close, make_caches, nan_like  # noqa: E402

DEV = "cuda"
# dtype x cache kind x ALiBi, and the cache layout (switching every len(VARIANTS) cases), rotate over the
# (head, GQA, block) grid so every value meets every other axis without compiling the full product.
VARIANTS = [(torch.bfloat16, "auto", False), (torch.float16, "auto", True), (torch.bfloat16, "fp8_e4m3", True),
            (torch.float16, "fp8_e5m2", False), (torch.float16, "fp8", False), (torch.bfloat16, "auto", True)]
GRID = [(h, g, b, *VARIANTS[i % len(VARIANTS)], reference.KV_CACHE_LAYOUTS[i // len(VARIANTS) % 2])
        for i, (h, g, b) in enumerate(itertools.product([64, 80, 96, 112, 128, 256], [1, 4, 8], [8, 16, 32]))]


def _scales(kv_cache_dtype):
    if kv_cache_dtype == "auto":
        return 1.0, 1.0
    return torch.tensor([0.05], device=DEV), torch.tensor([0.04], device=DEV)


def _decode_args(seed, seq_lens, group, head_size, block_size, dtype, kv_cache_dtype, use_alibi, layout,
                 kv_heads=2):
    gen = torch.Generator().manual_seed(seed)
    scales = _scales(kv_cache_dtype)
    kc, vc, tables, lens, _, _ = make_caches(seq_lens, kv_heads, head_size, block_size, dtype, kv_cache_dtype,
                                             DEV, gen, *scales, layout=layout)
    heads = kv_heads * group
    query = torch.randn(len(seq_lens), heads, head_size, generator=gen).to(DEV, dtype)
    return query, (query, kc, vc, kv_heads, head_size ** -0.5, tables, lens, block_size, max(seq_lens),
                   alibi(heads, DEV) if use_alibi else None, kv_cache_dtype, *scales)


def _check_decode(query, args, dtype, sparse=()):
    expected = torch.empty_like(query)
    reference.paged_attention_v1(expected, *args, *sparse)
    parts = -(-args[8] // reference.PARTITION_SIZE)
    s, h, d = query.shape
    for name in ("v1", "v2") + (("auto",) if not sparse else ()):
        out = nan_like(query)
        if name == "v1":
            ops.paged_attention_v1(out, *args, *sparse)
        elif name == "v2":
            ws = (torch.empty(s, h, parts, device=DEV), torch.empty(s, h, parts, device=DEV),
                  torch.empty(s, h, parts, d, device=DEV, dtype=dtype))
            ops.paged_attention_v2(out, *ws, *args, *sparse)
        else:
            ops.paged_attention(out, *args)
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("head_size,group,block_size,dtype,kv_cache_dtype,use_alibi,layout", GRID)
def test_decode(head_size, group, block_size, dtype, kv_cache_dtype, use_alibi, layout):
    lens = [1, block_size, block_size + 1, 511, 513, 2999]
    query, args = _decode_args(head_size * group + block_size, lens, group, head_size, block_size, dtype,
                               kv_cache_dtype, use_alibi, layout)
    _check_decode(query, args, dtype)


@pytest.mark.parametrize("head_size,group,dtype,kv_cache_dtype",
                         [(128, 4, torch.bfloat16, "auto"), (128, 8, torch.float16, "fp8_e4m3"),
                          (64, 1, torch.bfloat16, "auto"), (256, 4, torch.bfloat16, "fp8_e5m2")])
@pytest.mark.parametrize("layout", reference.KV_CACHE_LAYOUTS)
def test_decode_long_context(head_size, group, dtype, kv_cache_dtype, layout):
    query, args = _decode_args(7, [32768, 1, 20000, 4097], group, head_size, 16, dtype, kv_cache_dtype, False,
                               layout)
    _check_decode(query, args, dtype)


@pytest.mark.parametrize("block_size,sparse_block,step", [(16, 64, 0), (8, 32, 1), (32, 64, -1), (16, 16, 2)])
@pytest.mark.parametrize("layout", reference.KV_CACHE_LAYOUTS)
def test_decode_block_sparse(block_size, sparse_block, step, layout):
    query, args = _decode_args(step + 3, [3000, 1, 700, 64], 4, 128, block_size, torch.bfloat16, "auto", False,
                               layout, kv_heads=4)
    _check_decode(query, args, torch.bfloat16, sparse=(1, 2, 4, sparse_block, step))


@pytest.mark.parametrize("longest", [1129, 1000], ids=["big-tile", "short-sequence-tile"])
@pytest.mark.parametrize("head_size,group,block_size,dtype,kv_cache_dtype,use_alibi,layout", GRID)
def test_prefill(head_size, group, block_size, dtype, kv_cache_dtype, use_alibi, layout, longest):
    """(cached, new) parts; with no sequence over 1024 tokens the kernel takes its short-sequence tile."""
    parts = [(0, 300), (257, 1), (longest - 129, 129), (0, 1), (block_size, 2 * block_size + 3)]
    _check_prefill(head_size * 7 + group, parts, group, head_size, block_size, dtype, kv_cache_dtype, use_alibi,
                   layout)


@pytest.mark.parametrize("layout", reference.KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("cached,new", [(0, 8192), (16384, 4096), (30000, 2768)])
def test_prefill_long(cached, new, layout):
    _check_prefill(cached + new, [(cached, new), (5, 300)], 4, 128, 16, torch.bfloat16, "auto", False, layout)


def _check_prefill(seed, parts, group, head_size, block_size, dtype, kv_cache_dtype, use_alibi, layout,
                   kv_heads=2):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in parts]
    scales = _scales(kv_cache_dtype)
    kc, vc, tables, lens, _, _ = make_caches(seq_lens, kv_heads, head_size, block_size, dtype, kv_cache_dtype,
                                             DEV, gen, *scales, layout=layout)
    q_lens = [n for _, n in parts]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(DEV, torch.int32)
    heads = kv_heads * group
    query = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(DEV, dtype)
    args = (query, kc, vc, kv_heads, head_size ** -0.5, tables, lens, qsl, max(q_lens), max(seq_lens),
            alibi(heads, DEV) if use_alibi else None, kv_cache_dtype, *scales)
    expected = torch.empty_like(query)
    reference.paged_prefill(expected, *args)
    out = nan_like(query)
    ops.paged_prefill(out, *args)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("layout", reference.KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 256])
@pytest.mark.parametrize("dtype,kv_cache_dtype", [(torch.bfloat16, "auto"), (torch.float16, "auto"),
                                                  (torch.bfloat16, "fp8_e4m3"), (torch.float16, "fp8_e5m2")])
def test_reshape_and_cache(head_size, dtype, kv_cache_dtype, layout):
    gen = torch.Generator(device=DEV).manual_seed(head_size)
    num_tokens, kv_heads, num_blocks, block_size = 300, 4, 40, 16
    kshape, vshape, cdtype = reference.kv_cache_shapes(num_blocks, block_size, kv_heads, head_size, dtype,
                                                       kv_cache_dtype, layout)
    key = (3 * torch.randn(num_tokens, kv_heads, head_size, generator=gen, device=DEV)).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_size, generator=gen, device=DEV).to(dtype)
    key[0, 0, :4] = 1e4  # saturates for fp8
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEV)[:num_tokens - 5]
    slots[::7] = -1
    scales = _scales(kv_cache_dtype)
    caches = []
    for impl in (reference, ops):
        kc = torch.randint(0, 100, kshape, generator=torch.Generator(device=DEV).manual_seed(1), device=DEV)
        vc = torch.randint(0, 100, vshape, generator=torch.Generator(device=DEV).manual_seed(2), device=DEV)
        kc, vc = kc.to(cdtype), vc.to(cdtype)
        impl.reshape_and_cache(key, value, kc, vc, slots, kv_cache_dtype, *scales)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_keeps_a_nan(kv_cache_dtype):
    """A NaN key or value is stored as NaN, as the reference stores it, not as the largest finite fp8 value that a
    saturating min / max makes of it (the kernels' clamp propagates NaN)."""
    kshape, vshape, cdtype = reference.kv_cache_shapes(2, 16, 1, 64, torch.bfloat16, kv_cache_dtype, "hnd")
    key = torch.randn(3, 1, 64, device=DEV).to(torch.bfloat16)
    value = key.clone()
    key[1, 0, 5] = value[2, 0, 7] = float("nan")
    kc, vc = torch.zeros(kshape, dtype=cdtype, device=DEV), torch.zeros(vshape, dtype=cdtype, device=DEV)
    ops.reshape_and_cache(key, value, kc, vc, torch.tensor([0, 1, 2], device=DEV), kv_cache_dtype, 1.0, 1.0)
    k, v = (reference.dequantize_kv(c, kv_cache_dtype, 1.0)[0, 0, :3] for c in (kc, vc))
    assert torch.isnan(k).nonzero().tolist() == [[1, 5]] and torch.isnan(v).nonzero().tolist() == [[2, 7]]
