"""The fused Triton kernels on CUDA at real sizes against the layers' PyTorch code on CUDA (bf16, fp16, fp32),
inside a CUDA graph, and in the whole engine: greedy tokens with the kernels equal those without (fp32,
random-weight Qwen3-0.6B- and Llama-shaped models, CUDA graphs and eager). Skipped as a whole without CUDA."""
import functools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm.layers.activation import SiluAndMul  # noqa: E402
from pagedllm.layers.norm import FUSED_ENV_VAR, RMSNorm, fused_kernels, set_fused  # noqa: E402
from pagedllm.layers.rotary import RotaryEmbedding  # noqa: E402
from pagedllm.ops.triton import fused  # noqa: E402
from test_engine_gpu import hf_model_dir, ours  # noqa: E402,F401  (hf_model_dir is a fixture)

DEV = "cuda"
HALF = [torch.bfloat16, torch.float16]
TOKENS = [1, 7, 256, 8192]
# hidden size -> intermediate size (Qwen3-0.6B, Llama 3 8B)
SIZES = {1024: 3072, 4096: 14336}
# (heads, kv heads, head size): Qwen3-0.6B, Llama 3 8B, an 80-dim head
ROPE_SHAPES = [(16, 8, 128), (32, 8, 128), (12, 4, 80)]
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@pytest.fixture
def unfused():
    """Runs the body with the layers on their PyTorch code: the oracle, on the same device."""
    set_fused(False)
    yield
    set_fused(None)


def assert_ulps(out, ref, ulps, of_largest=False):
    """Within `ulps` units in the last place of each element of ref (of_largest: of its largest element)."""
    info = torch.finfo(ref.dtype)
    atol = ulps * info.eps * ref.abs().max().item() if of_largest else info.tiny
    torch.testing.assert_close(out, ref, rtol=ulps * info.eps, atol=atol)


@functools.cache
def _rope(head_size, max_position):
    return RotaryEmbedding(head_size, max_position, 500000.0, LLAMA3_SCALING).to(DEV)


def _norm_layer(size, dtype, gen):
    layer = RMSNorm(size, eps=1e-6).to(DEV, dtype)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.3 * torch.randn(size, generator=gen, device=DEV))
    return layer


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", sorted(SIZES))
@torch.inference_mode()
def test_rms_norm(dtype, tokens, hidden, unfused):
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    layer = _norm_layer(hidden, dtype, gen)
    x = (3 * torch.randn(tokens, hidden, generator=gen, device=DEV)).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen, device=DEV).to(dtype)
    assert_ulps(fused.rms_norm(x, layer.weight, layer.eps), layer(x), 2)
    out, new_residual = fused.rms_norm(x, layer.weight, layer.eps, residual)
    ref_out, ref_residual = layer(x, residual)
    assert torch.equal(new_residual, ref_residual)
    assert_ulps(out, ref_out, 2)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", sorted(SIZES))
@torch.inference_mode()
def test_silu_and_mul(dtype, tokens, hidden, unfused):
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    x = (4 * torch.randn(tokens, 2 * SIZES[hidden], generator=gen, device=DEV)).to(dtype)
    assert_ulps(fused.silu_and_mul(x), SiluAndMul()(x), 2)


@pytest.mark.parametrize("dtype", HALF + [torch.float32])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qk_norm", [False, True])
@torch.inference_mode()
def test_rotary_embedding(dtype, tokens, shape, qk_norm, unfused):
    heads, kv_heads, head_size = shape
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    rope = _rope(head_size, 131072)
    norms = (_norm_layer(head_size, dtype, gen), _norm_layer(head_size, dtype, gen)) if qk_norm else None
    positions = torch.randint(0, 131072, (tokens,), generator=gen, device=DEV)
    q_size, kv_size = heads * head_size, kv_heads * head_size
    qkv = (2 * torch.randn(tokens, q_size + 2 * kv_size, generator=gen, device=DEV)).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    v_before = v.clone()
    ref_q, ref_k = rope(positions, q, k, norms)
    norm_args = (norms[0].weight, norms[1].weight, norms[0].eps) if qk_norm else None
    fused.rotary_embedding(positions, q, k, head_size, rope.cos_sin_cache, norm_args)
    assert torch.equal(v, v_before)
    if qk_norm:
        ulps = 64 if dtype == torch.float32 else 4
        assert_ulps(q, ref_q, ulps, of_largest=True)
        assert_ulps(k, ref_k, ulps, of_largest=True)
    else:  # products and sums rounded at the same points as PyTorch's separate kernels: identical bits
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("layout", ["vllm", "hnd"])
@pytest.mark.parametrize("kv_cache_dtype,scales", [("auto", (1.0, 1.0)), ("fp8_e4m3", (0.02, 0.01)),
                                                   ("fp8_e5m2", "tensor")])
@pytest.mark.parametrize("tokens", [1, 7, 8192])
@torch.inference_mode()
def test_rope_and_cache_equals_rope_then_cache_write(layout, kv_cache_dtype, scales, tokens):
    """Qwen3's shape in bf16: the fused RoPE + cache write gives q and the caches bit for bit as the two
    kernels it replaces, padding tokens (slot -1, or past the slot mapping) skipped."""
    from pagedllm.ops import reference
    from pagedllm.ops import triton as triton_ops
    heads, kv_heads, head_size, block_size = 16, 8, 128, 16
    dtype = torch.bfloat16
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    rope = _rope(head_size, 40960)
    norms = (_norm_layer(head_size, dtype, gen), _norm_layer(head_size, dtype, gen))
    norm_args = (norms[0].weight, norms[1].weight, norms[0].eps)
    positions = torch.randint(0, 40960, (tokens,), generator=gen, device=DEV)
    num_blocks = tokens // block_size + 4
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEV)[:max(tokens - 1, 1)]
    slots[0] = -1
    if scales == "tensor":
        scales = (torch.tensor([0.03], device=DEV), torch.tensor([0.02], device=DEV))
    kshape, vshape, cdtype = reference.kv_cache_shapes(num_blocks, block_size, kv_heads, head_size, dtype,
                                                       kv_cache_dtype, layout)
    q_size, kv_size = heads * head_size, kv_heads * head_size
    qkv = (2 * torch.randn(tokens, q_size + 2 * kv_size, generator=gen, device=DEV)).to(dtype)
    results = []
    for fuse in (False, True):
        caches = [torch.zeros(shape, dtype=cdtype, device=DEV) for shape in (kshape, vshape)]
        x = qkv.clone()
        q, k, v = x.split([q_size, kv_size, kv_size], dim=-1)
        if fuse:
            fused.rope_and_cache(positions, q, k, v, head_size, rope.cos_sin_cache, norm_args, *caches, slots,
                                 kv_cache_dtype, *scales)
        else:
            fused.rotary_embedding(positions, q, k, head_size, rope.cos_sin_cache, norm_args)
            triton_ops.reshape_and_cache(k.view(tokens, kv_heads, head_size), v.view(tokens, kv_heads, head_size),
                                         *caches, slots, kv_cache_dtype, *scales)
        results.append((x, caches))
    (unfused, unfused_caches), (fused_x, fused_caches) = results
    assert torch.equal(fused_x[:, :q_size], unfused[:, :q_size])
    assert torch.equal(fused_x[:, q_size:], qkv[:, q_size:])
    for a, b in zip(fused_caches, unfused_caches):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", HALF + [torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 256])
@torch.inference_mode()
def test_argmax_equals_torch(dtype, rows):
    """The greedy sampler's argmax on Qwen3's vocabulary: the first of equal maxima, as torch.argmax."""
    gen = torch.Generator(device=DEV).manual_seed(rows)
    logits = torch.randn(rows, 151936, generator=gen, device=DEV).to(dtype)
    logits[0, 5] = logits[0, 150000] = 50.0  # tied across chunks
    logits[-1, 9000:9003] = 60.0  # tied within a chunk
    assert torch.equal(fused.argmax(logits), logits.argmax(dim=-1))


@torch.inference_mode()
def test_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs: no host sync, no allocation that depends on the data."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    dtype, tokens, hidden, heads, kv_heads, head_size = torch.bfloat16, 64, 1024, 16, 8, 128
    norm, q_norm, k_norm = (_norm_layer(n, dtype, gen) for n in (hidden, head_size, head_size))
    rope = _rope(head_size, 4096)
    x = torch.empty(tokens, hidden, device=DEV, dtype=dtype)
    residual = torch.empty_like(x)
    gate_up = torch.empty(tokens, 2 * 3072, device=DEV, dtype=dtype)
    qk = torch.empty(tokens, (heads + kv_heads) * head_size, device=DEV, dtype=dtype)
    positions = torch.empty(tokens, device=DEV, dtype=torch.int64)
    norm_args = (q_norm.weight, k_norm.weight, q_norm.eps)

    down = torch.empty(hidden, 3072, device=DEV, dtype=dtype)

    def step():
        out, res = fused.rms_norm(x, norm.weight, norm.eps, residual)
        q, k = qk.split([heads * head_size, kv_heads * head_size], dim=-1)
        fused.rotary_embedding(positions, q, k, head_size, rope.cos_sin_cache, norm_args)
        act = fused.silu_and_mul(gate_up)
        down_out = fused.rms_norm_split_k(fused.split_k_linear(act, down), norm.weight, norm.eps, res)
        return out, res, act, fused.argmax(gate_up), *down_out

    def fill(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        for t in (x, residual, gate_up, qk, down):
            t.copy_(torch.randn(t.shape, generator=g, device=DEV))
        positions.copy_(torch.randint(0, 4096, (tokens,), generator=g, device=DEV))

    fill(1)
    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (2, 3):
        fill(seed)
        qk_in = qk.clone()
        graph.replay()
        replayed = [t.clone() for t in captured] + [qk.clone()]
        fill(seed)
        assert torch.equal(qk, qk_in)
        eager = list(step()) + [qk]
        assert all(torch.equal(a, b) for a, b in zip(replayed, eager))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [1, 7, 32, 33])
@pytest.mark.parametrize("vocab,hidden", [(151936, 1024), (128256, 4096)])  # Qwen3-0.6B's head, Llama 3 8B's
@torch.inference_mode()
def test_lm_head_of_few_rows_equals_cublas(dtype, rows, vocab, hidden):
    """compute_logits on the fused path: up to MAX_HEAD_ROWS rows take head_linear, whose logits are cuBLAS's to
    the rounding of one float32 sum of the same products; more rows keep cuBLAS."""
    gen = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen, device=DEV).to(dtype)
    weight = (torch.randn(vocab, hidden, generator=gen, device=DEV) / hidden ** 0.5).to(dtype)
    assert fused.head_supported(x, weight) == (rows <= 32)
    logits = fused.head_linear(x, weight)
    assert logits.dtype == dtype and logits.shape == (rows, vocab)
    assert_ulps(logits, torch.nn.functional.linear(x, weight), 2, of_largest=True)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64, 96, 160, 200, 256])
# o_proj (not gated) and down_proj (gated: SiLU-and-mul of gate_up's output) of Qwen3-0.6B and Llama 3 8B
@pytest.mark.parametrize("n,k,gated", [(1024, 2048, False), (1024, 3072, True), (4096, 4096, False),
                                       (4096, 14336, True)])
@torch.inference_mode()
def test_split_k_projection_into_the_residual_norm(dtype, rows, n, k, gated, unfused):
    """o_proj / down_proj on the fused path: split-K partials that sum to x W^T (down_proj: of SiLU-and-mul
    of x, applied in the GEMM), and the residual RMSNorm that consumes them equals the layers' PyTorch code
    given cuBLAS's projection (up to its rounding)."""
    gen = torch.Generator(device=DEV).manual_seed(rows)
    width = 2 * k if gated else k
    x = (2 * torch.randn(rows, width + 64, generator=gen, device=DEV)).to(dtype)[:, 64:]  # strided rows
    weight = (torch.randn(n, k, generator=gen, device=DEV) / k ** 0.5).to(dtype)
    # Llama's 4096 outputs keep cuBLAS; SiLU-and-mul goes into the loads for at most 16 rows
    assert fused.split_k_supported(x, weight, None, gated) == (n <= 2048 and (not gated or rows <= 16))
    partials = fused.split_k_linear(x, weight, gated=gated)
    if gated:
        x = SiluAndMul()(x)  # the layers' PyTorch code: what the GEMM's loads must have computed
    exact = x.double() @ weight.double().T
    assert (partials.sum(0).double() - exact).abs().max() < 1e-4 * exact.abs().max()

    layer = _norm_layer(n, dtype, gen)
    residual = torch.randn(rows, n, generator=gen, device=DEV).to(dtype)
    out, new_residual = fused.rms_norm_split_k(partials, layer.weight, layer.eps, residual)
    projected = torch.nn.functional.linear(x, weight)
    ref_out, ref_residual = layer(projected, residual)
    # Both round an fp32 sum of the same products to the model dtype: at most one ulp apart, then the norm.
    assert_ulps(new_residual, ref_residual, 2, of_largest=True)
    assert_ulps(out, ref_out, 4, of_largest=True)


def test_switch(monkeypatch):
    x = torch.empty(1, device=DEV)
    monkeypatch.delenv(FUSED_ENV_VAR, raising=False)
    set_fused(None)
    assert fused_kernels(x) is fused  # on by default for CUDA tensors
    assert fused_kernels(x.cpu()) is None
    monkeypatch.setenv(FUSED_ENV_VAR, "0")
    set_fused(None)  # re-reads the variable
    assert fused_kernels(x) is None
    set_fused(True)
    assert fused_kernels(x) is fused
    set_fused(None)


def test_float32_greedy_fused_equals_unfused(hf_model_dir):
    """The whole engine, float32: greedy tokens with the fused kernels (CUDA graphs and eager) equal those
    of the PyTorch layers. Exact: RoPE and the residual add are bit-exact, the norms and SiLU within an ulp."""
    path, _ = hf_model_dir
    with_graphs = ours(path, dtype="float32")
    assert ours(path, dtype="float32", enforce_eager=True) == with_graphs
    set_fused(False)
    try:
        assert ours(path, dtype="float32") == with_graphs
    finally:
        set_fused(None)
