"""XAttention ops: Triton kernels (CPU interpreter) against the PyTorch references, the references against
brute force / dense attention, and the paged prefill against ``pagedllm.ops.reference.paged_prefill``."""
import math

import pytest
import torch

from pagedllm import ops
from pagedllm.ops import reference as ops_ref
from pagedllm.ops import xattention as xa
from pagedllm.ops.xattention import reference as ref


@pytest.fixture(autouse=True)
def automatic_backend():
    yield
    ops.set_backend(None)


@pytest.fixture
def triton_backend():
    """Route the public ops to the Triton kernels (interpreted on CPU tensors, see conftest)."""
    ops.set_backend("triton")


def _randn(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


def _visible(q_len, k_len, causal):
    """[q_len, k_len] token-level causal visibility, queries being the last q_len positions."""
    if not causal:
        return torch.ones(q_len, k_len, dtype=torch.bool)
    return torch.arange(k_len)[None, :] <= (k_len - q_len + torch.arange(q_len))[:, None]


# ----------------------------------------------------------------------------------------------------
# The seed's two stages
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_flat_gemm_even_odd_example(backend):
    ops.set_backend(backend)
    q = torch.ones(1, 1, 512, 128, dtype=torch.float16)
    k = torch.ones(1, 1, 2048, 128, dtype=torch.float16)
    q[:, :, 1::2] = 2
    k[:, :, 1::2] = 2
    out = xa.flat_group_gemm_fuse_reshape(q, k, 4, 384, 512, is_causal=False)
    assert out.shape == (1, 1, 128, 512)
    assert torch.all(out == 1024)  # per antidiagonal pair 2*1 + 1*2, 2 pairs, 128 dims


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_softmax_block_sum_uniform_example(backend):
    ops.set_backend(backend)
    out = xa.softmax_fuse_block_sum(torch.ones(1, 1, 128, 512), 128, 128, 0, 128, 128, 1.0, is_causal=False)
    assert out.shape == (1, 1, 1, 4)
    assert torch.allclose(out, torch.full_like(out, 32.0))  # 128 rows x 128/512 of each row


def test_flat_gemm_reference_is_antidiagonal_sum():
    q, k = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 64, 16)
    full = q @ k.transpose(-1, -2)
    out = ref.flat_group_gemm_fuse_reshape(q, k, 4, 8, 16)
    anti = torch.stack([full[..., i::4, 3 - i::4] for i in range(4)]).sum(0)
    torch.testing.assert_close(out, anti, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_flat_gemm_triton_matches_reference(triton_backend, causal):
    torch.manual_seed(0)
    stride, q_len, k_len = 8, 256, 1024  # GQA: 4 query heads over 2 key heads
    q, k = _randn(2, 4, q_len, 64), _randn(2, 2, k_len, 64)
    chunk_start = (k_len - q_len) // stride
    out = xa.flat_group_gemm_fuse_reshape(q, k, stride, chunk_start, chunk_start + q_len // stride, causal)
    want = ref.flat_group_gemm_fuse_reshape(q, k, stride, chunk_start, chunk_start + q_len // stride, causal)
    vis = _visible(q_len // stride, k_len // stride, causal)
    torch.testing.assert_close(out[..., vis].float(), want[..., vis].float(), rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_block_sum_triton_matches_reference(triton_backend, causal):
    torch.manual_seed(1)
    rows, cols, rbs, chunk_start = 64, 192, 16, 128
    x = torch.randn(2, 3, rows, cols) * 20
    args = (rbs, 32, chunk_start, chunk_start + rows, 40, ref.estimate_scale(64, 8), causal)
    out = xa.softmax_fuse_block_sum(x, *args)
    want = ref.softmax_fuse_block_sum(x, *args)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert torch.all(out[:, :, 3] == 0)  # rows 48.. are past real_q_len = 40


# ----------------------------------------------------------------------------------------------------
# Estimation and selection
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_len,k_len,heads,stride,block,chunk,causal,head,batch,packed", [
    (512, 512, (2, 2), 8, 64, 16384, True, 64, 1, True),    # whole prompt, aligned
    (300, 700, (4, 2), 8, 64, 128, True, 64, 1, True),      # chunked prefill, unaligned start, GQA, several chunks
    (77, 333, (2, 1), 4, 32, 64, True, 64, 1, True),        # ragged everything
    (200, 333, (2, 2), 16, 128, 16384, False, 64, 1, True),
    (160, 480, (4, 2), 8, 64, 16384, True, 80, 1, True),    # head of 80: 16-wide head chunks
    (256, 512, (4, 2), 8, 64, 128, True, 64, 2, False),     # batched, aligned: read in place, no copy
    (96, 96, (2, 1), 8, 32, 16384, True, 72, 2, False),     # head of 72: padded to 80 channels
])
def test_block_sums_triton_match_reference(q_len, k_len, heads, stride, block, chunk, causal, head, batch, packed):
    from pagedllm.ops.xattention import estimate
    torch.manual_seed(2)
    if packed:  # queries as the engine passes them: a [tokens, heads, D] slice seen as [1, heads, tokens, D]
        q = _randn(q_len, heads[0], head).transpose(0, 1)[None]
    else:
        q = _randn(batch, heads[0], q_len, head)
    k = _randn(batch, heads[1], k_len, head)
    got, first = estimate.block_sums(q, k, block, stride, chunk, causal)
    want, first_ref = ref.block_sums(q, k, block, stride, chunk, causal)
    assert first == first_ref == (k_len - q_len) // block
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # every query block holds its count of real reshaped rows of probability mass
    rows = first * (block // stride) + torch.arange(want.shape[2] * (block // stride))
    real = ((rows * stride + stride - 1 >= k_len - q_len) & (rows * stride < k_len)).view(-1, block // stride)
    torch.testing.assert_close(want.sum(-1), real.sum(-1).float().expand_as(want.sum(-1)))


def _brute_force_select(sums, first, thresholds, causal):
    """Loop-based statement of the rule: sink and diagonal first, then the largest others until the
    kept mass reaches threshold x the row total."""
    b, h, q_blocks, k_blocks = sums.shape
    mask = torch.zeros(sums.shape, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            for j in range(q_blocks):
                row = [float(x) for x in sums[bi, hi, j]]
                last = first + j if causal else k_blocks - 1
                keep = {0, first + j}
                kept = sum(row[i] for i in keep)
                goal = float(thresholds[hi]) * sum(row)
                for i in sorted((i for i in range(last + 1) if i not in keep), key=lambda i: -row[i]):
                    if kept >= goal:
                        break
                    keep.add(i)
                    kept += row[i]
                for i in keep:
                    mask[bi, hi, j, i] = True
    return mask


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("causal", [True, False])
def test_selection_matches_brute_force(backend, causal):
    from pagedllm.ops.xattention import estimate
    select = ref.select_blocks if backend == "reference" else estimate.select_blocks
    torch.manual_seed(3)
    first, q_blocks, k_blocks = 3, 6, 9
    sums = torch.rand(2, 3, q_blocks, k_blocks) ** 4  # skewed, like real attention
    if causal:
        sums = sums * ref.visible_blocks(first, q_blocks, k_blocks, True, "cpu")
    thresholds = torch.tensor([0.5, 0.9, 0.97])
    mask, density = select(sums, first, thresholds, causal)
    want = _brute_force_select(sums, first, thresholds, causal)
    assert torch.equal(mask, want)
    visible = ref.visible_blocks(first, q_blocks, k_blocks, causal, "cpu")
    assert math.isclose(float(density), want.sum().item() / (visible.sum().item() * 6), rel_tol=1e-6)
    full, density = select(sums, first, 1.0, causal)
    assert torch.equal(full, visible.expand_as(full)) and float(density) == 1.0
    # equal masses join together: one 0.25 block reaches the goal, its twin comes along
    row = torch.tensor([[[[0.1, 0.25, 0.25, 0.2, 0.2]]]])
    assert select(row, 4, 0.5, causal)[0].tolist() == [[[[True, True, True, False, True]]]]
    assert select(row, 4, 0.3, causal)[0].tolist() == [[[[True, False, False, False, True]]]]


def test_estimate_triton_matches_reference(triton_backend):
    torch.manual_seed(4)
    q_len, k_len, block = 384, 640, 64
    # Low-rank keys with a few "heavy hitters" give the structured (non-uniform) scores real models show.
    k = _randn(1, 2, k_len, 64) * 0.5
    k[:, :, ::37] += 3 * _randn(1, 2, 1, 64)
    q = k[:, :, -q_len:].repeat_interleave(2, dim=1) + _randn(1, 4, q_len, 64) * 0.5
    thr = torch.tensor([0.6, 0.8, 0.9, 0.95])
    mask, density = xa.xattn_estimate(q, k, block, 8, thr, chunk_size=128)
    want, want_density = ref.xattn_estimate(q, k, block, 8, thr, chunk_size=128)
    assert torch.equal(mask, want) and torch.equal(density, want_density)
    first = (k_len - q_len) // block
    assert mask[..., 0].all() and mask[..., torch.arange(mask.shape[2]), first + torch.arange(mask.shape[2])].all()
    assert 0 < float(density) < 1


def test_fp8_rows_round_each_reshaped_row_to_e4m3():
    torch.manual_seed(9)
    x = _randn(1, 2, 37, 48) * torch.tensor([0.01, 40.0])[None, :, None, None]  # small and large heads
    x[0, 0, 5:13] = 0  # an all-zero reshaped row (tokens 5..12 after 3 of padding; scale 1)
    got = ref.fp8_rows(x, 3, 8)
    rows = torch.nn.functional.pad(x.float(), (0, 0, 3, 0)).view(1, 2, 5, 384)
    scale = rows.abs().amax(-1, keepdim=True) * (1.0 / ref.FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    got_rows = torch.nn.functional.pad(got, (0, 0, 3, 0)).view(1, 2, 5, 384)
    # already on the e4m3 grid of its row's scale, the row's largest magnitude kept, every value within half a step
    assert torch.equal((got_rows / scale).to(torch.float8_e4m3fn).float() * scale, got_rows)
    torch.testing.assert_close(got_rows.abs().amax(-1), rows.abs().amax(-1))
    half_subnormal = rows.abs().amax(-1).repeat_interleave(8, -1)[..., 3:, None] / ref.FP8_MAX * 2 ** -10
    assert ((got - x.float()).abs() <= x.float().abs() / 16 + half_subnormal).all()
    assert torch.equal(got[0, 0, 5:13], torch.zeros(8, 48)) and not torch.equal(got, x.float())


@pytest.mark.parametrize("q_len,k_len,heads,stride,block,chunk,head,packed", [
    (512, 512, (2, 2), 8, 64, 16384, 64, True),
    (300, 700, (4, 2), 8, 64, 128, 64, True),   # chunked prefill, unaligned start, GQA, several chunks
    (77, 333, (2, 1), 4, 32, 64, 64, True),     # ragged everything
    (96, 96, (2, 1), 16, 32, 16384, 72, False),  # head of 72: padded to 96 channels
])
def test_fp8_block_sums_triton_match_reference(q_len, k_len, heads, stride, block, chunk, head, packed):
    from pagedllm.ops.xattention import estimate
    torch.manual_seed(3)
    if packed:
        q = (_randn(q_len, heads[0], head) * 4).transpose(0, 1)[None]
    else:
        q = _randn(2, heads[0], q_len, head) * 4
    k = _randn(q.shape[0], heads[1], k_len, head)
    front = (k_len - q_len) % stride
    for x, lead in ((q, front), (k, 0)):  # the kernel's tokens and scales are the reference's rounding
        tokens, scales = estimate._fp8_tokens(x, lead, stride)
        deq = tokens.float().view(*scales.shape, -1) * scales[..., None]
        assert torch.equal(deq.view(*x.shape[:2], -1, tokens.shape[-1])[:, :, lead:lead + x.shape[2], :head],
                           ref.fp8_rows(x, lead, stride))
    got, first = estimate.block_sums(q, k, block, stride, chunk, True, fp8_estimate=True)
    want, _ = ref.block_sums(q, k, block, stride, chunk, True, fp8_estimate=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(want, ref.block_sums(q, k, block, stride, chunk, True)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_shared_selection_is_one_per_kv_head(backend):
    """share_kv_heads: each kv head's query heads select together, from their block sums added up (with per-head
    thresholds, each head applies its own to the group's sums)."""
    ops.set_backend(backend)
    torch.manual_seed(5)
    q_len, k_len, block = 256, 448, 64
    # each block of keys along a direction of its own, each query head drawn to one of them: the heads of a group
    # disagree, so their own selections differ from the group's
    u = torch.nn.functional.normalize(torch.randn(7, 64), dim=-1)
    k = (0.3 * torch.randn(1, 2, k_len, 64) + 6 * u[torch.arange(k_len) // block]).half()
    q = (0.3 * torch.randn(1, 6, q_len, 64) + 6 * u[[1, 2, 3, 4, 5, 1]][None, :, None, :]).half()
    mask, density = xa.xattn_estimate(q, k, block, 8, 0.9, chunk_size=128, share_kv_heads=True)
    sums, first = ref.block_sums(q, k, block, 8, 128, True)
    grouped = sums.view(1, 2, 3, *sums.shape[2:]).sum(2)
    want = _brute_force_select(grouped, first, torch.full((2,), 0.9), True).repeat_interleave(3, dim=1)
    assert torch.equal(mask, want)
    per_head, per_head_density = xa.xattn_estimate(q, k, block, 8, 0.9, chunk_size=128)
    assert not torch.equal(mask, per_head) and float(per_head_density) < float(density) < 1
    thr = torch.tensor([0.5, 0.9, 0.97, 0.6, 0.8, 0.99])
    mask, _ = xa.xattn_estimate(q, k, block, 8, thr, chunk_size=128, share_kv_heads=True)
    assert torch.equal(mask, _brute_force_select(grouped.repeat_interleave(3, dim=1), first, thr, True))


# ----------------------------------------------------------------------------------------------------
# Block-sparse attention
# ----------------------------------------------------------------------------------------------------
def _random_mask(b, h, q_len, k_len, block, density, causal, seed):
    """Random block mask keeping the sink and the diagonal."""
    g = torch.Generator().manual_seed(seed)
    first, q_blocks, k_blocks = ref.block_layout(q_len, k_len, block)
    mask = torch.rand(b, h, q_blocks, k_blocks, generator=g) < density
    mask[..., 0] = True
    mask[..., torch.arange(q_blocks), first + torch.arange(q_blocks)] = True
    return mask


@pytest.mark.parametrize("q_len,k_len,heads,head,block,causal,dtype", [
    (256, 256, (4, 2), 64, 64, True, torch.float16),
    (200, 456, (2, 1), 64, 32, True, torch.float32),   # unaligned query start and end
    (100, 300, (2, 2), 64, 64, False, torch.float16),
    (128, 192, (2, 1), 80, 32, True, torch.float16),   # head size padded to a power of two: masked loads
])
def test_block_sparse_attention_triton_matches_reference(triton_backend, q_len, k_len, heads, head, block, causal,
                                                         dtype):
    torch.manual_seed(5)
    q = _randn(2, heads[0], q_len, head, dtype=dtype)
    k, v = _randn(2, heads[1], k_len, head, dtype=dtype), _randn(2, heads[1], k_len, head, dtype=dtype)
    mask = _random_mask(2, heads[0], q_len, k_len, block, 0.4, causal, seed=q_len)
    mask[0, 0, 1] = False  # a query block that sees no key at all gives zeros
    out = xa.block_sparse_attention(q, k, v, mask, block, causal)
    want = ref.block_sparse_attention(q, k, v, mask, block, causal)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)


def test_block_sparse_attention_triton_takes_strided_and_unaligned_views(triton_backend):
    """Views TMA cannot read in place (rows of 68 halves: 136-byte strides) are copied; a [B, L, H, D] tensor
    seen as [B, H, L, D] is read in place. Both give the reference's output."""
    torch.manual_seed(6)
    q = _randn(2, 4, 192, 68)[..., :64]
    k = _randn(2, 192, 2, 64).transpose(1, 2)
    v = _randn(2, 2, 192, 64)
    mask = _random_mask(2, 4, 192, 192, 64, 0.6, True, seed=6)
    got = xa.block_sparse_attention(q, k, v, mask, 64)
    want = ref.block_sparse_attention(q.float(), k.float(), v.float(), mask, 64)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


def test_block_sparse_attention_triton_rejects_nonpositive_scale(triton_backend):
    # the kernel applies the scale after the row max, which only a positive scale commutes with
    q, k = torch.randn(1, 2, 64, 32), torch.randn(1, 1, 64, 32)
    mask = torch.ones(1, 2, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="positive"):
        xa.block_sparse_attention(q, k, k, mask, 32, scale=-0.1)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("causal", [True, False])
def test_full_mask_equals_dense_attention(backend, causal):
    ops.set_backend(backend)
    torch.manual_seed(6)
    q_len, k_len, block = 150, 400, 64
    q = torch.randn(1, 4, q_len, 32)
    k, v = torch.randn(1, 2, k_len, 32), torch.randn(1, 2, k_len, 32)
    first, q_blocks, k_blocks = ref.block_layout(q_len, k_len, block)
    mask = torch.ones(1, 4, q_blocks, k_blocks, dtype=torch.bool)
    out = xa.block_sparse_attention(q, k, v, mask, block, causal, scale=0.2)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=_visible(q_len, k_len, causal),
        scale=0.2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Paged prefill
# ----------------------------------------------------------------------------------------------------
def _paged_case(seqs, num_heads, num_kv_heads, head_size, page, kv_cache_dtype, dtype, seed, layout="vllm"):
    """Caches holding each sequence's whole context (scattered over shuffled blocks) and the query rows of
    its new tokens. ``seqs`` lists (new tokens, context length incl. new tokens)."""
    torch.manual_seed(seed)
    pages = [-(-sl // page) for _, sl in seqs]
    num_blocks = sum(pages) + 3
    k_shape, v_shape, cache_dtype = ops_ref.kv_cache_shapes(num_blocks, page, num_kv_heads, head_size, dtype,
                                                            kv_cache_dtype, layout)
    # unwritten slots hold NaN (0x7F is NaN in e4m3 too): the kernels must never let them leak in
    nan = 0x7F if cache_dtype == torch.uint8 else float("nan")
    key_cache, value_cache = torch.full(k_shape, nan, dtype=cache_dtype), torch.full(v_shape, nan, dtype=cache_dtype)
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[start:start + n]
        start += n
        sl = seqs[i][1]
        slots = (tables[i].long()[torch.arange(sl) // page] * page + torch.arange(sl) % page)
        key, value = torch.randn(sl, num_kv_heads, head_size).to(dtype), torch.randn(sl, num_kv_heads, head_size)
        ops_ref.reshape_and_cache(key, value.to(dtype), key_cache, value_cache, slots, kv_cache_dtype, 0.5, 0.5)
    q_lens = [q for q, _ in seqs]
    query = torch.randn(sum(q_lens), num_heads, head_size).to(dtype)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([sl for _, sl in seqs], dtype=torch.int32)
    args = (query, key_cache, value_cache, num_kv_heads, head_size ** -0.5, tables, seq_lens, qsl, max(q_lens),
            int(seq_lens.max()), None, kv_cache_dtype, 0.5, 0.5)
    return args


# plain prompt; chunked prefill (a chunk on a cached prefix, unaligned); prefix-cache hit; tiny prompt
_SEQS = [(300, 300), (120, 520), (200, 264), (5, 5)]


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("auto", torch.float16), ("fp8", torch.float16),
                                                  ("auto", torch.float32)])
@pytest.mark.parametrize("backend,layout", [("reference", "vllm"), ("triton", "vllm"), ("triton", "hnd")])
def test_paged_threshold_one_equals_paged_prefill(backend, layout, kv_cache_dtype, dtype):
    ops.set_backend(backend)
    args = _paged_case(_SEQS, 4, 2, 64, 16, kv_cache_dtype, dtype, seed=7, layout=layout)
    out, want = torch.zeros_like(args[0]), torch.zeros_like(args[0])
    xa.xattention_paged_prefill(out, *args, threshold=1.0, stride=8, block_size=64)
    ops_ref.paged_prefill(want, *args)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout,share_kv_heads,fp8_estimate", [(layout, False, False)
                                                                for layout in ops_ref.KV_CACHE_LAYOUTS] +
                         [("vllm", True, False), ("hnd", False, True)])
def test_paged_triton_matches_reference(triton_backend, layout, share_kv_heads, fp8_estimate):
    args = _paged_case([(256, 256), (130, 400)], 4, 1, 64, 16, "auto", torch.float16, seed=8, layout=layout)
    out, want = torch.zeros_like(args[0]), torch.zeros_like(args[0])
    thr = torch.tensor([0.5, 0.7, 0.8, 0.9])
    options = dict(threshold=thr, stride=4, block_size=32, share_kv_heads=share_kv_heads, fp8_estimate=fp8_estimate)
    xa.xattention_paged_prefill(out, *args, **options)
    ref.xattention_paged_prefill(want, *args, **options)
    if share_kv_heads:  # the shared selection is not the per-head one
        per_head = torch.zeros_like(out)
        ref.xattention_paged_prefill(per_head, *args, **dict(options, share_kv_heads=False))
        assert (want - per_head).abs().max() > 1e-2
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    dense = torch.zeros_like(out)
    ops_ref.paged_prefill(dense, *args)
    assert (out - dense).abs().max() > 1e-2  # blocks were really skipped


def test_paged_rejects_alibi():
    args = list(_paged_case([(16, 16)], 2, 2, 32, 16, "auto", torch.float32, seed=9))
    args[10] = torch.ones(2)
    with pytest.raises(ValueError, match="ALiBi"):
        xa.xattention_paged_prefill(torch.zeros_like(args[0]), *args)
