"""pagedllm's CUDA C++ ops against the reference ops (pagedllm.ops.reference) on the GPU.

Every case writes its tokens into NaN-poisoned caches (unwritten slots and unused blocks hold NaN;
block-table entries past a sequence's end point far outside the cache) and NaN-poisoned outputs, so a
kernel that reads a slot it must not read, or leaves an output unwritten, fails.
"""
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from pagedllm.ops import cuda as cuda_ops  # noqa: E402
from pagedllm.ops import reference as ref  # noqa: E402

HEAD_SIZES = (64, 80, 96, 112, 128, 256)
BLOCK_SIZES = (8, 16, 32)
DTYPES = (torch.bfloat16, torch.float16)
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # relative to the reference's largest |output|
BAD_BLOCK = 1 << 30  # block-table filler past a sequence's last block: reading it faults


@pytest.fixture(scope="module", autouse=True)
def _library():
    cuda_ops.load()


class Case:
    """Paged caches holding random K/V for `lens` tokens of each sequence, and a random query."""

    def __init__(self, lens, num_heads, num_kv_heads, head_size, block_size, dtype, kv_cache_dtype="auto",
                 alibi=False, seed=0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        rng = random.Random(seed)
        dev = "cuda"
        self.lens, self.num_kv_heads, self.block_size = list(lens), num_kv_heads, block_size
        self.kv_cache_dtype, self.dtype = kv_cache_dtype, dtype
        fp8 = kv_cache_dtype != "auto"
        self.k_scale = torch.tensor([0.05 if fp8 else 1.0], device=dev)
        self.v_scale = torch.tensor([0.04 if fp8 else 1.0], device=dev)
        blocks = [-(-n // block_size) for n in lens]
        num_blocks = sum(blocks) + 3
        k_shape, v_shape, cache_dtype = ref.kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_size,
                                                            dtype, kv_cache_dtype)
        self.key_cache = _poisoned(k_shape, cache_dtype)
        self.value_cache = _poisoned(v_shape, cache_dtype)
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        table = torch.full((len(lens), max(blocks, default=0) + 2), BAD_BLOCK, dtype=torch.int32)
        slots = []
        for i, n in enumerate(lens):
            row, ids = ids[:blocks[i]], ids[blocks[i]:]
            table[i, :blocks[i]] = torch.tensor(row, dtype=torch.int32)
            slots += [row[t // block_size] * block_size + t % block_size for t in range(n)]
        self.block_tables = table.to(dev)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.max_seq_len = max(lens, default=0)
        slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        kv = torch.randn((2, len(slots), num_kv_heads, head_size), generator=gen, device=dev).to(dtype)
        ref.reshape_and_cache(kv[0], kv[1], self.key_cache, self.value_cache, slots_t, kv_cache_dtype,
                              self.k_scale, self.v_scale)
        self.query = torch.randn((len(lens), num_heads, head_size), generator=gen, device=dev).to(dtype)
        self.scale = head_size ** -0.5
        self.alibi = (torch.rand(num_heads, generator=gen, device=dev) * -0.1 if alibi else None)

    def args(self):
        """The decode ops' arguments after (out, ...), up to v_scale."""
        return (self.query, self.key_cache, self.value_cache, self.num_kv_heads, self.scale,
                self.block_tables, self.seq_lens, self.block_size, self.max_seq_len, self.alibi,
                self.kv_cache_dtype, self.k_scale, self.v_scale)

    def out(self):
        return torch.full_like(self.query, float("nan"))

    def v2_workspace(self, tmp_dtype=None):
        n, h, d = self.query.shape
        parts = max(1, -(-self.max_seq_len // ref.PARTITION_SIZE))
        stats = torch.full((2, n, h, parts), float("nan"), device="cuda")
        tmp = torch.full((n, h, parts, d), float("nan"), device="cuda", dtype=tmp_dtype or self.dtype)
        return stats[0], stats[1], tmp


def _poisoned(shape, dtype):
    if dtype == torch.uint8:
        return torch.full(shape, 0xFF, dtype=torch.uint8, device="cuda")  # NaN in e4m3 and e5m2
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _assert_close(out, expected, dtype, what=""):
    assert torch.isfinite(out).all(), f"{what}: non-finite outputs (unwritten or NaN read)"
    err = (out.float() - expected.float()).abs().max().item()
    bound = TOL[dtype] * max(expected.float().abs().max().item(), 1e-3)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def _reference(case, sparse=(0, 0, 0, 64, 0)):
    out = torch.empty_like(case.query)
    ref.paged_attention_v1(out, *case.args(), *sparse)
    return out


def _run_all_paths(case, sparse=(0, 0, 0, 64, 0)):
    """Output of v1, v2, the engine's decode and an explicit split, each checked against the reference."""
    expected = _reference(case, sparse)
    out = case.out()
    cuda_ops.paged_attention_v1(out, *case.args(), *sparse)
    _assert_close(out, expected, case.dtype, "v1")
    out = case.out()
    cuda_ops.paged_attention_v2(out, *case.v2_workspace(), *case.args(), *sparse)
    _assert_close(out, expected, case.dtype, "v2")
    if sparse[2] <= 1:  # the engine's decode and the split op take no block-sparse arguments
        out = case.out()
        cuda_ops.paged_attention(out, *case.args())
        _assert_close(out, expected, case.dtype, "paged_attention")
        out = case.out()
        cuda_ops.paged_attention_split(out, *case.args(), 64)
        _assert_close(out, expected, case.dtype, "split(64)")


def _ragged(seed, max_len, n=5):
    rng = random.Random(seed)
    return [rng.randint(1, max_len) for _ in range(n - 2)] + [1, max_len]


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_grid(head_size, block_size, dtype):
    group = (1, 4, 8)[(head_size // 16 + block_size) % 3]
    case = Case(_ragged(head_size + block_size, 1200), 2 * group, 2, head_size, block_size, dtype, seed=head_size)
    _run_all_paths(case)


@pytest.mark.parametrize("kv_cache_dtype", FP8)
@pytest.mark.parametrize("head_size,block_size", [(64, 8), (80, 16), (96, 32), (112, 8), (128, 16), (256, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_fp8(kv_cache_dtype, head_size, block_size, dtype):
    case = Case(_ragged(head_size, 900), 8, 2, head_size, block_size, dtype, kv_cache_dtype, seed=block_size)
    _run_all_paths(case)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 2), (32, 4), (32, 2), (12, 1)])
@pytest.mark.parametrize("alibi", [False, True])
def test_decode_gqa_and_alibi(num_heads, num_kv_heads, alibi):
    case = Case(_ragged(num_heads, 2000), num_heads, num_kv_heads, 128, 16, torch.bfloat16, alibi=alibi,
                seed=num_heads * 7 + num_kv_heads)
    _run_all_paths(case)


@pytest.mark.parametrize("sparse", [(0, 2, 4, 64, 1), (1, 1, 3, 32, -1), (0, 0, 2, 16, 0), (1, 4, 8, 64, 2),
                                    (0, 1, 5, 16, -2)])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_blocksparse(sparse, block_size):
    case = Case(_ragged(block_size, 3000), 16, 4, 128, block_size, torch.float16, seed=sum(sparse))
    _run_all_paths(case, sparse)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (32, 4), (16, 16)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_decode_long_context(num_heads, num_kv_heads, kv_cache_dtype):
    case = Case([32768, 17001, 5, 9000], num_heads, num_kv_heads, 128, 16, torch.bfloat16, kv_cache_dtype,
                seed=num_kv_heads)
    _run_all_paths(case)


def test_decode_empty_sequences():
    case = Case([0, 37, 0], 8, 2, 64, 16, torch.float16)
    _run_all_paths(case)


@pytest.mark.parametrize("tmp_dtype", [None, torch.float32])
def test_v2_partials_match_reference(tmp_dtype):
    case = Case([1500, 512, 3, 1025], 8, 2, 128, 16, torch.bfloat16, alibi=True, seed=3)
    exp_sums, max_logits, tmp_out = case.v2_workspace(tmp_dtype)
    out = case.out()
    cuda_ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, *case.args())
    r_sums, r_max, r_tmp = (torch.empty_like(t) for t in (exp_sums, max_logits, tmp_out))
    r_out = torch.empty_like(out)
    ref.paged_attention_v2(r_out, r_sums, r_max, r_tmp, *case.args())
    _assert_close(out, r_out, case.dtype, "v2 out")
    for i, n in enumerate(case.lens):  # only partitions holding tokens are defined
        p = max(1, -(-n // ref.PARTITION_SIZE))
        torch.testing.assert_close(max_logits[i, :, :p], r_max[i, :, :p], atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(exp_sums[i, :, :p], r_sums[i, :, :p], atol=1e-2, rtol=2e-2)
        _assert_close(tmp_out[i, :, :p], r_tmp[i, :, :p], case.dtype, f"tmp_out of sequence {i}")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", *FP8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,block_size", [(64, 8), (80, 16), (128, 32), (256, 16)])
def test_reshape_and_cache_bitwise(kv_cache_dtype, dtype, head_size, block_size):
    gen = torch.Generator(device="cuda").manual_seed(head_size)
    num_kv_heads, num_blocks, num_tokens = 3, 9, 40
    k_shape, v_shape, cache_dtype = ref.kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_size, dtype,
                                                        kv_cache_dtype)
    qkv = torch.randn((num_tokens, 3, num_kv_heads, head_size), generator=gen, device="cuda").to(dtype) * 3
    key, value = qkv[:, 1], qkv[:, 2]  # strided views, as the engine's split of a fused qkv
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens - 4]
    slots[::5] = -1  # skipped; the last 4 tokens have no slot at all (CUDA-graph padding)
    scales = torch.tensor([0.07], device="cuda"), torch.tensor([0.03], device="cuda")
    caches = [(_poisoned(k_shape, cache_dtype), _poisoned(v_shape, cache_dtype)) for _ in range(2)]
    ref.reshape_and_cache(key, value, *caches[0], slots, kv_cache_dtype, *scales)
    cuda_ops.reshape_and_cache(key, value, *caches[1], slots, kv_cache_dtype, *scales)
    for expected, got in zip(caches[0], caches[1]):
        assert torch.equal(expected.view(torch.uint8), got.view(torch.uint8))


def test_float_scales_and_float8_tensors():
    case = Case([300, 40], 8, 2, 128, 16, torch.float16, "fp8_e5m2")
    expected = _reference(case)
    args = list(case.args())
    args[1], args[2] = case.key_cache.view(torch.float8_e5m2), case.value_cache.view(torch.float8_e5m2)
    args[-2], args[-1] = 0.05, 0.04  # the same scales as Python floats
    out = case.out()
    cuda_ops.paged_attention_v1(out, *args)
    _assert_close(out, expected, case.dtype, "float scales")


def test_bad_arguments_raise():
    case = Case([20], 4, 4, 48, 16, torch.float16)
    with pytest.raises(RuntimeError, match="unsupported head_size 48"):
        cuda_ops.paged_attention_v1(case.out(), *case.args())
    case = Case([20], 4, 4, 64, 16, torch.float16)
    args = list(case.args())
    args[7] = 8
    with pytest.raises(RuntimeError, match="block_size 8 differs from the cache's 16"):
        cuda_ops.paged_attention_v1(case.out(), *args)
    args = list(case.args())
    args[0] = case.query.float()
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        cuda_ops.paged_attention_v1(case.out().float(), *args)


def test_opcheck():
    case = Case([70, 530], 8, 2, 64, 16, torch.bfloat16, alibi=True)
    ops = torch.ops.pagedllm
    torch.library.opcheck(ops.paged_attention_v1, (case.out().zero_(), *case.args(), 0, 0, 0, 64, 0))
    torch.library.opcheck(ops.paged_attention_v2,
                          (case.out().zero_(), *(t.zero_() for t in case.v2_workspace()), *case.args(),
                           0, 0, 0, 64, 0))
    ws = case.v2_workspace(torch.float32)
    torch.library.opcheck(ops.paged_attention_split, (case.out().zero_(), *(t.zero_() for t in ws),
                                                      *case.args(), 512))
    key = torch.randn((5, 2, 64), device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 17, 40, 41], device="cuda")
    kc, vc = case.key_cache.clone().zero_(), case.value_cache.clone().zero_()
    torch.library.opcheck(ops.reshape_and_cache, (key, key * 2, kc, vc, slots, "auto", case.k_scale,
                                                  case.v_scale))


def test_torch_compile_graph():
    case = Case([100, 1000], 8, 2, 128, 16, torch.float16)
    expected = _reference(case)

    @torch.compile(fullgraph=True)
    def decode(out, *args):
        torch.ops.pagedllm.paged_attention_v1(out, *args, 0, 0, 0, 64, 0)
        return out * 1

    _assert_close(decode(case.out(), *case.args()), expected, case.dtype, "torch.compile")


def test_prefill_uses_triton():
    pytest.importorskip("triton")
    case = Case([64, 200], 8, 2, 64, 16, torch.float16)
    q_lens = [64, 9]
    query = torch.randn((sum(q_lens), 8, 64), device="cuda", dtype=torch.float16)
    qsl = torch.tensor([0, 64, 73], dtype=torch.int32, device="cuda")
    args = (query, case.key_cache, case.value_cache, 2, case.scale, case.block_tables, case.seq_lens, qsl,
            max(q_lens), case.max_seq_len, None, "auto", case.k_scale, case.v_scale)
    expected, out = torch.empty_like(query), torch.full_like(query, float("nan"))
    ref.paged_prefill(expected, *args)
    cuda_ops.paged_prefill(out, *args)
    _assert_close(out, expected, torch.float16, "prefill")

