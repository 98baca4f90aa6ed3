"""Where the Triton decoder-layer kernel's time goes (pagedllm/ops/triton/decode_layer.py), timed as CUDA-graph
replays: one layer in one persistent launch, the same layer as five launches, each phase launched alone, each phase's
share of a layer inside the whole step (the kernel's per-program trace), the cost of one grid barrier and of one link
of a chain of dependent launches (the floor under each phase boundary); and the whole
model's step through it and through the CUDA whole-model kernel
(pagedllm/ops/cuda/decode_model.py). Random Qwen3-0.6B-shaped weights in bf16, one sequence at
--context tokens. The same layer replays, so its 31 MB of weights partly stay in the L2: read the layer
times as lower bounds of the engine's (its profile shows the kernel's time there).

    python benchmarks/decode_layer.py [--context 1024]

--sweep instead times the model's forward under launch-config variants of the kernel, alternating (each run a
process of its own), at several (context, graph bound) pairs: each variant is NAME=SPEC, SPEC a comma-separated list
of PHASE[@WHERE]:WARPS[:REGS] (phase A-E; WHERE one, two or many: launches with one attention tile size, with two,
or whose partitions may hold more than three 64-key tiles; REGS 0 or absent: no register cap), applied over the
kernel's own choice; "NAME=" is that choice. A context may not pass its bound.

    python benchmarks/decode_layer.py --sweep base= C16=C:16 Dmany=D@many:16 --contexts 1024:2048 4000:4096
"""
import argparse
import json
import os
import subprocess
import sys

import torch
import triton
import triton.language as tl

from pagedllm.bench.shapes import model_dir_for
from pagedllm.layers.attention import AttentionMetadata, set_forward_context
from pagedllm.models import fused_decode, load_model
from pagedllm.ops.triton import decode_layer, pdl

BLOCK = 16


def graph_time_us(fn, reps=20) -> float:
    """Mean time of fn as replays of a CUDA graph holding `reps` calls of it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 10 * 1000


class _OnePhase:
    """Stands in for the kernel so that a phased layer launches only one phase."""

    def __init__(self, kernel, phase):
        self.kernel, self.phase = kernel, phase

    def __getitem__(self, grid):
        def launch(*args, PHASE, **kwargs):
            if PHASE == self.phase:
                self.kernel[grid](*args, PHASE=PHASE, **kwargs)
        return launch


@triton.jit
def _barriers(barrier, N: tl.constexpr, NPROG: tl.constexpr):
    for i in tl.static_range(N):
        decode_layer._grid_sync(barrier, (i + 1) * NPROG)


@triton.jit
def _link(buf, w, W_N: tl.constexpr, D: tl.constexpr, PROGRAMS: tl.constexpr, PDL: tl.constexpr):
    """One launch of a chain: every program requests W_N weights (before its wait, as the kernel's phases do), reads
    the D-vector the launch before wrote, and writes its share of the next one."""
    pid = tl.program_id(0)
    if PDL:
        pdl.gdc_launch_dependents()
    share = tl.load(w + pid * W_N + tl.arange(0, W_N)).to(tl.float32)
    if PDL:
        pdl.gdc_wait()
    x = tl.load(buf + tl.arange(0, D))
    mine = pid * (D // PROGRAMS) + tl.arange(0, D // PROGRAMS)
    tl.store(buf + mine, tl.load(buf + mine) * 0.5 + tl.sum(x * x) * 1e-9 + tl.sum(share) * 1e-9)


def link_us(programs: int, pdl_on: bool, weight_bytes: int) -> float:
    """The cost of one link of a chain of dependent launches (_link) inside a CUDA graph: the floor under each of the
    kernel's phase boundaries."""
    buf = torch.ones(1024, device="cuda")
    w_n = max(16, weight_bytes // 2)
    w = torch.randn(programs * w_n, dtype=torch.bfloat16, device="cuda")
    options = pdl.options(buf) if pdl_on else dict(PDL=False)

    def chain(n):
        return lambda: [_link[(programs,)](buf, w, W_N=w_n, D=1024, PROGRAMS=programs,
                                           num_warps=decode_layer.NUM_WARPS, **options) for _ in range(n)]
    return (graph_time_us(chain(33), 1) - graph_time_us(chain(1), 1)) / 32


def triton_phases(model, ids, pos):
    """The Triton kernel's per-program timestamps of one step replayed from a CUDA graph (DecoderLayerKernel.trace).
    Per phase: how long after the previous launch's last program ended its programs end (median; slowest, which is
    the phase's share of the layer's critical path), and how long before that end they had started (the head start
    PDL gives them, their weights requested meanwhile). Medians over the middle layers."""
    kernel = model.model._fused_decode["triton"].kernel
    layers, phases = len(model.model.layers), decode_layer.PHASES
    trace = torch.zeros(layers, phases, max(kernel.launch_programs(partitions=kernel.max_partitions)), 2,
                        dtype=torch.int64, device="cuda")
    kernel.trace = trace
    try:
        graph_time_us(lambda: model(ids, pos), 1)  # the trace keeps the last replay's times
    finally:
        kernel.trace = None
    # us from the first program's start (subtracted in int64: as float64 the clock's ~1.8e18 ns has 256-ns steps);
    # NaN where a launch has fewer programs than the widest
    origin = trace[..., 0][trace[..., 0] > 0].min()
    t = torch.where(trace > 0, (trace - origin).double() / 1000, float("nan"))
    start, end = t[..., 0].flatten(0, 1), t[..., 1].flatten(0, 1)  # [launches in order, programs]
    last = end.nan_to_num(float("-inf")).max(-1).values
    prev = torch.cat([last.new_full((1,), float("nan")), last[:-1]])  # the previous launch's last program's end
    after = (end - prev[:, None]).view(layers, phases, -1)[2:-2]
    slowest = (last - prev).view(layers, phases)[2:-2]
    ahead = (prev[:, None] - start).view(layers, phases, -1)[2:-2]
    period = (last.view(layers, phases)[1:, -1] - last.view(layers, phases)[:-1, -1])[2:-2].median().item()
    print(f"triton kernel, one layer {period:.1f} us; per phase, after the previous launch's last program "
          "(medians over the middle layers, us):")
    for i, name in enumerate("A norm+qkv|B attention|C merge+o_proj|D norm+gate_up|E down".split("|")):
        print(f"  {name:16}: programs end {after[:, i].nanmedian().item():5.2f} after (slowest "
              f"{slowest[:, i].median().item():5.2f}), started {ahead[:, i].nanmedian().item():5.2f} before it")


def cuda_phases(model, ids, pos):
    """The CUDA whole-model kernel's own timestamps of one step: per phase, the consumers' work and their wait at
    the grid barrier after it (medians over blocks and the middle layers; attention's slowest block), and how far
    ahead of the consumers the weight stream runs."""
    kernel = model.model._fused_decode["cuda"].kernel
    layers = len(model.model.layers)
    kernel.trace = torch.zeros(kernel.num_blocks, layers, 14, dtype=torch.int64, device="cuda")
    for _ in range(3):
        model(ids, pos)
    torch.cuda.synchronize()
    t = kernel.trace.double()[:, 2:-2] / 1000  # us; the first and last layers ramp up and drain
    kernel.trace = None
    work = {name: t[:, :, 2 * i + 1] - t[:, :, 2 * i] for i, name in enumerate("ABCDE")}
    wait = {name: t[:, :, 2 * i + 2] - t[:, :, 2 * i + 1] for i, name in enumerate("ABCD")}
    per_layer = (t[0, 1:, 0] - t[0, :-1, 0]).median().item()
    print(f"cuda kernel, one layer {per_layer:.1f} us; work / barrier wait per phase (median over blocks, us):")
    norms = {"A": t[:, :, 12] - t[:, :, 0], "D": t[:, :, 13] - t[:, :, 6]}
    for name in "ABCDE":
        slowest = work[name].max(0).values.median().item()
        line = f"  {name}: work {work[name].median().item():5.2f} (slowest block {slowest:5.2f})"
        if name in norms:
            line += f", its norm {norms[name].median().item():5.2f}"
        if name in wait:
            line += f", wait {wait[name].median().item():5.2f}"
        print(line)
    lead = (t[:, :, 0] - t[:, :, 10]).median().item()
    issue = (t[:, :, 11] - t[:, :, 10]).median().item()
    print(f"  weight stream: a layer's first stage issued {lead:.1f} us before the layer starts, its stages "
          f"issued over {issue:.1f} us")


def parse_variant(spec: str):
    """NAME=SPEC (module docstring) -> (NAME, [(phase index, where or None, warps, register cap or None)])."""
    name, _, body = spec.partition("=")
    changes = []
    for item in filter(None, body.split(",")):
        target, *config = item.split(":")
        phase, _, where = target.partition("@")
        valid = len(phase) == 1 and phase in "ABCDE" and where in ("", "one", "two", "many") and len(config) in (1, 2)
        if not valid:
            raise ValueError(f"variant {spec!r}: {item!r} is not PHASE[@one|two|many]:WARPS[:REGS]")
        regs = int(config[1]) if len(config) == 2 else 0
        changes.append(("ABCDE".index(phase), where or None, int(config[0]), regs or None))
    return name, changes


def context_pair(arg: str) -> tuple[int, int]:
    """TOKENS:BOUND, 1 <= TOKENS <= BOUND (the engine never plans a step for less than its context)."""
    ctx, bound = (int(x) for x in arg.split(":"))
    if not 1 <= ctx <= bound:
        raise ValueError(f"{arg!r}: the context must be 1..bound")
    return ctx, bound


def variant_configs(own, changes):
    """A DecoderLayerKernel._launch_configs that applies `changes` (parse_variant) over `own`'s choice."""

    def configs(self, long, many_keys, nvidia, rows=1, split=False):
        out = own(self, long, many_keys, nvidia, rows, split)
        kind = "many" if many_keys else "two" if long else "one"
        for phase, where, warps, regs in changes:
            if where in (None, kind):
                out[phase] = (warps, dict(maxnreg=regs) if regs and nvidia else {})
        return out
    return configs


def bind_caches(model, tokens, gen):
    """Random K/V caches of `tokens` tokens for every layer, and the block table of a sequence holding its pages in
    order (as one sequence's pages mostly come off the free list)."""
    pages = -(-tokens // BLOCK)
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        shape = (pages, attn.num_kv_heads, BLOCK, attn.head_size)
        attn.bind_cache(torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen),
                        torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen), "auto", 1.0, 1.0)
    return torch.arange(pages, device="cuda")


def step_metadata(table, ctx, bound):
    """A decode step of one sequence at ctx tokens (its newest at position ctx - 1), planned for `bound`."""
    pos = torch.tensor([ctx - 1], device="cuda")
    return pos, AttentionMetadata(table[pos // BLOCK] * BLOCK + pos % BLOCK, 1, table[None].to(torch.int32),
                                  torch.tensor([ctx], dtype=torch.int32, device="cuda"), bound, None, None, None, 0, 0)


def time_variant(model, changes, pairs):
    """The forward's time (us) under one launch-config variant (parse_variant's changes) at each (context, bound)."""
    table = bind_caches(model, max(b for _, b in pairs), torch.Generator(device="cuda").manual_seed(0))
    ids = torch.tensor([5], device="cuda")
    decode_layer.DecoderLayerKernel._launch_configs = variant_configs(decode_layer.DecoderLayerKernel._launch_configs,
                                                                      changes)
    os.environ[fused_decode.ENV_VAR] = "1"
    times = []
    for ctx, bound in pairs:
        pos, meta = step_metadata(table, ctx, bound)
        with set_forward_context(meta), torch.no_grad():
            times.append(graph_time_us(lambda: model(ids, pos), 2))
    return times


def sweep(specs, pairs, rounds=3):
    """The forward's time (us) for each variant at each (context, bound), the variants taking turns, each run in
    a process of its own: alternating in one process, a variant timed like the one before it (its trace showed
    that one's co-resident phases; benchmarks/results/README.md, twenty-sixth session)."""
    names = [parse_variant(spec)[0] for spec in specs]
    times = {name: [[] for _ in pairs] for name in names}
    contexts = [f"{ctx}:{bound}" for ctx, bound in pairs]
    for _ in range(rounds):
        for name, spec in zip(names, specs):
            out = subprocess.run([sys.executable, __file__, "--time-variant", spec, "--contexts", *contexts],
                                 capture_output=True, text=True, check=True).stdout
            for per_pair, t in zip(times[name], json.loads(out.strip().splitlines()[-1])):
                per_pair.append(t)
    for i, (ctx, bound) in enumerate(pairs):
        print(f"{ctx} tokens, bound {bound}: " + ", ".join(
            f"{name} {' / '.join(f'{t:.1f}' for t in ts[i])}" for name, ts in times.items()), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--sweep", nargs="+", metavar="NAME=SPEC")
    parser.add_argument("--time-variant", metavar="NAME=SPEC", help=argparse.SUPPRESS)  # one of --sweep's runs
    parser.add_argument("--contexts", nargs="+", metavar="TOKENS:BOUND", type=context_pair,
                        default=[(64, 1024), (1024, 1024), (1024, 2048), (1500, 2048), (2100, 4096), (4000, 4096),
                                 (8000, 8192)])
    args = parser.parse_args()
    if args.sweep:
        print(f"{torch.cuda.get_device_name()}, Qwen3-0.6B shape, bf16")
        print("model forward (us), CUDA-graph replays, variants taking turns, a process each:")
        sweep(args.sweep, args.contexts)
        return
    model, _, _ = load_model(model_dir_for("qwen3-0.6b"), torch.bfloat16, "cuda", load_format="dummy")
    if args.time_variant:
        print(json.dumps(time_variant(model, parse_variant(args.time_variant)[1], args.contexts)))
        return
    print(f"{torch.cuda.get_device_name()}, Qwen3-0.6B shape, bf16")
    ctx = args.context
    table = bind_caches(model, ctx, torch.Generator(device="cuda").manual_seed(0))
    pos, meta = step_metadata(table, ctx, ctx)
    ids = torch.tensor([5], device="cuda")
    print(f"context {ctx}")
    with set_forward_context(meta), torch.no_grad():
        os.environ[fused_decode.ENV_VAR] = "triton"
        model(ids, pos)
        decode = model.model._fused_decode["triton"]
        k, w, attn = decode.kernel, decode.weights[0], decode.attns[0]
        print(f"plans (rows per slice, slices) qkv/o/gate_up/down {k.plans}, {k.num_programs} programs, "
              f"{k.partitions(ctx)} attention partitions per kv head")

        def layer(phased):
            k(0, k.x[:1], w, attn.key_cache, attn.value_cache, attn.scale, decode.cos_sin_cache, pos,
              meta.slot_mapping, meta.decode_seq_lens, meta.decode_block_tables, ctx, phased=phased)
        print(f"layer, one launch:    {graph_time_us(lambda: layer(False)):6.1f} us")
        print(f"layer, five launches: {graph_time_us(lambda: layer(True)):6.1f} us")
        real = decode_layer._decoder_layer_kernel
        try:
            for phase, name in enumerate("A norm+qkv|B attention|C o_proj|D norm+gate_up|E down".split("|")):
                decode_layer._decoder_layer_kernel = _OnePhase(real, phase)
                print(f"phase {name:16} alone: {graph_time_us(lambda: layer(True)):6.1f} us")
        finally:
            decode_layer._decoder_layer_kernel = real
        triton_phases(model, ids, pos)
        for mode in ("triton", "cuda"):
            os.environ[fused_decode.ENV_VAR] = mode
            forward = graph_time_us(lambda: model(ids, pos), 2)
            print(f"model forward (28 layers + final norm), {mode:6}: {forward:6.1f} us")
        cuda_phases(model, ids, pos)
    barrier = torch.zeros(1, dtype=torch.int32, device="cuda")

    def barriers(n):
        barrier.zero_()
        _barriers[(k.num_programs,)](barrier, N=n, NPROG=k.num_programs, num_warps=decode_layer.NUM_WARPS)
    one, many = graph_time_us(lambda: barriers(1)), graph_time_us(lambda: barriers(17))
    print(f"grid barrier: {(many - one) / 16:.2f} us each ({k.num_programs} programs)")
    for pdl_on, weight_bytes in ((False, 0), (True, 0), (True, 65536)):
        print(f"dependent launches, {k.num_programs} programs of {decode_layer.NUM_WARPS} warps, "
              f"{'PDL' if pdl_on else 'plain'}, {weight_bytes // 1024} KB of L2-resident weights a program: "
              f"{link_us(k.num_programs, pdl_on, weight_bytes):.2f} us a link")


if __name__ == "__main__":
    main()
