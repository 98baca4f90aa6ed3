"""The decode step's residual projections (o_proj, down_proj) and the RMSNorm that adds them to the residual:
cuBLAS (torch.nn.functional.linear, after fused.silu_and_mul for down_proj) + fused.rms_norm against
pagedllm's split-K GEMM (SiLU-and-mul in its loads for down_proj at up to 16 rows) + fused.rms_norm_split_k
(`pagedllm.ops.triton.linear`), on Qwen3-0.6B's and Llama-3-8B's shapes, with the weights coming from DRAM
as in a decode step (each timed pair reads the next of enough weight copies to overflow the L2), in
CUDA-graph replays. Per (shape, rows): both pairs, the op's own config, and the best of a sweep (the
measurements behind `linear._config` and `linear.MAX_ROWS`); per row count the sum over Qwen3-0.6B's 28
layers.

    python benchmarks/gemm_probe.py [--m 1 16 32 64 128 256] [--out probe.json]
"""
import argparse
import itertools
import json

import torch
import triton

from pagedllm.ops.triton import fused
from pagedllm.ops.triton import linear as ops

# name -> (N, K, gated) of the weights [N, K]; down_proj is gated: its input is SiLU-and-mul of gate_up's output
SHAPES = {"qwen3-0.6b o": (1024, 2048, False), "qwen3-0.6b down": (1024, 3072, True),
          "llama3-8b o": (4096, 4096, False), "llama3-8b down": (4096, 14336, True)}
LAYERS = 28
L2_BYTES = 160 << 20  # weight copies per timed graph: comfortably past the H100's 50 MB L2


def graph_us(fn, calls):
    """Best per-call time over 7 timings of 5 replays of a graph of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    best = float("inf")
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 5 / calls * 1e3)
    return best


def sweep(m, n, k):
    rows = max(16, triton.next_power_of_2(m))
    for bm, bn, bk, split, stages, warps in itertools.product((16, 32, 64, 128), (64, 128), (128, 256), (1, 2, 4, 8),
                                                              (3, 4, 6), (4, 8)):
        if bm > rows or 4 * bm < rows:  # row tiles from a quarter of the rows to all of them
            continue
        if n % bn == 0 and k % (bk * split) == 0 and stages * (bn + bm) * bk * 2 <= 200 << 10:
            yield bm, bn, bk, split, stages, warps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for m in args.m:
        step = {"cublas": 0.0, "op": 0.0}
        for name, (n, k, gated) in SHAPES.items():
            copies = max(2, L2_BYTES // (n * k * 2))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
            x = torch.randn(m, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            norm_w = torch.ones(n, device="cuda", dtype=torch.bfloat16)
            act = fused.silu_and_mul if gated else (lambda t: t)
            exact = (act(x).double() @ ws[0].double().T).float()

            def cublas():  # the layers without the split-K path: SiLU-and-mul (down_proj), GEMM, norm
                for w in ws:
                    fused.rms_norm(torch.nn.functional.linear(act(x), w), norm_w, 1e-6, residual)

            # as ResidualLinear runs them: SiLU-and-mul in the GEMM's loads only for the fewest rows
            in_loads = gated and m <= ops.MAX_GATED_ROWS
            kernel_act = act if gated and not in_loads else (lambda t: t)

            def ours(cfg):
                for w in ws:
                    fused.rms_norm_split_k(ops.split_k_linear(kernel_act(x), w, cfg, in_loads), norm_w, 1e-6, residual)

            t_cublas = graph_us(cublas, copies)
            times = {}
            for cfg in [None, *sweep(m, n, k)]:
                try:
                    err = (ops.split_k_linear(kernel_act(x), ws[0], cfg, in_loads).sum(0) - exact).abs().max().item()
                    times[cfg] = graph_us(lambda: ours(cfg), copies)
                except triton.runtime.errors.OutOfResources:
                    continue
                if err > 1e-3 * exact.abs().max().item():
                    raise AssertionError(f"{name} M={m} config {cfg}: max error {err}")
            t_op = times.pop(None)
            best_cfg = min(times, key=times.get)
            if name.startswith("qwen3"):
                step["cublas"] += LAYERS * t_cublas
                step["op"] += LAYERS * (t_op if m <= ops.MAX_ROWS else t_cublas)
            rows.append(dict(shape=name, m=m, n=n, k=k, cublas_us=t_cublas, op_us=t_op, op_config=ops._config(m, n, k),
                             best_us=times[best_cfg], best_config=best_cfg))
            print(f"{name:16s} M={m:3d} N={n:5d} K={k:5d}  cuBLAS + norm {t_cublas:6.2f} us  split-K + norm "
                  f"{t_op:6.2f} us {ops._config(m, n, k)}  best {times[best_cfg]:6.2f} us {best_cfg}", flush=True)
        print(f"M={m}: Qwen3-0.6B's o + down + their norms over {LAYERS} layers: cuBLAS {step['cublas']:.0f} us, "
              f"as the layers run them (split-K up to {ops.MAX_ROWS} rows) {step['op']:.0f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
