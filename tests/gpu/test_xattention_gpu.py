"""XAttention Triton kernels at realistic sizes on the GPU (32 query / 8 kv heads, head 128, bf16) against the
PyTorch references and dense attention. Run: python -m pytest -q tests/gpu/test_xattention_gpu.py"""
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import ops  # noqa: E402
from pagedllm.ops import reference as ops_ref  # noqa: E402
from pagedllm.ops import xattention as xa  # noqa: E402
from pagedllm.ops.xattention import estimate  # noqa: E402
from pagedllm.ops.xattention import reference as ref  # noqa: E402

H, HKV, D = 32, 8, 128


@pytest.fixture(params=["triton", "cuda"])
def sparse_backend(request):
    """The ops backend: with "cuda" on Hopper, block-sparse attention runs csrc/sparse_attention.cu."""
    if request.param == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the CUDA sparse attention kernel needs a Hopper GPU")
    ops.set_backend(request.param)
    yield request.param
    ops.set_backend(None)


def _qkv(q_len, k_len, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, H, q_len, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(1, HKV, k_len, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(1, HKV, k_len, D, device="cuda", generator=g).to(dtype)
    return q, k, v


def test_seed_examples():
    q = torch.ones(1, 1, 512, 128, device="cuda", dtype=torch.float16)
    k = torch.ones(1, 1, 2048, 128, device="cuda", dtype=torch.float16)
    q[:, :, 1::2] = 2
    k[:, :, 1::2] = 2
    assert torch.all(xa.flat_group_gemm_fuse_reshape(q, k, 4, 384, 512, is_causal=False) == 1024)
    sums = xa.softmax_fuse_block_sum(torch.ones(1, 1, 128, 512, device="cuda"), 128, 128, 0, 128, 128, 1.0, False)
    torch.testing.assert_close(sums, torch.full_like(sums, 32.0))


@pytest.mark.parametrize("stride", [8, 16])
def test_seed_stages_match_reference(stride):
    q, k, _ = _qkv(4096, 8192, seed=0)
    start = (8192 - 4096) // stride
    scores = xa.flat_group_gemm_fuse_reshape(q, k, stride, start, start + 4096 // stride)
    want = ref.flat_group_gemm_fuse_reshape(q, k, stride, start, start + 4096 // stride)
    vis = torch.arange(8192 // stride, device="cuda")[None, :] <= start + torch.arange(4096 // stride,
                                                                                     device="cuda")[:, None]
    torch.testing.assert_close(scores[..., vis].float(), want[..., vis].float(), rtol=1e-2, atol=0.5)
    args = (128 // stride, 512, start, start + 4096 // stride, 4096 // stride - 8, ref.estimate_scale(D, stride))
    torch.testing.assert_close(xa.softmax_fuse_block_sum(want, *args), ref.softmax_fuse_block_sum(want, *args),
                               rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("q_len,k_len,stride", [(8192, 8192, 8), (16384, 16384, 16), (5000, 20000, 8)])
def test_block_sums_match_reference(q_len, k_len, stride):
    q, k, _ = _qkv(q_len, k_len, seed=1)
    got, first = estimate.block_sums(q, k, 128, stride, 16384, True)
    want, _ = ref.block_sums(q, k, 128, stride, 4096, True)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    mask, density = xa.xattn_estimate(q, k, 128, stride, 0.9)
    assert torch.equal(mask, estimate.select_blocks(got, first, 0.9)[0])  # the estimate is select(sums)
    # the bisection kernel and the sorting reference agree but for float ties at the threshold
    assert (mask != ref.select_blocks(got, first, 0.9)[0]).float().mean() < 1e-4
    assert 0 < float(density) <= 1


@pytest.mark.parametrize("stride", [8, 16])
def test_fp8_estimate_matches_reference(stride):
    """fp8_estimate: the kernel's e4m3 tokens and row scales are the reference's rounding bit for bit (the query
    starting mid reshaped row, channels spanning four decades). The H100's fp8 MMAs add into their accumulator
    keeping ~14 bits, so the block sums follow exact fp8 math to ~2e-2 (on real text ~1e-2, benchmarks/results),
    and the selection nearly everywhere."""
    q, k, _ = _qkv(5000, 20000, seed=7)
    q = q * torch.logspace(-2, 2, D, device="cuda").bfloat16()
    for x, front in ((q, (20000 - 5000) % stride), (k, 0)):
        tokens, scales = estimate._fp8_tokens(x, front, stride)
        deq = (tokens.float().view(*scales.shape, -1) * scales[..., None]).view(*x.shape[:2], -1, D)
        assert torch.equal(deq[:, :, front:front + x.shape[2]], ref.fp8_rows(x, front, stride))
    got, first = estimate.block_sums(q, k, 128, stride, 16384, True, fp8_estimate=True)
    want = ref.block_sums(q, k, 128, stride, 4096, True, fp8_estimate=True)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=5e-2)
    mask, density = xa.xattn_estimate(q, k, 128, stride, 0.9, fp8_estimate=True)
    exact, _ = ref.select_blocks(want, first, 0.9)
    assert (mask != exact).sum() < 0.02 * exact.sum() and 0 < float(density) < 1


@pytest.mark.parametrize("heads,kv_heads,head,stride", [(9, 3, 64, 8), (4, 1, 256, 16), (4, 2, 80, 8),
                                                      (4, 2, 72, 16)])
def test_block_sums_other_heads_match_reference(heads, kv_heads, head, stride):
    """SmolLM2's and Gemma 3's shapes; heads of 80 (16-channel GEMM steps) and 72 (padded to 80); the query a
    packed [tokens, heads, D] slice as the engine passes it."""
    g = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(3000, heads, head, device="cuda", generator=g).bfloat16().transpose(0, 1)[None]
    k = torch.randn(1, kv_heads, 5000, head, device="cuda", generator=g).bfloat16()
    got, _ = estimate.block_sums(q, k, 128, stride, 16384, True)
    torch.testing.assert_close(got, ref.block_sums(q, k, 128, stride, 4096, True)[0], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("q_len,k_len", [(8192, 8192), (3000, 10000)])
def test_block_sparse_attention_matches_reference(q_len, k_len, sparse_backend):
    q, k, v = _qkv(q_len, k_len, seed=2)
    first, q_blocks, k_blocks = ref.block_layout(q_len, k_len, 128)
    mask = torch.rand(1, H, q_blocks, k_blocks, device="cuda") < 0.3
    mask[..., 0] = True
    mask[..., torch.arange(q_blocks), first + torch.arange(q_blocks)] = True
    out = xa.block_sparse_attention(q, k, v, mask)
    want = ref.block_sparse_attention(q, k, v, mask)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_block_sparse_attention_non_causal_with_empty_rows(sparse_backend):
    """Without causality every listed block is visible, the last one masked only at the ragged end; a query
    block with no block listed gives zeros. Half the rows list an odd number of blocks (the CUDA kernel runs such
    a row's first block on its own before overlapping the rest)."""
    q_len, k_len = 1000, 2000
    q, k, v = _qkv(q_len, k_len, seed=7)
    first, q_blocks, k_blocks = ref.block_layout(q_len, k_len, 128)
    g = torch.Generator(device="cuda").manual_seed(7)
    mask = torch.rand(1, H, q_blocks, k_blocks, device="cuda", generator=g) < 0.5
    mask[0, 0, 2] = False
    counts = mask.sum(-1)
    assert (counts % 2 == 1).any() and (counts[counts > 0] % 2 == 0).any()
    out = xa.block_sparse_attention(q, k, v, mask, causal=False)
    want = ref.block_sparse_attention(q, k, v, mask, causal=False)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    rows = slice((first + 2) * 128 - (k_len - q_len), (first + 3) * 128 - (k_len - q_len))
    assert torch.all(out[0, 0, rows] == 0)


@pytest.mark.parametrize("heads,kv_heads,head", [(9, 3, 64), (4, 2, 96)])
def test_block_sparse_attention_other_heads_match_reference(heads, kv_heads, head):
    """SmolLM2's shape (benchmarks/xattention.py's real data) and a head size padded to a power of two (the
    masked loads of unmasked tiles)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, heads, 4096, head, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, kv_heads, 4096, head, device="cuda", generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(1, heads, 32, 32, device="cuda", generator=g) < 0.3
    mask[..., 0] = True
    mask[..., torch.arange(32), torch.arange(32)] = True
    out = xa.block_sparse_attention(q, k, v, mask)
    torch.testing.assert_close(out.float(), ref.block_sparse_attention(q, k, v, mask).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n", [8192, 32768])
def test_full_mask_equals_sdpa(n, sparse_backend):
    q, k, v = _qkv(n, n, seed=3)
    blocks = n // 128
    mask = torch.ones(1, H, blocks, blocks, dtype=torch.bool, device="cuda")
    out = xa.block_sparse_attention(q, k, v, mask)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1),
                                          is_causal=True)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def _paged(seqs, kv_cache_dtype, page=16, seed=4, layout="vllm"):
    """Paged caches holding each (new tokens, context length) sequence's whole context; the query rows."""
    torch.manual_seed(seed)
    pages = [-(-sl // page) for _, sl in seqs]
    k_shape, v_shape, cdt = ops_ref.kv_cache_shapes(sum(pages), page, HKV, D, torch.bfloat16, kv_cache_dtype,
                                                   layout)
    key_cache = torch.zeros(k_shape, dtype=cdt, device="cuda")
    value_cache = torch.zeros(v_shape, dtype=cdt, device="cuda")
    tables = torch.zeros(len(seqs), max(pages), dtype=torch.int32, device="cuda")
    perm = torch.randperm(sum(pages), device="cuda").int()
    start = 0
    for i, (_, sl) in enumerate(seqs):
        tables[i, :pages[i]] = perm[start:start + pages[i]]
        start += pages[i]
        pos = torch.arange(sl, device="cuda")
        slots = tables[i].long()[pos // page] * page + pos % page
        kv = torch.randn(2, sl, HKV, D, device="cuda", dtype=torch.bfloat16)
        ops_ref.reshape_and_cache(kv[0], kv[1], key_cache, value_cache, slots, kv_cache_dtype, 0.05, 0.05)
    q_lens = [q for q, _ in seqs]
    query = torch.randn(sum(q_lens), H, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    seq_lens = torch.tensor([sl for _, sl in seqs], device="cuda", dtype=torch.int32)
    return (query, key_cache, value_cache, HKV, D ** -0.5, tables, seq_lens, qsl, max(q_lens),
            max(sl for _, sl in seqs), None, kv_cache_dtype, 0.05, 0.05)


# a long prompt; a 4K chunk of a chunked prefill on a 12K cached prefix; a prefix-cache hit
_SEQS = [(16384, 16384), (4096, 16384), (6000, 8000)]


@pytest.mark.parametrize("layout", ops_ref.KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_paged_threshold_one_equals_paged_prefill(kv_cache_dtype, layout, sparse_backend):
    args = _paged(_SEQS, kv_cache_dtype, layout=layout)
    out, want = torch.empty_like(args[0]), torch.empty_like(args[0])
    xa.xattention_paged_prefill(out, *args, threshold=1.0)
    ops_ref.paged_prefill(want, *args)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("share_kv_heads,fp8_estimate", [(False, False), (True, False), (False, True)])
def test_paged_sparse_matches_dense_sparse(share_kv_heads, fp8_estimate, sparse_backend):
    """At threshold 0.9 the paged op equals block-sparse attention over the gathered K/V with the mask the
    estimate picks for them (with share_kv_heads, one mask for each kv head's query heads)."""
    args = _paged(_SEQS[1:], "auto", layout="hnd")
    query, tables, qsl = args[0], args[5], args[7].tolist()
    key_cache, value_cache = ops_ref.as_vllm_layout(args[1], args[2])
    out = torch.empty_like(query)
    xa.xattention_paged_prefill(out, *args, threshold=0.9, share_kv_heads=share_kv_heads, fp8_estimate=fp8_estimate)
    for i, (q_len, seq_len) in enumerate(_SEQS[1:]):
        k = ref.gather_sequence(key_cache, tables[i], seq_len, "auto", 1.0, torch.bfloat16, True)[None]
        v = ref.gather_sequence(value_cache, tables[i], seq_len, "auto", 1.0, torch.bfloat16, False)[None]
        q = query[qsl[i]:qsl[i + 1]].transpose(0, 1)[None]
        mask, density = xa.xattn_estimate(q, k, 128, 8, 0.9, share_kv_heads=share_kv_heads,
                                          fp8_estimate=fp8_estimate)
        assert float(density) < 1
        if share_kv_heads:
            group = mask.view(1, k.shape[1], -1, *mask.shape[2:])
            assert bool((group == group[:, :, :1]).all())
        want = ref.block_sparse_attention(q, k, v, mask)[0].transpose(0, 1)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seqs,stride", [([(8192, 32768)], 8), ([(16384, 16384)], 16), ([(4096, 12000)] * 2, 8)])
def test_paged_prefill_stays_within_its_workspace(seqs, stride):
    """The engine reserves prefill_workspace_bytes for the longest sequence next to the activations; a call
    holds no more (with fp8_estimate and share_kv_heads, the most copies), and several sequences one at a time."""
    args = _paged(seqs, "fp8")
    out = torch.empty_like(args[0])
    xa.xattention_paged_prefill(out, *args, threshold=0.9, stride=stride, share_kv_heads=True, fp8_estimate=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    xa.xattention_paged_prefill(out, *args, threshold=0.9, stride=stride, share_kv_heads=True, fp8_estimate=True)
    torch.cuda.synchronize()
    held = torch.cuda.max_memory_allocated() - base
    q_len, seq_len = max(seqs, key=lambda s: s[1])
    bound = xa.prefill_workspace_bytes(seq_len, q_len, H, HKV, D, 2, 128, stride)
    assert 0 < held <= bound, f"held {held} B, reserved {bound} B"
