"""Can a Triton GEMM beat cuBLAS on the decode step's linear layers? Times torch.nn.functional.linear
(cuBLAS) against a plain Triton GEMM (optional split-K through an fp32 workspace) swept over tile sizes, for
Qwen3-0.6B's projections and LM head at decode batch sizes, both in CUDA-graph replays (as decode steps run
them). Prints one line per (shape, M) with the best Triton config, and per M the sum over a step
(28 layers + LM head). Answer on the H100 (results/gemm_probe*_h100_20261122.log): no.

    python benchmarks/gemm_probe.py [--m 1 8 16 64 128 256]
"""
import argparse
import itertools

import torch
import triton
import triton.language as tl

# name -> (N, K) of Qwen3-0.6B's weights [N, K]
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}
LAYERS = 28


@triton.jit
def _gemm(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_per = K // SPLIT_K
    for k in range(pid_k * k_per, (pid_k + 1) * k_per, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :])
        acc += tl.dot(x, tl.trans(w))
    ptrs = y_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)


def triton_linear(x, w, cfg, workspace, out):
    bm, bn, bk, split, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0]
    y = out if split == 1 else workspace[:split * M * N].view(split, M, N)
    _gemm[(triton.cdiv(M, bm), N // bn, split)](x, w, y, M, N, K, x.stride(0), w.stride(0), BLOCK_M=bm,
                                               BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                                               num_stages=stages)
    return out if split == 1 else torch.sum(y, 0, out=out.float()).to(out.dtype)


def graph_us(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 64, 128, 256])
    args = parser.parse_args()
    workspace = torch.empty(4 * max(args.m) * SHAPES["lm_head"][0], device="cuda", dtype=torch.float32)
    for M in args.m:
        total_cublas = total_triton = 0.0
        for name, (N, K) in SHAPES.items():
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 32
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, w)
            t_cublas = graph_us(lambda: torch.nn.functional.linear(x, w))
            best = None
            for cfg in itertools.product((16, 64, 128), (16, 32, 64, 128), (64, 128, 256), (1, 2, 4), (4, 8), (3,)):
                bm, bn, bk, split = cfg[:4]
                if bm > max(M, 16) or N % bn or K % (bk * split) or (name == "lm_head" and split > 1):
                    continue
                try:
                    err = (triton_linear(x, w, cfg, workspace, out).float() - ref.float()).abs().max().item()
                    t = graph_us(lambda: triton_linear(x, w, cfg, workspace, out))
                except Exception:  # a config the compiler rejects (shared memory) is simply skipped
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            times = LAYERS if name != "lm_head" else 1
            total_cublas += t_cublas * times
            total_triton += best[0] * times
            print(f"{name:8s} M={M:3d} N={N:6d} K={K:5d}  cublas {t_cublas:7.2f} us  triton {best[0]:7.2f} us "
                  f"cfg {best[1]} max err {best[2]:.3g}", flush=True)
        print(f"M={M}: per step ({LAYERS} layers + lm_head) cublas {total_cublas:.0f} us, "
              f"best triton {total_triton:.0f} us", flush=True)


if __name__ == "__main__":
    main()
