"""The small-batch decode kernels on the GPU, at the random-weight Qwen3-0.6B and Llama shapes of test_engine_gpu.py.
The Triton decoder-layer kernel's persistent mode (one launch a layer, grid barriers) gives what the five phases
launched one by one give, to the FMA contraction of their projections (so the barriers order every phase's reads after
the writes they need), and repeats itself bit for bit; both agree with the layers' fused path; the CUDA whole-model
kernel agrees with the layers too, writes the same K/V, and repeats itself bit for bit (its barriers and partition
merges restart correctly every step); and batch-1 greedy decoding through the engine (CUDA graphs and eager, every mode)
stays near transformers' fp32 greedy choice, as the engine's other half-precision paths must (test_engine_gpu.py). Steps
of several sequences (a CUDA graph's padding row among them) compute each row bit for bit as its sequence's step alone
and write each row's newest cache slot and nothing else, as the layers do; greedy decoding of several prompts at once
stays near transformers too."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm.layers.attention import AttentionMetadata, set_forward_context  # noqa: E402
from pagedllm.models import fused_decode  # noqa: E402
from pagedllm.ops.cuda.decode_model import MAX_GEMV_INPUT, DecodeModelKernel  # noqa: E402
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


def _layers_step(model, monkeypatch, context):
    """A random token and random pages for a step at `context`, the caches before it, and the step through the
    layers' own path: (token, pages, caches before, logits, caches after). The caches are refilled first, so that
    a test does not depend on what earlier ones wrote: that moved the same step at 4000 tokens from 3.5e-2 to 4.1e-2
    of the largest logit from the layers' (thirty-first session)."""
    cache_gen = torch.Generator(device="cuda").manual_seed(context)
    for layer in model.model.layers:
        layer.self_attn.attn.key_cache.normal_(generator=cache_gen)
        layer.self_attn.attn.value_cache.normal_(generator=cache_gen)
    gen = torch.Generator().manual_seed(context)
    blocks = model.model.layers[0].self_attn.attn.key_cache.shape[0]
    pages = torch.randperm(blocks, generator=gen)[:-(-context // BLOCK)].cuda()
    token = int(torch.randint(0, 1000, (1,), generator=gen))
    start = _caches(model)
    monkeypatch.setenv(fused_decode.ENV_VAR, "0")
    return token, pages, start, _decode(model, token, context, pages), _caches(model)


def _decode_rows(model, tokens, contexts, pages, bound):
    """Hidden states of one decode step of several sequences (context 0: a CUDA graph's padding row, slot -1, seq_len
    0 and a block table row of zeros), each with its own pages, planned for contexts up to `bound`."""
    rows = len(contexts)
    table = torch.zeros(rows, max(map(len, pages)), dtype=torch.int32, device="cuda")
    slots = torch.full((rows,), -1, device="cuda")
    for i, (c, p) in enumerate(zip(contexts, pages)):
        if c:
            table[i, :len(p)] = p
            slots[i] = p[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(slots, rows, table, seq_lens, bound, None, None, None, 0, 0)
    with set_forward_context(meta), torch.no_grad():
        return model(torch.tensor(tokens, device="cuda"), (seq_lens.long() - 1).clamp(min=0))


def _several_rows(model, monkeypatch, contexts):
    """Tokens and disjoint random pages for a step of sequences at `contexts` (0: a padding row) through the kernel
    with up to 4 rows, past the engine's MAX_ROWS (a tuning choice: the kernel takes any number); and the list that
    receives the kernel's row count at each of its calls."""
    monkeypatch.setattr(decode_layer, "MAX_ROWS", 4)
    monkeypatch.setattr(model.model, "_fused_decode", {}, raising=False)  # plans built for the patched MAX_ROWS
    gen = torch.Generator().manual_seed(sum(contexts))
    blocks = model.model.layers[0].self_attn.attn.key_cache.shape[0]
    order = torch.randperm(blocks, generator=gen).cuda()
    counts = [-(-c // BLOCK) for c in contexts]
    pages = [order[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(contexts))]
    tokens = torch.randint(0, 1000, (len(contexts),), generator=gen).tolist()
    rows = []
    monkeypatch.setattr(DecoderLayerKernel, "__call__",
                        lambda self, *a, f=DecoderLayerKernel.__call__, **kw: rows.append(a[1].shape[0]) or
                        f(self, *a, **kw))
    return tokens, pages, rows


@pytest.mark.parametrize("contexts", [(1000, 100), (2000, 0, 1, 1000)])
@pytest.mark.parametrize("mode", ["triton", "persistent"])
def test_several_rows_equal_one_at_a_time(model, monkeypatch, contexts, mode):
    """A step of several sequences through the kernel computes each row bit for bit as a step of that sequence alone
    (the same arithmetic, planned for the same context bound) and writes the same K/V, a padding row none; and
    repeats itself bit for bit. One sequence's step agrees with the layers' path (the test below)."""
    tokens, pages, rows = _several_rows(model, monkeypatch, contexts)
    monkeypatch.setenv(fused_decode.ENV_VAR, mode)
    bound = max(contexts)
    start = _caches(model)
    # one after another: their pages are disjoint, so together they write what the step of all of them writes
    alone = {i: _decode_rows(model, [tokens[i]], [c], [pages[i]], bound)[0] for i, c in enumerate(contexts) if c}
    alone_caches = _caches(model)
    rows.clear()
    _restore(model, start)
    together = _decode_rows(model, tokens, contexts, pages, bound)
    assert rows and set(rows) == {len(contexts)}  # the kernel ran every layer with every row
    assert torch.isfinite(together).all()
    for i, hidden in alone.items():
        assert torch.equal(together[i], hidden), f"row {i}: {(together[i] - hidden).abs().max()}"
    for n, (mine, theirs) in enumerate(zip(_caches(model), alone_caches)):
        wrong = (mine != theirs).flatten(1).any(1).nonzero().flatten().tolist()
        assert not wrong, f"cache {n}: pages {wrong} differ; the rows' pages {[p.tolist() for p in pages]}"
    for _ in range(3):
        _restore(model, start)
        assert torch.equal(_decode_rows(model, tokens, contexts, pages, bound), together)


@pytest.mark.parametrize("contexts", [(1000, 100), (2000, 0, 1, 1000)])
@pytest.mark.parametrize("mode", ["triton", "persistent"])
def test_several_rows_write_each_newest_slot_only(model, monkeypatch, contexts, mode):
    """A step of several sequences through the kernel writes K/V into each row's newest slot of every layer (a padding
    row writes none) and nowhere else, as the layers' path does, at values near the layers': within bf16 roundings in
    the first layer, whose input both share, and within the drift of 28 layers of random weights after it (the last
    layers' V ~6% of its largest value apart on the Qwen3 shape)."""
    tokens, pages, rows = _several_rows(model, monkeypatch, contexts)
    newest = torch.zeros_like(model.model.layers[0].self_attn.attn.key_cache[..., 0], dtype=torch.bool)
    for c, p in zip(contexts, pages):
        if c:
            newest[p[(c - 1) // BLOCK], :, (c - 1) % BLOCK] = True
    for layer in model.model.layers:  # a value no K/V takes, so that every write shows (other tests wrote these slots)
        for cache in (layer.self_attn.attn.key_cache, layer.self_attn.attn.value_cache):
            cache[newest] = 1000.0
    bound = max(contexts)
    start = _caches(model)
    monkeypatch.setenv(fused_decode.ENV_VAR, "0")
    _decode_rows(model, tokens, contexts, pages, bound)
    layers = _caches(model)
    assert not rows
    _restore(model, start)
    monkeypatch.setenv(fused_decode.ENV_VAR, mode)
    _decode_rows(model, tokens, contexts, pages, bound)
    assert rows and set(rows) == {len(contexts)}
    for n, (before, theirs, mine) in enumerate(zip(start, layers, _caches(model))):
        for name, cache in (("layers", theirs), ("kernel", mine)):
            written = (cache != before).any(-1)
            assert torch.equal(written, newest), f"cache {n}, {name}: wrote {written.nonzero().tolist()}"
        err = (mine[newest].float() - theirs[newest].float()).abs().max() / theirs[newest].float().abs().max()
        assert err <= (2e-2 if n < 2 else 1e-1), f"cache {n}: K/V {err:.3g} of the largest from the layers'"


@pytest.mark.parametrize("context", CONTEXTS)
def test_one_launch_equals_phases_and_the_layers(model, monkeypatch, context):
    token, pages, start, layers, _ = _layers_step(model, monkeypatch, context)
    monkeypatch.setenv(fused_decode.ENV_VAR, "triton")

    runs, call = {}, DecoderLayerKernel.__call__
    # The same arithmetic both ways (attention at the persistent launch's warps and partitions) but for FMA
    # contraction: the five launches contract their projections, the one launch cannot (it holds attention, whose
    # RoPE keeps separate roundings), so bf16 values can land an ulp apart.
    with monkeypatch.context() as m:
        m.setattr(decode_layer, "ATTENTION_WARPS", decode_layer.NUM_WARPS)
        m.setattr(decode_layer, "ATTENTION_LONG_WARPS", decode_layer.NUM_WARPS)
        m.setattr(DecoderLayerKernel, "partitions", lambda self, *a, **kw: self.o_programs)
        for phased in (True, False):
            _restore(model, start)
            m.setattr(DecoderLayerKernel, "__call__", lambda self, *a, p=phased, **kw: call(self, *a, phased=p, **kw))
            runs[phased] = _decode(model, token, context, pages), _caches(model)
        for _ in range(10):  # more steps: layer 0 restarts the barrier counter each time
            _restore(model, start)
            assert torch.equal(_decode(model, token, context, pages), runs[False][0])
    (phases, phase_caches), (fused, fused_caches) = runs[True], runs[False]
    err = (fused - phases).abs().max() / phases.abs().max()
    assert err < 1e-2, f"one launch against five: max error {err:.2e} relative to the largest logit"
    for a, b in zip(fused_caches, phase_caches):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    _restore(model, start)
    default = _decode(model, token, context, pages)  # five launches, attention at its own warps and partitions
    # bf16 (8 bits of mantissa): the GEMVs sum in another order than cuBLAS and the split-K GEMM, and each
    # rounding to bf16 of q/k/v, the attention output and the projections can then land an ulp apart. Through 28
    # random layers that drift reached 1.6e-2 / 3.8e-2 / 3.9e-2 / 4.4e-2 at 1 / 100 / 1000 / 4000 tokens of these
    # caches (Qwen3 shape, thirty-first session), where the code before that session's changes gave the same
    # logits bit for bit at 1000 and 4000 (the same errors against the layers on the same caches).
    for out in (fused, default):
        err = (out - layers).abs().max() / layers.abs().max()
        assert err < 5e-2, f"max error {err:.2e} relative to the largest logit"
    for _ in range(10):
        _restore(model, start)
        assert torch.equal(_decode(model, token, context, pages), default)


def test_trace_holds_every_launch_in_order(model, monkeypatch):
    """DecoderLayerKernel.trace (benchmarks/decode_layer.py reads it) receives every program's start and end in each
    of the step's launches: no program ends before the previous launch's last one (each waits for it), and
    tracing changes nothing the step computes."""
    token, pages, start, _, _ = _layers_step(model, monkeypatch, 1000)
    monkeypatch.setenv(fused_decode.ENV_VAR, "triton")
    _restore(model, start)
    plain = _decode(model, token, 1000, pages)
    kernel = model.model._fused_decode["triton"].kernel
    trace = torch.zeros(len(model.model.layers), decode_layer.PHASES, max(kernel.launch_programs()), 2,
                        dtype=torch.int64, device="cuda")
    kernel.trace = trace
    try:
        _restore(model, start)
        traced = _decode(model, token, 1000, pages)
    finally:
        kernel.trace = None
    assert torch.equal(traced, plain)
    for phase, programs in enumerate(kernel.launch_programs()):  # only the launch's own programs write
        assert (trace[:, phase, :programs] > 0).all() and (trace[:, phase, programs:] == 0).all()
    t = trace.flatten(0, 1)  # [launches in order, programs, (start, end)]
    assert (t[..., 1] >= t[..., 0]).all()
    first_end = torch.where(t[..., 1] > 0, t[..., 1], t[..., 1].max()).min(-1).values
    assert (first_end[1:] >= t[:-1, :, 1].max(-1).values).all()


@pytest.mark.parametrize("context", CONTEXTS)
def test_cuda_model_kernel_equals_the_layers(model, monkeypatch, context):
    token, pages, start, layers, layer_caches = _layers_step(model, monkeypatch, context)
    monkeypatch.setenv(fused_decode.ENV_VAR, "cuda")
    _restore(model, start)
    ours, our_caches = _decode(model, token, context, pages), _caches(model)
    layer = model.model.layers[0]
    attn = layer.self_attn
    reason = DecodeModelKernel.unsupported(layer.input_layernorm.weight.shape[0], layer.mlp.down_proj.in_features,
                                           attn.num_heads, attn.num_kv_heads, attn.head_dim, torch.bfloat16,
                                           attn.attn.key_cache)
    if reason is not None:  # the test Llama's 5632-wide MLP: the step ran the layers' path
        assert "intermediate size" in reason and model.model._fused_decode["cuda"] is None
        assert torch.equal(ours, layers)
        return
    plan = model.model._fused_decode["cuda"]
    assert isinstance(plan, fused_decode.CudaDecode)
    # Through 28 layers the two paths' roundings (GEMV order, then bf16 q/k/v, attention output, residual) drift
    # further apart than the Triton kernel's 4e-2: the last layer's step itself is checked tightly below.
    err = (ours - layers).abs().max() / layers.abs().max()
    assert err < 6e-2, f"max error {err:.2e} relative to the largest logit"
    page, offset = int(pages[(context - 1) // BLOCK]), (context - 1) % BLOCK
    for before, theirs, mine in zip(start, layer_caches, our_caches):
        written = torch.zeros_like(mine, dtype=torch.bool)
        written[page, :, offset] = True
        assert torch.equal(mine[~written], before[~written])  # nothing but the new token's slot changed
        new, expected = mine[page, :, offset].float(), theirs[page, :, offset].float()
        assert (new - expected).abs().max() <= 6e-2 * expected.abs().max()
    _check_last_layer_attention(model, plan.kernel, pages, context)
    for _ in range(10):  # barriers and merge counters restart every step
        _restore(model, start)
        assert torch.equal(_decode(model, token, context, pages), ours)


def _check_last_layer_attention(model, kernel, pages, context):
    """The kernel's last layer against fp32 math on its own q/k/v projection (kernel.qkv): the new token's K/V in
    the cache (q/k RMSNorm + RoPE) and the attention output over the whole context, GQA heads and partitions
    merged."""
    layer = model.model.layers[-1].self_attn
    attn = layer.attn
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_size
    qkv = kernel.qkv.float()
    q, k, v = qkv[:heads * d].view(heads, d), qkv[heads * d:(heads + kv_heads) * d].view(kv_heads, d), \
        qkv[(heads + kv_heads) * d:].view(kv_heads, d)
    if layer.qk_norm:
        q, k = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
                for x, norm in ((q, layer.q_norm), (k, layer.k_norm)))
    cos, sin = model.model.rotary_emb.cos_sin_cache[context - 1].chunk(2)

    def rope(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    q, k = rope(q), rope(k)
    tokens = torch.arange(context, device="cuda")
    keys = attn.key_cache[pages[tokens // BLOCK], :, tokens % BLOCK].float()
    values = attn.value_cache[pages[tokens // BLOCK], :, tokens % BLOCK].float()
    assert (keys[-1] - k).abs().max() <= 1.5e-2 * k.abs().max()  # bf16 rounding of q/k and cos/sin
    assert torch.equal(values[-1], v)
    scores = torch.einsum("hd,thd->ht", q, keys.repeat_interleave(heads // kv_heads, 1)) * attn.scale
    expected = torch.einsum("ht,thd->hd", scores.softmax(-1), values.repeat_interleave(heads // kv_heads, 1))
    out = kernel.attn_out.float().view(heads, d)
    assert (out - expected).abs().max() <= 1.5e-2 * expected.abs().max()


def test_cuda_model_kernel_names_what_it_cannot_run():
    def cache(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    unsupported = DecodeModelKernel.unsupported
    assert unsupported(1024, 3072, 16, 8, 128, torch.bfloat16, cache(4, 8, 16, 128)) is None
    assert "intermediate size 14336" in unsupported(1024, 14336, 16, 8, 128, torch.bfloat16, cache(4, 8, 16, 128))
    assert "head size 256" in unsupported(1024, 3072, 16, 8, 256, torch.bfloat16, cache(4, 8, 16, 256))
    assert "'hnd'" in unsupported(1024, 3072, 16, 8, 128, torch.bfloat16, cache(4, 8, 16, 16, 8))


@pytest.mark.parametrize("enforce_eager,mode", [(False, "triton"), (True, "triton"), (False, "persistent"),
                                                (False, "cuda"), (True, "cuda")],
                         ids=["graphs", "eager", "graphs-persistent", "graphs-cuda", "eager-cuda"])
@torch.inference_mode()
def test_batch_one_greedy_is_near_transformers(hf_model_dir, monkeypatch, enforce_eager, mode):
    """One prompt at a time, so every decode step is a batch of one: through the kernel, each token must be
    within 2% of the logit spread of transformers' fp32 best on our own sequence (test_engine_gpu.py's bf16
    bar)."""
    path, model = hf_model_dir
    monkeypatch.setenv(fused_decode.ENV_VAR, mode)
    calls = []
    if mode == "cuda":
        monkeypatch.setattr(DecodeModelKernel, "__call__",
                            lambda self, *a, f=DecodeModelKernel.__call__: calls.append(1) or f(self, *a))
    else:
        monkeypatch.setattr(DecoderLayerKernel, "__call__",
                            lambda self, *a, f=DecoderLayerKernel.__call__, **kw: calls.append(1) or f(self, *a, **kw))
    for prompt in _prompts(model, (7, 1000)):
        [tokens] = ours(path, [prompt], dtype="bfloat16", enforce_eager=enforce_eager)
        _assert_near_transformers(model, prompt, tokens)
    # The kernel ran the steps (or was captured into the decode graphs that replay them); the CUDA kernel does not
    # take the test Llama's 5632-wide MLP.
    assert bool(calls) == (mode != "cuda" or model.config.intermediate_size <= MAX_GEMV_INPUT)


@pytest.mark.parametrize("enforce_eager,lengths,max_rows", [(False, (7, 1000), None), (True, (7, 1000), None),
                                                            (False, (7, 300, 1000), 4)],
                         ids=["graphs", "eager", "graphs-padding-row"])
@torch.inference_mode()
def test_several_prompts_greedy_is_near_transformers(hf_model_dir, monkeypatch, enforce_eager, lengths, max_rows):
    """Prompts decoded together take the kernel in steps of all of them (three: with MAX_ROWS raised to 4, in the
    4-row decode graph, one row padding), and each token stays within 2% of the logit spread of transformers' fp32
    best on our own sequence."""
    from pagedllm.worker.cuda_graph import DecodeGraphs
    path, model = hf_model_dir
    monkeypatch.setenv(fused_decode.ENV_VAR, "triton")
    if max_rows:
        monkeypatch.setattr(decode_layer, "MAX_ROWS", max_rows)
    rows, replays = [], []
    monkeypatch.setattr(DecoderLayerKernel, "__call__",
                        lambda self, *a, f=DecoderLayerKernel.__call__, **kw: rows.append(a[1].shape[0]) or
                        f(self, *a, **kw))
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, bs, *a, f=DecodeGraphs.run, **kw: replays.append(bs) or
                        f(self, bs, *a, **kw))
    prompts = _prompts(model, lengths)
    for prompt, tokens in zip(prompts, ours(path, prompts, dtype="bfloat16", enforce_eager=enforce_eager)):
        _assert_near_transformers(model, prompt, tokens)
    # the kernel ran the steps of all the prompts (in graphs: captured at the padded size, which replayed them)
    step = len(prompts) if enforce_eager else 1 << (len(prompts) - 1).bit_length()
    assert step in rows and (enforce_eager or step in replays)


def _prompts(model, lengths):
    return [torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in lengths]


def _assert_near_transformers(model, prompt, tokens):
    """Each of our greedy tokens within 2% of the logit spread of transformers' fp32 best on our own sequence."""
    n = len(prompt)
    logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0, n - 1:-1].float()
    spread = logits.max(-1).values - logits.min(-1).values
    gap = logits.max(-1).values - logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    assert bool((gap <= 0.02 * spread).all()), (gap / spread).max().item()
