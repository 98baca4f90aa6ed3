"""The decoder-layer kernel (pagedllm.ops.triton.decode_layer) on CPU under the Triton interpreter, its five phases
launched in turn: a decode step of one sequence (or of several, a CUDA graph's padding row among them) through
LlamaModel with the kernel gives the logits and writes the K/V of the layers' PyTorch path. Qwen3 (q/k norms, GQA 4),
Qwen2 (q/k/v bias, GQA 2), Llama (MHA), groups of 3 with a hidden size of 192, 3 kv heads, 256-channel heads; both cache
layouts; pages in random order; contexts of one token, of a few partitions and of more partitions than the kernel has
(empty partitions); the newest token's slot holding NaN before the step. tests/gpu/test_decode_layer_gpu.py runs it with
its grid barriers, at real sizes."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

from pagedllm.layers import activation, linear, norm, rotary  # noqa: E402
from pagedllm.layers.attention import AttentionMetadata, set_forward_context  # noqa: E402
from pagedllm.models import fused_decode, load_model  # noqa: E402
from pagedllm.ops import reference  # noqa: E402

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagedllm.ops.triton import decode_layer  # noqa: E402

BLOCK = 16
MODELS = {
    "qwen3": (Qwen3Config, dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64)),
    "qwen2": (Qwen2Config, dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)),
    "llama": (LlamaConfig, dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)),
    # SmolLM2-like: groups of 3 query heads, a hidden size that is no power of two
    "llama-gqa3": (LlamaConfig, dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1)),
    "qwen3-head256": (Qwen3Config, dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=256)),
    # SmolLM2's 3 kv heads: on 8 programs two of them idle in attention and o_proj, and phase D sums 3 partials
    "llama-kv3": (LlamaConfig, dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=3, head_dim=64)),
}


def _fused():
    from pagedllm.ops.triton import fused
    return fused


def _model(tmp_path, arch, dtype):
    config_cls, heads = MODELS[arch]
    config = config_cls(vocab_size=96, intermediate_size=96, num_hidden_layers=2,
                        max_position_embeddings=512, architectures=[config_cls.__name__[:-6] + "ForCausalLM"],
                        **heads)
    config.save_pretrained(tmp_path)
    model, _, _ = load_model(str(tmp_path), dtype, "cpu", load_format="dummy", seed=1)
    with torch.no_grad():  # dummy norms and biases start at 1 / 0: random ones make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


def _bind_caches(model, layout, num_blocks, dtype):
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        d, hkv = attn.head_size, attn.num_kv_heads
        if layout == "hnd":
            shapes = [(num_blocks, hkv, BLOCK, d)] * 2
        else:
            x = 16 // torch.empty((), dtype=dtype).element_size()
            shapes = [(num_blocks, hkv, d // x, BLOCK, x), (num_blocks, hkv, d, BLOCK)]
        attn.bind_cache(torch.zeros(shapes[0], dtype=dtype), torch.zeros(shapes[1], dtype=dtype), "auto", 1.0, 1.0)


def _caches(model):
    return [t.clone() for layer in model.model.layers for t in (layer.self_attn.attn.key_cache,
                                                                layer.self_attn.attn.value_cache)]


def _restore(model, saved):
    caches = [t for layer in model.model.layers for t in (layer.self_attn.attn.key_cache,
                                                          layer.self_attn.attn.value_cache)]
    for t, s in zip(caches, saved):
        t.copy_(s)


def _poison_slot(model, pages, pos):
    """NaN K/V in token pos's cache slot of every layer, as a reused block holds stale values there."""
    slot = torch.tensor([int(pages[pos // BLOCK]) * BLOCK + pos % BLOCK])
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        nan = torch.full((1, attn.num_kv_heads, attn.head_size), float("nan"), dtype=attn.key_cache.dtype)
        reference.reshape_and_cache(nan, nan, attn.key_cache, attn.value_cache, slot, "auto", 1.0, 1.0)


def _prefill(model, ids, pages, n):
    """The first n tokens of ids through the model as one prefill."""
    pos = torch.arange(n)
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(pages[pos // BLOCK] * BLOCK + pos % BLOCK, 0, None, None, 0, pages[None].to(torch.int32),
                             torch.tensor([n], **i32), torch.tensor([0, n], **i32), n, n)
    with set_forward_context(meta), torch.no_grad():
        model(ids[:n], pos)


def _decode(model, seqs, bound=None, share=False):
    """Logits of one decode step of the sequences (ids, pages, context): each one's token context - 1, where a
    context of 0 is a CUDA graph's padding row (slot -1, seq_len 0, block table of zeros). The metadata bounds the
    contexts by `bound`, as a CUDA graph's does, else by the longest; share: its decode_rows_share_blocks."""
    contexts = torch.tensor([c for _, _, c in seqs])
    pos = (contexts - 1).clamp(min=0)
    table = torch.zeros(len(seqs), max(len(pages) for _, pages, _ in seqs), dtype=torch.int32)
    slots = torch.full((len(seqs),), -1)
    for i, (_, pages, c) in enumerate(seqs):
        table[i, :len(pages)] = pages
        if c:
            slots[i] = pages[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK
    ids = torch.stack([ids[c - 1] if c else ids[0] for ids, _, c in seqs])
    meta = AttentionMetadata(slots, len(seqs), table, contexts.to(torch.int32), bound or int(contexts.max()), None,
                             None, None, 0, 0, decode_rows_share_blocks=share)
    with set_forward_context(meta), torch.no_grad():
        return model.compute_logits(model(ids, pos))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("layout", ["hnd", "vllm"])
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("context", [1, 37, 300])
def test_decode_step_through_the_kernel_equals_the_layers(tmp_path, monkeypatch, arch, layout, dtype, rel, context):
    _check_decode_step(tmp_path, monkeypatch, arch, layout, dtype, rel, (context,))


@pytest.mark.parametrize("arch", ["llama-gqa3", "qwen3-head256", "llama-kv3"])
def test_other_head_shapes(tmp_path, monkeypatch, arch):
    _check_decode_step(tmp_path, monkeypatch, arch, "hnd", torch.float32, 1e-5, (300,))


@triton.jit
def _tile_rows(w, out, ROWS: tl.constexpr, PAIRS: tl.constexpr, OUTER: tl.constexpr):
    wt = decode_layer._weight_slice(w, 0, ROWS, ROWS, 256, 256, ROWS, PAIRS, 256, OUTER)
    i = (tl.arange(0, ROWS)[:, None, None, None] * PAIRS + tl.arange(0, PAIRS)[None, :, None, None]) * 256
    tl.store(out + i + (tl.arange(0, 2)[None, None, :, None] * 128 + tl.arange(0, 128)[None, None, None, :]), wt)


@pytest.mark.parametrize("warps_lead", [True, False])
def test_both_tile_orders(tmp_path, monkeypatch, warps_lead):
    """The GEMV tiles are loaded in the dimension order that puts the warps where the Triton version puts them
    (decode_layer._WARPS_LEAD) and handed on as [rows, pairs, chunks, columns] either way; either order computes the
    same step, so a machine with either version tests both."""
    monkeypatch.setattr(decode_layer, "_WARPS_LEAD", tl.constexpr(warps_lead))
    w = torch.arange(16 * 256, dtype=torch.float32).view(16, 256)
    for rows, pairs, outer in ((16, 1, True), (8, 2, True), (4, 2, False)):  # rows over warps, fewer, chunks
        out = torch.zeros(rows, pairs, 256)
        _tile_rows[(1,)](w, out, ROWS=rows, PAIRS=pairs, OUTER=outer)
        # pair p of row r: row p * rows + r of w
        assert torch.equal(out, w[:rows * pairs].view(pairs, rows, 256).transpose(0, 1)), (rows, pairs, outer)
    _check_decode_step(tmp_path, monkeypatch, "qwen3", "hnd", torch.float32, 1e-5, (37,))


@triton.jit
def _gate_up_rows(w, x, out, ROWS: tl.constexpr, K: tl.constexpr, PACKED: tl.constexpr):
    # bf16 through int16 pointers: the interpreter loads bf16 tensors wrongly, but bitcasts them right
    wt = decode_layer._weight_slice(w.to(tl.pointer_type(tl.bfloat16), bitcast=True), 0, ROWS, ROWS, K, K, ROWS, 2, K)
    xs = tl.load(x + tl.arange(0, K)).to(tl.bfloat16, bitcast=True)
    decode_layer._gemv_rows(wt, xs, 0, ROWS, out, out, ROWS, 2, False, 1, True, PACKED)


@pytest.mark.parametrize("warps_lead", [True, False])
def test_gate_up_holds_a_bf16_input_as_pairs(monkeypatch, warps_lead):
    """Where gate_up's registers are capped, its bf16 input is held as pairs of columns (decode_layer.gate_up_tile):
    the same sums bit for bit as the input widened once, SiLU(gate) * up of the weights' rows."""
    monkeypatch.setattr(decode_layer, "_WARPS_LEAD", tl.constexpr(warps_lead))
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(32, 512, generator=gen).bfloat16(), torch.randn(512, generator=gen).bfloat16()
    outs = []
    for packed in (False, True):
        outs.append(torch.zeros(16))
        _gate_up_rows[(1,)](w.view(torch.int16), x.view(torch.int16), outs[-1], ROWS=16, K=512, PACKED=packed)
    gate, up = (w.float() @ x.float()).split(16)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1], gate * torch.sigmoid(gate) * up, rtol=1e-5, atol=1e-3)
    # where the cap applies (two attention tile sizes, few keys a partition): pairs for bf16, else chunks over warps
    assert decode_layer.gate_up_tile(True, False, torch.bfloat16) == (True, True)
    assert decode_layer.gate_up_tile(True, False, torch.float16) == (False, False)
    assert decode_layer.gate_up_tile(True, True, torch.bfloat16) == (True, False)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_projections_streamed_in_slices(tmp_path, monkeypatch, arch):
    """Weight shares too large for one slice are streamed a slice at a time (the larger models' path)."""
    monkeypatch.setattr(decode_layer, "SLICE_BYTES", 4096)
    monkeypatch.setattr(decode_layer, "STEP_BYTES", 2048)
    assert decode_layer._gemv_plan(384, 128, 1, 8, 2) == (8, 8, 0)
    _check_decode_step(tmp_path, monkeypatch, arch, "hnd", torch.float16, 2e-2, (300,))


def test_the_engine_declines_the_kernel_where_shares_stream(tmp_path, monkeypatch):
    """By default, shapes whose weight shares would stream in slices (Llama 3 8B's) keep the layers' path, which
    is faster there; shapes whose shares are requested whole (Qwen3-0.6B's) take the kernel. "triton" takes it
    either way."""
    assert not decode_layer.DecoderLayerKernel.streams_weights(1024, 3072, 16, 8, 128, torch.bfloat16)
    assert decode_layer.DecoderLayerKernel.streams_weights(4096, 14336, 32, 8, 128, torch.bfloat16)
    model = _model(tmp_path, "qwen3", torch.float16)
    assert isinstance(fused_decode._build(model.model, torch.device("cpu"), "auto"), fused_decode.FusedDecode)
    monkeypatch.setattr(decode_layer, "SLICE_BYTES", 512)  # the 128 programs' qkv shares (1 KB) now stream
    monkeypatch.setattr(decode_layer, "STEP_BYTES", 256)
    assert fused_decode._build(model.model, torch.device("cpu"), "auto") is None
    assert isinstance(fused_decode._build(model.model, torch.device("cpu"), "triton"), fused_decode.FusedDecode)


def test_shares_split_into_two_power_of_two_slices():
    """A share of rows that is no power of two is a power-of-two slice and a power-of-two rest, so the rows spread
    evenly over the programs (Qwen3-0.6B's gate_up: 24 rows each on 128 programs, not 32 on 96)."""
    for n_rows, plan in ((3072, (16, 1, 8)), (4096, (32, 1, 0)), (384, (2, 1, 1)), (1200, (8, 1, 2))):
        rpp, steps, rpp2 = decode_layer._gemv_plan(n_rows, 1024, 2, 128, 2)
        assert (rpp, steps, rpp2) == plan
        assert rpp * steps + rpp2 == -(-n_rows // 128)  # the even split, no padding


def test_launch_configs_per_kind_of_launch():
    """Each phase's (warps, register cap) by kind of launch, as measured fastest on the H100 at Qwen3-0.6B's shape
    (decode_layer's constants), no caps where the backend takes none, and no cap on o_proj where its merge tiles
    leave no room under it (SmolLM2-135M's shape: 3 query heads a kv head padded to 4, 42 partitions: it spilled)."""
    dl = decode_layer
    kernel = dl.DecoderLayerKernel(1024, 3072, 16, 8, 128, torch.bfloat16, torch.device("cpu"), num_programs=128)
    proj, gate_up = (dl.NUM_WARPS, dict(maxnreg=dl.PROJECTION_REGISTERS)), dl.GATE_UP_REGISTERS
    plain = (dl.NUM_WARPS, {})
    one_size = (dl.ATTENTION_WARPS, dict(maxnreg=dl.ATTENTION_REGISTERS))
    assert kernel._launch_configs(False, False, True) == [proj, one_size, proj, plain, plain]
    # the projections' caps are one row's: at two, each row's input beside the held weights would spill under them
    assert kernel._launch_configs(True, False, True, 2) == [plain, (dl.ATTENTION_WARPS, {}), plain, plain, plain]
    two_sizes = [proj, (dl.ATTENTION_WARPS, {}), proj, (dl.NUM_WARPS, dict(maxnreg=gate_up)), plain]
    assert kernel._launch_configs(True, False, True) == two_sizes
    # twice the partitions: o_proj's merge tiles double and still leave its share room under the cap
    assert kernel.split_capped and kernel._launch_configs(True, False, True, 1, True) == two_sizes
    assert kernel._launch_configs(True, True, True) == [proj, (dl.ATTENTION_LONG_WARPS, {}), proj, plain, plain]
    assert all(limits == {} for _, limits in kernel._launch_configs(True, False, False))
    small = dl.DecoderLayerKernel(576, 1536, 9, 3, 64, torch.bfloat16, torch.device("cpu"), num_programs=128)
    assert small.capped == [True, False, True] and not small.split_capped
    assert small._launch_configs(False, False, True)[2] == plain


@pytest.mark.parametrize("context", [1, 37])
def test_a_graph_bound_past_the_context(tmp_path, monkeypatch, context):
    """A decode graph's step bounds its context by the graph's size: attention then has both tile sizes compiled
    and picks by the context at run time."""
    _check_decode_step(tmp_path, monkeypatch, "qwen3", "vllm", torch.float32, 1e-5, (context,), bound=1024)


@pytest.mark.parametrize("context", [5, 300, 512])
def test_twice_the_partitions_where_one_a_program_holds_many_keys(tmp_path, monkeypatch, context):
    """A step bounded where a partition a program would hold more than 3 tiles of keys and twice as many partitions
    would not (decode_layer.ATTENTION_SPLIT; here 8 programs, one kv head, 16-key tiles: bound 512) splits the keys
    twice as finely in its five launches, phase C merging every partition of its kv head; the one launch keeps a
    partition a program."""
    kernel = decode_layer.DecoderLayerKernel(128, 96, 4, 1, 64, torch.float32, torch.device("cpu"), num_programs=8)
    assert [kernel.partitions(bound, block_n=16) for bound in (384, 512, 768, 1024)] == [8, 16, 16, 8]
    assert kernel.partitions(512, phased=False, block_n=16) == 8
    launches, real = [], decode_layer._decoder_layer_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((kw["PHASE"], grid[0], kw["NP"]))
                real[grid](*args, **kw)
            return launch
    monkeypatch.setattr(decode_layer, "_decoder_layer_kernel", Recorded())
    _check_decode_step(tmp_path, monkeypatch, "qwen3", "hnd", torch.float32, 1e-5, (context,), bound=512)
    # each layer: attention over 16 partitions and the newest token, merged by phase C's 8 programs
    assert launches == 2 * [(0, 8, 8), (1, 17, 16), (2, 8, 16), (3, 8, 8), (4, 8, 8)]


@pytest.mark.parametrize("arch,layout,dtype,rel,contexts,bound", [
    ("qwen3", "vllm", torch.float32, 1e-5, (37, 1), None),
    ("qwen2", "hnd", torch.float16, 2e-2, (300, 20, 129), None),
    ("llama-kv3", "hnd", torch.float32, 1e-5, (130, 0, 300, 5), 1024),
    ("qwen3", "hnd", torch.float32, 1e-5, (300, 0, 500), 512),  # twice the partitions (ATTENTION_SPLIT)
])
def test_a_step_of_several_sequences(tmp_path, monkeypatch, arch, layout, dtype, rel, contexts, bound):
    """Sequences of different lengths, each with its own pages, in one step of the kernel (every phase runs each
    row with the weights it holds); a CUDA graph's padding row among them writes nothing. Up to 4 rows, past the
    engine's MAX_ROWS (a tuning choice; the kernel takes any number)."""
    monkeypatch.setattr(decode_layer, "MAX_ROWS", 4)
    _check_decode_step(tmp_path, monkeypatch, arch, layout, dtype, rel, contexts, bound)


def test_more_rows_than_the_kernel_takes_keep_the_layers(tmp_path, monkeypatch):
    """A decode step of more than MAX_ROWS sequences is not the kernel's: the plan declines it."""
    model = _model(tmp_path, "qwen3", torch.float16)
    _bind_caches(model, "hnd", 4, torch.float16)
    monkeypatch.setattr(fused_decode, "fused_kernels", lambda x: _fused())
    for rows in (decode_layer.MAX_ROWS, decode_layer.MAX_ROWS + 1):
        meta = AttentionMetadata(torch.full((rows,), -1), rows, torch.zeros(rows, 4, dtype=torch.int32),
                                 torch.zeros(rows, dtype=torch.int32), 0, None, None, None, 0, 0)
        with set_forward_context(meta):
            plan = fused_decode.fused_decode(model.model, torch.zeros(rows, dtype=torch.long))
        assert isinstance(plan, fused_decode.FusedDecode) == (rows == decode_layer.MAX_ROWS)


def test_a_row_reading_the_block_another_row_completes_keeps_the_layers(tmp_path, monkeypatch):
    """A step in which one row's token completes a block that the other row holds (a prefix-cache hit in the same
    step: AttentionMetadata.decode_rows_share_blocks) runs the layers, which write every row's K/V before attending.
    The kernel would read that slot before it is written, here the NaN a reused block held (the runner puts the
    longer row first, so the interpreter runs it before the row that writes)."""
    model = _model(tmp_path, "qwen3", torch.float32)
    _bind_caches(model, "hnd", 4, torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids_a = torch.randint(0, 96, (BLOCK,), generator=gen)
    ids_b = torch.cat([ids_a, torch.randint(0, 96, (1,), generator=gen)])
    shared = torch.tensor([2])
    _prefill(model, ids_a, shared, BLOCK - 1)
    seqs = [(ids_b, torch.tensor([2, 0]), BLOCK + 1), (ids_a, shared, BLOCK)]
    before = _caches(model)
    reference = _decode(model, seqs)
    _restore(model, before)
    _poison_slot(model, shared, BLOCK - 1)
    calls = _use_kernel(model, monkeypatch)
    torch.testing.assert_close(_decode(model, seqs, share=True), reference)
    assert calls == []
    _restore(model, before)
    _decode(model, seqs)  # the same step unflagged takes the kernel
    assert calls == [0, 1]


def _use_kernel(model, monkeypatch):
    """Sends the model's decode steps of CPU tensors through the kernel (the default mode's plan); returns the list
    into which each of the kernel's layer calls puts its layer index."""
    for module in (norm, activation, rotary, linear, fused_decode):  # CPU tensors take the kernels too
        monkeypatch.setattr(module, "fused_kernels", lambda x: _fused())
    from pagedllm.ops.triton.decode_layer import DecoderLayerKernel
    calls = []
    monkeypatch.setattr(DecoderLayerKernel, "__call__",
                        lambda self, *a, f=DecoderLayerKernel.__call__, **kw: calls.append(a[0]) or f(self, *a, **kw))
    # 8 programs (an H100 gets 128): several row tiles per program; attention in 16-key tiles at 37 tokens and in
    # 32-key ones at 300 (partitions longer than a tile: 48 tokens each with one kv head, a tile and a masked
    # half tile; the last one empty)
    attn = model.model.layers[0].self_attn
    kernel = DecoderLayerKernel(model.config.hidden_size, 96, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                attn.qkv_proj.weight.dtype, torch.device("cpu"), num_programs=8)
    model.model._fused_decode = {"auto": fused_decode.FusedDecode(model.model, kernel)}  # the default mode's
    return calls


def _check_decode_step(tmp_path, monkeypatch, arch, layout, dtype, rel, contexts, bound=None):
    """One decode step of sequences of these contexts (0: a padding row) through the kernel against the layers."""
    model = _model(tmp_path, arch, dtype)
    counts = [-(-c // BLOCK) for c in contexts]
    num_blocks = sum(counts) + 3
    gen = torch.Generator().manual_seed(sum(contexts))
    order = torch.randperm(num_blocks, generator=gen)
    seqs = [(torch.randint(0, 96, (max(c, 1),), generator=gen), order[sum(counts[:i]):sum(counts[:i + 1])], c)
            for i, c in enumerate(contexts)]
    _bind_caches(model, layout, num_blocks, dtype)
    for ids, pages, c in seqs:
        if c > 1:
            _prefill(model, ids, pages, c - 1)
    before = _caches(model)
    reference = _decode(model, seqs)
    reference_caches = _caches(model)

    _restore(model, before)
    # The kernel requests the cached keys before it has the newest one: what the newest token's slot held before
    # the step must never reach its attention.
    for _, pages, c in seqs:
        if c:
            _poison_slot(model, pages, c - 1)
    calls = _use_kernel(model, monkeypatch)
    logits = _decode(model, seqs, bound)
    assert calls == [0, 1]  # the kernel ran each layer
    real = [i for i, c in enumerate(contexts) if c]  # a padding row's logits are anything finite
    assert torch.isfinite(logits).all()
    logits, reference = logits[real], reference[real]
    err = (logits - reference).abs().max() / reference.abs().max()
    assert err < rel, f"max error {err:.2e} relative to the largest logit"
    for ours, theirs in zip(_caches(model), reference_caches):
        torch.testing.assert_close(ours, theirs, rtol=rel, atol=rel)


def test_padding_step_writes_nothing(tmp_path, monkeypatch):
    """A CUDA graph's capture runs the step with seq_len 0 and slot -1: no cache write, finite output."""
    model = _model(tmp_path, "qwen3", torch.float16)
    _bind_caches(model, "hnd", 4, torch.float16)
    for module in (norm, activation, rotary, linear, fused_decode):
        monkeypatch.setattr(module, "fused_kernels", lambda x: _fused())
    meta = AttentionMetadata(torch.tensor([-1]), 1, torch.zeros(1, 4, dtype=torch.int32),
                             torch.tensor([0], dtype=torch.int32), 0, None, None, None, 0, 0)
    with set_forward_context(meta), torch.no_grad():
        hidden = model(torch.tensor([3]), torch.tensor([0]))
    assert model.model._fused_decode["auto"] is not None  # the kernel ran the step
    assert torch.isfinite(hidden).all()
    assert all(not t.any() for t in _caches(model))


def test_unsupported_shapes_are_named():
    from pagedllm.ops.triton.decode_layer import DecoderLayerKernel
    assert DecoderLayerKernel.unsupported(1024, 3072, 16, 8, 128, torch.bfloat16) is None
    assert "head size 80" in DecoderLayerKernel.unsupported(1024, 3072, 16, 8, 80, torch.bfloat16)
    assert "12 heads over 8" in DecoderLayerKernel.unsupported(1024, 3072, 12, 8, 128, torch.bfloat16)
    assert "intermediate size 3000" in DecoderLayerKernel.unsupported(1024, 3000, 16, 8, 128, torch.bfloat16)
    assert "8 kv heads on 4 programs" in DecoderLayerKernel.unsupported(1024, 3072, 16, 8, 128, torch.bfloat16, 4)
    with pytest.raises(ValueError, match="decoder-layer kernel: head size 80"):
        DecoderLayerKernel(1024, 3072, 16, 8, 80, torch.bfloat16, torch.device("cpu"))


def test_a_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv(fused_decode.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="PAGEDLLM_DECODE_LAYER='fast'.*triton, persistent, cuda"):
        fused_decode.fused_decode(None, torch.tensor([5]))
    monkeypatch.setenv(fused_decode.ENV_VAR, "0")
    assert fused_decode.fused_decode(None, torch.tensor([5])) is None
