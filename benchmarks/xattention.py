"""XAttention prefill vs dense causal SDPA on one GPU (32 query / 8 kv heads, head 128, bf16, batch 1).

(a) per length and stride: dense SDPA time; XAttention's estimation and sparse-attention times (threshold
    0.9) and the density it chose. Random Q/K have near-uniform attention, so that density says little
    about real prompts: (b) times the sparse attention alone at fixed densities (random masks that keep the
    sink and the diagonal) so the speedup can be read off at the density a real model produces.
Prints markdown tables and writes JSON (date, device, rows) to benchmarks/results/.

    python benchmarks/xattention.py [--lengths 8192 16384 ...] [--out PATH]   (pagedllm installed or on
                                                                              PYTHONPATH)
"""
import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F

from pagedllm.ops import xattention as xa
from pagedllm.ops.xattention import reference as ref

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 128


def bench_ms(fn, reps):
    """Median wall time of fn on the GPU, in ms (one warm-up call, which also compiles)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def random_mask(n, density, seed):
    """Causal block mask with about ``density`` of the visible blocks, sink and diagonal always kept."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-n // BLOCK)
    mask = torch.rand(1, HEADS, blocks, blocks, device="cuda", generator=g) < density
    idx = torch.arange(blocks, device="cuda")
    mask[..., 0] = True
    mask[..., idx, idx] = True
    return mask & ref.visible_blocks(0, blocks, blocks, True, "cuda")


def causal_density(mask):
    blocks = mask.shape[-1]
    return mask.sum().item() / (mask.shape[1] * blocks * (blocks + 1) / 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--strides", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3, 0.5])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    rows_a, rows_b = [], []
    for n in args.lengths:
        reps = 10 if n <= 32768 else 3
        q = torch.randn(1, HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k_rep, v_rep = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        dense = bench_ms(lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True), reps)
        del k_rep, v_rep
        for stride in args.strides:
            mask, density = xa.xattn_estimate(q, k, BLOCK, stride, 0.9)
            est = bench_ms(lambda: xa.xattn_estimate(q, k, BLOCK, stride, 0.9), reps)
            sparse = bench_ms(lambda: xa.block_sparse_attention(q, k, v, mask, BLOCK), reps)
            rows_a.append(dict(seq_len=n, stride=stride, dense_ms=dense, estimate_ms=est, sparse_ms=sparse,
                               density=float(density), speedup=dense / (est + sparse)))
            print(f"{n} stride {stride}: dense {dense:.2f} ms, estimate {est:.2f} ms, sparse {sparse:.2f} ms, "
                  f"density {float(density):.3f}", flush=True)
        est_ms = {r["stride"]: r["estimate_ms"] for r in rows_a if r["seq_len"] == n}
        for d in args.densities:
            mask = random_mask(n, d, seed=n)
            sparse = bench_ms(lambda: xa.block_sparse_attention(q, k, v, mask, BLOCK), reps)
            rows_b.append(dict(seq_len=n, target_density=d, density=causal_density(mask), sparse_ms=sparse,
                               dense_ms=dense, speedup_sparse=dense / sparse,
                               speedup_with_estimate={st: dense / (sparse + t) for st, t in est_ms.items()}))
        del q, k, v
        torch.cuda.empty_cache()

    print(f"\n## XAttention vs dense causal SDPA ({device}, {HEADS}/{KV_HEADS} heads, head {HEAD_DIM}, bf16, "
          f"block {BLOCK}, threshold 0.9, random data)\n")
    print("| seq len | stride | dense SDPA ms | estimate ms | sparse attn ms | density | speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in rows_a:
        print(f"| {r['seq_len']} | {r['stride']} | {r['dense_ms']:.2f} | {r['estimate_ms']:.2f} | "
              f"{r['sparse_ms']:.2f} | {r['density']:.3f} | {r['speedup']:.2f}x |")
    print("\n## Sparse attention at fixed densities (random masks); speedup over dense SDPA of the attention "
          "alone and with each stride's estimate added\n")
    print("| seq len | density | sparse attn ms | dense SDPA ms | speedup (attn) | "
          + " | ".join(f"speedup (+estimate s{st})" for st in args.strides) + " |")
    print("|---|---|---|---|---|" + "---|" * len(args.strides))
    for r in rows_b:
        print(f"| {r['seq_len']} | {r['density']:.3f} | {r['sparse_ms']:.2f} | {r['dense_ms']:.2f} | "
              f"{r['speedup_sparse']:.2f}x | "
              + " | ".join(f"{x:.2f}x" for x in r["speedup_with_estimate"].values()) + " |")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"xattention_{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=device,
                       torch=torch.__version__, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       block_size=BLOCK, threshold=0.9, estimate=rows_a, fixed_density=rows_b), f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
