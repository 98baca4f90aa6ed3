"""Decode attention of pagedllm's CUDA ops on DESIGN.md's shapes: time and achieved TB/s (K+V bytes / time).

bf16, head 128, block 16, random block tables. Variants: the engine's choice (``paged_attention``), v1
(single pass), vLLM's v2 interface (512-token partitions) and explicit split-K partition sizes
(``--partitions``), so the v1/v2 choice and partition size can be read off a measurement; optionally the
Triton backend for comparison. Prints a table; ``vLLM`` is vLLM v2's TB/s from DESIGN.md (same GPU kind).

    python benchmarks/cuda_kernels.py [--partitions 0,512,1024,2048] [--iters 20] [--eager] [--triton]
"""
from __future__ import annotations

import argparse
import importlib

import torch

from pagedllm.ops import cuda as cuda_ops
from pagedllm.ops import reference as ref

# (query heads, kv heads, batch, context) -> vLLM v2 CUDA TB/s on an H100 (DESIGN.md)
SHAPES = {
    (32, 8, 1, 32768): 0.83, (32, 8, 16, 4096): 1.02, (32, 8, 64, 1024): 1.00, (32, 8, 64, 8192): 1.22,
    (32, 8, 256, 2048): 1.22, (32, 32, 1, 32768): 2.26, (32, 32, 64, 1024): 2.37, (32, 32, 256, 2048): 2.88,
}
HEAD, BLOCK, DTYPE = 128, 16, torch.bfloat16


def make_inputs(num_heads, num_kv_heads, batch, context, seed=0):
    torch.manual_seed(seed)
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    k_shape, v_shape, _ = ref.kv_cache_shapes(num_blocks, BLOCK, num_kv_heads, HEAD, DTYPE, "auto")
    key_cache = torch.randn(k_shape, dtype=DTYPE, device="cuda")
    value_cache = torch.randn(v_shape, dtype=DTYPE, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
    block_tables = tables.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn((batch, num_heads, HEAD), dtype=DTYPE, device="cuda")
    one = torch.ones(1, device="cuda")
    args = (query, key_cache, value_cache, num_kv_heads, HEAD ** -0.5, block_tables, seq_lens, BLOCK, context,
            None, "auto", one, one)
    kv_bytes = 2 * batch * context * num_kv_heads * HEAD * query.element_size()
    return args, kv_bytes


def time_ms(fn, iters: int, eager: bool, reps: int = 5) -> float:
    """Mean time of one call: `iters` calls captured in a CUDA graph and replayed `reps` times (as the
    engine's decode runs: no Python overhead), or the same number of calls launched eagerly."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (build, caches) off the capture stream
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if eager:
        def run():
            for _ in range(iters):
                fn()
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        run = graph.replay
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * iters)


def variants(args, partitions, triton_ops):
    out = torch.empty_like(args[0])
    yield "auto", lambda: cuda_ops.paged_attention(out, *args)
    n, h, d = args[0].shape
    parts = -(-args[8] // ref.PARTITION_SIZE)
    es, ml = torch.empty((2, n, h, parts), device="cuda")
    tmp = torch.empty((n, h, parts, d), device="cuda", dtype=args[0].dtype)
    yield "v2(512)", lambda: cuda_ops.paged_attention_v2(out, es, ml, tmp, *args)
    for p in (p for p in partitions if p < args[8]):  # a partition as long as the context is v1
        yield ("v1" if p == 0 else f"split({p})"), (lambda p=p: cuda_ops.paged_attention_split(out, *args, p))
    if triton_ops is not None:
        yield "triton", lambda: triton_ops.paged_attention(out, *args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", default="0,256,512,1024,2048,4096,8192",
                        help="comma-separated split-K partition sizes to sweep (0 = v1)")
    parser.add_argument("--iters", type=int, default=20, help="calls per CUDA graph (or eager burst)")
    parser.add_argument("--eager", action="store_true", help="launch eagerly instead of from a CUDA graph")
    parser.add_argument("--triton", action="store_true", help="also time the Triton backend")
    args = parser.parse_args()
    partitions = [int(p) for p in args.partitions.split(",") if p]
    triton_ops = importlib.import_module("pagedllm.ops.triton") if args.triton else None
    cuda_ops.load()
    print(f"# {torch.cuda.get_device_name()}, bf16, head {HEAD}, block {BLOCK}, "
          f"{'eager launches' if args.eager else 'CUDA graphs'}; auto = paged_attention with {cuda_ops.TUNING}")
    print(f"{'shape (H/Hkv, batch x ctx)':<28} {'variant':<12} {'time us':>9} {'TB/s':>6} {'vLLM':>5} {'x vLLM':>7}")
    for (h, hkv, batch, ctx), vllm in SHAPES.items():
        inputs, kv_bytes = make_inputs(h, hkv, batch, ctx)
        label = f"{h}/{hkv}, {batch} x {ctx}"
        for name, fn in variants(inputs, partitions, triton_ops):
            ms = time_ms(fn, args.iters, args.eager)
            tbs = kv_bytes / (ms * 1e-3) / 1e12
            print(f"{label:<28} {name:<12} {ms * 1e3:9.1f} {tbs:6.2f} {vllm:5.2f} {tbs / vllm:7.2f}")
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
