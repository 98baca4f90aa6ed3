"""The decoder-layer kernel on the GPU, at the random-weight Qwen3-0.6B and Llama shapes of
test_engine_gpu.py: its persistent mode (one launch a layer, grid barriers) gives exactly what the five phases
launched one by one give (so the barriers order every phase's reads after the writes they need), both agree
with the layers' fused path, and batch-1 greedy decoding through the engine (CUDA graphs and eager, both
modes) stays near transformers' fp32 greedy choice, as the engine's other half-precision paths must
(test_engine_gpu.py)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm.layers.attention import AttentionMetadata, set_forward_context  # noqa: E402
from pagedllm.models import fused_decode  # noqa: E402
from pagedllm.ops.triton import decode_layer  # noqa: E402
from pagedllm.ops.triton.decode_layer import DecoderLayerKernel  # noqa: E402
from test_engine_gpu import hf_model_dir, ours  # noqa: E402,F401  (hf_model_dir is a fixture)

BLOCK = 16
CONTEXTS = [1, 100, 1000, 4000]


@pytest.fixture(scope="module")
def model(hf_model_dir):
    from pagedllm.models import load_model
    path, _ = hf_model_dir
    model, _, _ = load_model(str(path), torch.bfloat16, "cuda")
    blocks = -(-max(CONTEXTS) // BLOCK) + 8
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        shape = (blocks, attn.num_kv_heads, BLOCK, attn.head_size)
        attn.bind_cache(torch.randn(shape, dtype=torch.bfloat16, device="cuda"),
                        torch.randn(shape, dtype=torch.bfloat16, device="cuda"), "auto", 1.0, 1.0)
    return model


def _decode(model, token, context, pages):
    pos = torch.tensor([context - 1], device="cuda")
    meta = AttentionMetadata(pages[pos // BLOCK] * BLOCK + pos % BLOCK, 1, pages[None].to(torch.int32),
                             torch.tensor([context], dtype=torch.int32, device="cuda"), context,
                             None, None, None, 0, 0)
    with set_forward_context(meta), torch.no_grad():
        return model.compute_logits(model(torch.tensor([token], device="cuda"), pos)).float()


def _caches(model):
    return [t.clone() for layer in model.model.layers for t in (layer.self_attn.attn.key_cache,
                                                                layer.self_attn.attn.value_cache)]


def _restore(model, saved):
    for layer, k, v in zip(model.model.layers, saved[::2], saved[1::2]):
        layer.self_attn.attn.key_cache.copy_(k)
        layer.self_attn.attn.value_cache.copy_(v)


@pytest.mark.parametrize("context", CONTEXTS)
def test_one_launch_equals_phases_and_the_layers(model, monkeypatch, context):
    gen = torch.Generator().manual_seed(context)
    blocks = model.model.layers[0].self_attn.attn.key_cache.shape[0]
    pages = torch.randperm(blocks, generator=gen)[:-(-context // BLOCK)].cuda()
    token = int(torch.randint(0, 1000, (1,), generator=gen))
    start = _caches(model)
    monkeypatch.setenv(fused_decode.ENV_VAR, "0")
    layers = _decode(model, token, context, pages)
    monkeypatch.delenv(fused_decode.ENV_VAR)

    runs, call = {}, DecoderLayerKernel.__call__
    with monkeypatch.context() as m:  # the same arithmetic both ways: attention at the persistent launch's warps
        m.setattr(decode_layer, "ATTENTION_WARPS", decode_layer.NUM_WARPS)
        for phased in (True, False):
            _restore(model, start)
            m.setattr(DecoderLayerKernel, "__call__", lambda self, *a, p=phased: call(self, *a, phased=p))
            runs[phased] = _decode(model, token, context, pages), _caches(model)
        for _ in range(10):  # more steps: begin_step restarts the barrier and partition counters each time
            _restore(model, start)
            assert torch.equal(_decode(model, token, context, pages), runs[False][0])
    (phases, phase_caches), (fused, fused_caches) = runs[True], runs[False]
    assert torch.equal(fused, phases)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, phase_caches))
    _restore(model, start)
    default = _decode(model, token, context, pages)  # five launches, attention at its own warps
    # bf16 (8 bits of mantissa): the GEMVs sum in another order than cuBLAS and the split-K GEMM, and each
    # rounding to bf16 of q/k/v, the attention output and the projections can then land an ulp apart.
    for out in (fused, default):
        err = (out - layers).abs().max() / layers.abs().max()
        assert err < 4e-2, f"max error {err:.2e} relative to the largest logit"
    for _ in range(10):
        _restore(model, start)
        assert torch.equal(_decode(model, token, context, pages), default)


@pytest.mark.parametrize("enforce_eager,mode", [(False, "1"), (True, "1"), (False, "persistent")],
                         ids=["graphs", "eager", "graphs-persistent"])
@torch.inference_mode()
def test_batch_one_greedy_is_near_transformers(hf_model_dir, monkeypatch, enforce_eager, mode):
    """One prompt at a time, so every decode step is a batch of one: through the kernel, each token must be
    within 2% of the logit spread of transformers' fp32 best on our own sequence (test_engine_gpu.py's bf16
    bar)."""
    path, model = hf_model_dir
    monkeypatch.setenv(fused_decode.ENV_VAR, mode)
    calls = []
    monkeypatch.setattr(DecoderLayerKernel, "begin_step",
                        lambda self, f=DecoderLayerKernel.begin_step: calls.append(1) or f(self))
    vocab = model.config.vocab_size
    for n in (7, 1000):
        prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        [tokens] = ours(path, [prompt], dtype="bfloat16", enforce_eager=enforce_eager)
        logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0, n - 1:-1].float()
        spread = logits.max(-1).values - logits.min(-1).values
        gap = logits.max(-1).values - logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        assert bool((gap <= 0.02 * spread).all()), (gap / spread).max().item()
    assert calls  # the kernel ran the steps (or was captured into the decode graphs that replay them)
