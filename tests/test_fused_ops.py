"""The fused Triton kernels (pagedllm.ops.triton.fused) against the PyTorch code of the layers they replace,
on CPU under the Triton interpreter (fp16/fp32; the interpreter mishandles bf16), at odd sizes. RoPE and the
residual add must match bit for bit; the norms and SiLU within an ulp or two (reduction order, exp).
tests/gpu/test_fused_gpu.py runs the same checks on CUDA at real sizes."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (the layers import it lazily)

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from pagedllm.layers import activation, linear, norm, rotary  # noqa: E402
from pagedllm.layers.activation import SiluAndMul  # noqa: E402
from pagedllm.layers.norm import RMSNorm  # noqa: E402
from pagedllm.layers.rotary import RotaryEmbedding  # noqa: E402
from pagedllm.models import load_model  # noqa: E402
from test_models import prefill_logits  # noqa: E402

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16]
TOKENS = [1, 37]


def _fused():
    from pagedllm.ops.triton import fused
    return fused


def assert_ulps(out, ref, ulps=2, of_largest=False):
    """Equal up to `ulps` units in the last place of each element of ref (of_largest: of ref's largest
    element, for values that come out of a cancelling sum such as a rotation)."""
    info = torch.finfo(ref.dtype)
    atol = ulps * info.eps * ref.abs().max().item() if of_largest else info.tiny
    torch.testing.assert_close(out, ref, rtol=ulps * info.eps, atol=atol)


def _norm_layer(hidden, dtype, gen):
    layer = RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=gen))
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [96, 200])
def test_rms_norm(dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(tokens + hidden)
    layer = _norm_layer(hidden, dtype, gen)
    x = (3 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ulps = 2 if dtype != torch.float32 else 64  # fp32: summation order alone moves the last bits
    fused = _fused()
    with torch.no_grad():
        assert_ulps(fused.rms_norm(x, layer.weight, layer.eps), layer(x), ulps)
        out, new_residual = fused.rms_norm(x, layer.weight, layer.eps, residual)
        ref_out, ref_residual = layer(x, residual)
    assert torch.equal(new_residual, ref_residual)
    assert_ulps(out, ref_out, ulps)


def test_rms_norm_strided_rows_leave_inputs_alone():
    gen = torch.Generator().manual_seed(0)
    layer = _norm_layer(80, torch.float16, gen)
    wide = torch.randn(5, 3, 100, generator=gen).to(torch.float16)
    x, residual = wide[..., :80], wide[..., 10:90]  # strided rows, overlapping inputs
    before = wide.clone()
    with torch.no_grad():
        out, new_residual = _fused().rms_norm(x, layer.weight, layer.eps, residual)
        ref_out, ref_residual = layer(x, residual)
    assert out.shape == (5, 3, 80) and torch.equal(new_residual, ref_residual)
    assert_ulps(out, ref_out)
    assert torch.equal(wide, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", [40, 1500])  # 1500: more than one column block, ragged last block
def test_silu_and_mul(dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens + inter)
    x = (4 * torch.randn(tokens, 2 * inter + 3, generator=gen)).to(dtype)[:, 1:2 * inter + 1]  # strided rows
    out = _fused().silu_and_mul(x)
    ref = SiluAndMul()(x)
    assert out.shape == ref.shape == (tokens, inter)
    assert_ulps(out, ref, 2 if dtype != torch.float32 else 8)


def _qkv(tokens, heads, kv_heads, head_size, dtype, gen):
    """q and k as the model has them: strided views into one fused qkv projection output."""
    q_size, kv_size = heads * head_size, kv_heads * head_size
    qkv = (2 * torch.randn(tokens, q_size + 2 * kv_size, generator=gen)).to(dtype)
    return qkv, qkv.split([q_size, kv_size, kv_size], dim=-1)


# (heads, kv heads, head size): GQA, MQA, odd head counts, 80-dim heads (half of 40: a padded tile).
ROPE_SHAPES = [(4, 2, 64), (3, 1, 80), (8, 8, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_embedding_in_place(dtype, tokens, shape, qk_norm):
    heads, kv_heads, head_size = shape
    gen = torch.Generator().manual_seed(tokens + head_size)
    rope = RotaryEmbedding(head_size, 4096, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 512})
    norms = (_norm_layer(head_size, dtype, gen), _norm_layer(head_size, dtype, gen)) if qk_norm else None
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    qkv, (q, k, v) = _qkv(tokens, heads, kv_heads, head_size, dtype, gen)
    v_before = v.clone()
    with torch.no_grad():
        ref_q, ref_k = rope(positions, q, k, norms)
        norm_args = (norms[0].weight, norms[1].weight, norms[0].eps) if qk_norm else None
        _fused().rotary_embedding(positions, q, k, head_size, rope.cos_sin_cache, norm_args)
    assert torch.equal(v, v_before)
    if qk_norm:
        ulps = 4 if dtype != torch.float32 else 64
        assert_ulps(q, ref_q, ulps, of_largest=True)
        assert_ulps(k, ref_k, ulps, of_largest=True)
    else:  # products and sums rounded at the same points as the PyTorch layer: identical bits
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("layout", ["vllm", "hnd"])
@pytest.mark.parametrize("dtype,kv_cache_dtype,tensor_scales", [
    (torch.float32, "auto", False), (torch.float16, "fp8_e4m3", True), (torch.float16, "fp8_e5m2", False)])
@pytest.mark.parametrize("shape", ROPE_SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_equals_rope_then_cache_write(layout, dtype, kv_cache_dtype, tensor_scales, shape, qk_norm):
    """The fused RoPE + cache write leaves q, the caches and everything else exactly as rotary_embedding
    followed by reshape_and_cache would, padding tokens included; k itself stays unrotated."""
    from pagedllm.ops import reference
    from pagedllm.ops import triton as triton_ops
    heads, kv_heads, head_size = shape
    tokens, block_size, num_blocks = 13, 8, 4
    gen = torch.Generator().manual_seed(head_size + tokens)
    rope = RotaryEmbedding(head_size, 4096, 10000.0)
    norms = (_norm_layer(head_size, dtype, gen), _norm_layer(head_size, dtype, gen)) if qk_norm else None
    norm_args = (norms[0].weight, norms[1].weight, norms[0].eps) if qk_norm else None
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens - 2]
    slots[3] = -1  # skipped; the last two tokens have no slot (padding)
    scales = (0.5, 0.25) if kv_cache_dtype != "auto" else (1.0, 1.0)
    if tensor_scales:
        scales = tuple(torch.tensor([x]) for x in scales)
    kshape, vshape, cdtype = reference.kv_cache_shapes(num_blocks, block_size, kv_heads, head_size, dtype,
                                                       kv_cache_dtype, layout)
    qkv, _ = _qkv(tokens, heads, kv_heads, head_size, dtype, gen)
    def fresh_caches():
        return [torch.randint(0, 100, shape_, generator=torch.Generator().manual_seed(7)).to(cdtype)
                for shape_ in (kshape, vshape)]

    results = []
    for fused in (False, True):
        caches = fresh_caches()
        x = qkv.clone()
        q, k, v = x.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
        with torch.no_grad():
            if fused:
                _fused().rope_and_cache(positions, q, k, v, head_size, rope.cos_sin_cache, norm_args, *caches,
                                        slots, kv_cache_dtype, *scales)
            else:
                _fused().rotary_embedding(positions, q, k, head_size, rope.cos_sin_cache, norm_args)
                triton_ops.reshape_and_cache(k.view(tokens, kv_heads, head_size), v.view(tokens, kv_heads, head_size),
                                             *caches, slots, kv_cache_dtype, *scales)
        results.append((x, caches))
    (unfused, unfused_caches), (fused, fused_caches) = results
    q_size = heads * head_size
    assert torch.equal(fused[:, :q_size], unfused[:, :q_size])  # q rotated the same
    assert torch.equal(fused[:, q_size:], qkv[:, q_size:])  # k and v untouched
    for a, b in zip(fused_caches, unfused_caches):
        assert torch.equal(a, b)

    # With q_out (what piecewise CUDA graphs use), the rotated q lands there and q itself is left alone.
    x = qkv.clone()
    q, k, v = x.split([q_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    q_out = torch.full((tokens + 3, heads, head_size), 7.0, dtype=dtype)
    fused_caches = fresh_caches()
    with torch.no_grad():
        _fused().rope_and_cache(positions, q, k, v, head_size, rope.cos_sin_cache, norm_args, *fused_caches,
                                slots, kv_cache_dtype, *scales, q_out=q_out[:tokens])
    assert torch.equal(q_out[:tokens].view(tokens, q_size), unfused[:, :q_size])
    assert bool((q_out[tokens:] == 7.0).all()) and torch.equal(x, qkv)
    for a, b in zip(fused_caches, unfused_caches):
        assert torch.equal(a, b)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows,n,k,config", [
    (1, 128, 1024, None),  # the tuned choice: K split 8 ways
    (5, 192, 256, (16, 64, 128, 2, 2, 4)),
    (37, 64, 384, (16, 64, 128, 1, 2, 4)),  # three row tiles, the last ragged; no split
    (64, 128, 512, (64, 128, 256, 2, 2, 8)),
    (96, 128, 1024, None),  # the tuned choice past 64 rows: 64-row tiles (the second ragged), K split 8 ways
])
def test_split_k_linear_sums_to_the_product(rows, n, k, config, gated):
    """Partials that sum to x W^T; gated, to silu_and_mul(x) W^T with the activation rounded as the fused
    kernel rounds it (so the sums agree to float32 reordering)."""
    from pagedllm.ops.triton import linear as ops
    gen = torch.Generator().manual_seed(rows)
    width = 2 * k if gated else k
    x = torch.randn(rows, width + 8, generator=gen).half()[:, 8:]  # strided rows
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).half()
    assert ops.split_k_supported(x, w, None, gated) == (not gated or rows <= ops.MAX_GATED_ROWS)
    assert not ops.split_k_supported(x, w, None, not gated)  # x's width says which it is
    partials = ops.split_k_linear(x, w, config, gated=gated)
    split = (config or ops._config(rows, n, k))[3]
    assert partials.shape == (split, rows, n) and partials.dtype == torch.float32
    act = _fused().silu_and_mul(x) if gated else x
    torch.testing.assert_close(partials.sum(0), act.float() @ w.float().T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="does not tile"):
        ops.split_k_linear(x, w, (16, 64, 256, 4, 2, 4) if k % 1024 else (16, 96, 128, 1, 2, 4), gated=gated)
    with pytest.raises(ValueError, match="features for a weight"):
        ops.split_k_linear(x, w, gated=not gated)


def test_split_k_supported_shapes():
    from pagedllm.ops.triton import linear as ops
    x, w = torch.zeros(4, 256, dtype=torch.float16), torch.zeros(128, 256, dtype=torch.float16)
    assert ops.split_k_supported(x, w, None)
    assert not ops.split_k_supported(x.float(), w.float(), None)  # fp32 keeps cuBLAS's precision
    assert not ops.split_k_supported(x, w, torch.zeros(128, dtype=torch.float16))
    assert not ops.split_k_supported(torch.zeros(ops.MAX_ROWS + 1, 256, dtype=torch.float16), w, None)
    assert not ops.split_k_supported(x, w[:96], None)  # N not a multiple of the 64-row weight tile
    wide = torch.zeros(64 * (ops.MAX_OUTPUT_TILES + 1), 256, dtype=torch.float16)
    assert not ops.split_k_supported(x, wide, None)  # cuBLAS already covers the GPU
    gate_up = torch.zeros(ops.MAX_GATED_ROWS, 512, dtype=torch.float16)
    assert ops.split_k_supported(gate_up, w, None, gated=True)
    assert not ops.split_k_supported(torch.cat([gate_up, gate_up[:1]]), w, None, gated=True)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_head_linear_is_the_product_in_the_model_dtype(rows):
    """The LM head of few rows: x W^T written as logits of x's dtype, the float32 sums rounded once; into a given
    tensor as well (a decode graph's buffer)."""
    from pagedllm.ops.triton import linear as ops
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256 + 8, generator=gen).half()[:, 8:]  # strided rows
    w = (torch.randn(192, 256, generator=gen) / 16).half()
    assert ops.head_supported(x, w)
    logits = ops.head_linear(x, w)
    assert logits.shape == (rows, 192) and logits.dtype == torch.float16
    torch.testing.assert_close(logits, (x.float() @ w.float().T).half(), rtol=1e-3, atol=1e-3)
    buffer = torch.zeros(rows + 1, 192, dtype=torch.float16)
    assert ops.head_linear(x, w, buffer[:rows]).data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:rows], logits) and not buffer[rows].any()


def test_head_supported_shapes():
    from pagedllm.ops.triton import linear as ops
    x, w = torch.zeros(ops.MAX_HEAD_ROWS, 256, dtype=torch.float16), torch.zeros(49152, 256, dtype=torch.float16)
    assert ops.head_supported(x, w)
    assert not ops.head_supported(torch.zeros(ops.MAX_HEAD_ROWS + 1, 256, dtype=torch.float16), w)  # cuBLAS wins
    assert not ops.head_supported(x[:0], w)
    assert not ops.head_supported(x.float(), w.float())
    assert not ops.head_supported(x, w[:49152 - 32])  # the vocabulary not a multiple of the 64-row tile
    assert not ops.head_supported(x[:, :192], w[:, :192])  # hidden not a multiple of the 128-wide tile


@pytest.mark.parametrize("parts", [1, 4])
def test_rms_norm_split_k_is_rms_norm_of_the_sum(parts):
    gen = torch.Generator().manual_seed(parts)
    layer = _norm_layer(200, torch.float16, gen)
    partials = torch.randn(parts, 37, 200, generator=gen)
    residual = torch.randn(37, 200, generator=gen).half()
    total = partials[0].clone()
    for p in partials[1:]:  # the kernel's order
        total += p
    fused = _fused()
    out = fused.rms_norm_split_k(partials, layer.weight, layer.eps, residual)
    ref = fused.rms_norm(total.half(), layer.weight, layer.eps, residual)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize("tokens", [9, 37, 100])
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
def test_qwen3_model_with_fused_kernels(tmp_path, monkeypatch, dtype, rel, tokens):
    """The layers' wiring: a Qwen3 (per-head q/k norm, 80-dim heads, in-place RoPE on the qkv output; in
    fp16 down_proj as a split-K GEMM whose partials the next residual norm sums, SiLU-and-mul applied as it
    loads gate_up's output for up to 16 rows, by its own kernel for more, in two row tiles for 100; o_proj's K of
    240 does not tile for it) gives the same logits through the kernels as through the PyTorch code."""
    config = Qwen3Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=80, max_position_embeddings=256,
                         architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(tmp_path)
    model, _, _ = load_model(str(tmp_path), dtype, "cpu", load_format="dummy", seed=1)
    with torch.no_grad():  # dummy norms start at 1; random ones make the norm weights count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    ids = torch.randint(0, 128, (tokens,), generator=torch.Generator().manual_seed(2))
    reference = prefill_logits(model, ids)
    for module in (norm, activation, rotary, linear):  # route CPU tensors through the kernels, as CUDA ones are
        monkeypatch.setattr(module, "fused_kernels", lambda x: _fused())
    split_k = []
    monkeypatch.setattr(_fused(), "split_k_linear",
                        lambda *a, f=_fused().split_k_linear, **kw: split_k.append(kw) or f(*a, **kw))
    fused = prefill_logits(model, ids)
    gated = [{"gated": True} if tokens <= 16 else {}]
    assert split_k == ([] if dtype == torch.float32 else gated * 2)  # each layer's down_proj
    err = (fused - reference).abs().max() / reference.abs().max()
    assert err < rel, f"max error {err:.2e} relative to the largest logit"


@pytest.mark.parametrize("dtype", DTYPES)
# one short chunk; one partial chunk; two chunks, the second ragged (ARGMAX_CHUNK = 8192)
@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 4096), (5, 9000)])
def test_argmax_takes_the_first_of_equal_maxima(dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, vocab + 3, generator=gen).to(dtype)[:, 3:]  # strided rows
    x[0, vocab // 3] = x[0, vocab - 1] = 100.0  # a tie (across the two chunks at 9000): the first one wins
    x[-1, -2:] = 200.0  # a tie inside the last chunk
    assert torch.equal(_fused().argmax(x), x.argmax(dim=-1))
    out = torch.full((rows + 1,), -1)
    _fused().argmax(x, out[:rows])
    assert torch.equal(out[:rows], x.argmax(dim=-1)) and out[rows] == -1
    # also into the host ring's row that a tensor names (a decode graph's argmax, DecodeGraphs' SAMPLE_SLOTS)
    ring = torch.full((3, rows + 1), -1)
    _fused().argmax(x, out[:rows], ring, torch.tensor([1]))
    assert torch.equal(ring[1, :rows], x.argmax(dim=-1)) and (ring[1, rows:] == -1).all() and (ring[0::2] == -1).all()
    with pytest.raises(ValueError, match="host"):
        _fused().argmax(x, out[:rows], ring)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_orders_negative_values_and_signed_zeros(dtype):
    """The chunks' (value, index) keys keep the floats' order below zero, and -0.0 ties with 0.0 (the first
    wins), in one chunk and across two."""
    x = torch.full((4, 9000), -3.0, dtype=dtype)
    x[0, 5], x[0, 8500] = -1.5, -1.25  # all negative: the larger one, in the second chunk
    x[1, 7], x[1, 8200] = -0.0, 0.0  # a tie across the chunks, -0.0 first
    x[2, 8201], x[2, 8300] = 0.0, -0.0  # a tie inside one chunk, 0.0 first
    x[3, 2], x[3, 3] = -2.0, -2.5
    assert _fused().argmax(x).tolist() == [8500, 7, 8201, 2] == x.argmax(dim=-1).tolist()


def test_cpu_tensors_never_import_triton():
    code = ("import sys, torch\n"
            "from pagedllm.layers.norm import RMSNorm, fused_kernels, set_fused\n"
            "set_fused(True)\n"
            "x = torch.randn(2, 8)\n"
            "assert fused_kernels(x) is None and RMSNorm(8)(x).shape == x.shape\n"
            "assert 'triton' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
