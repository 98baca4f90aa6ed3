"""Launch-configuration sweep of the Triton paged decode and prefill kernels on CUDA, for both cache layouts:
the measurements behind `decode._config`, `decode.split_plan` and `prefill._config`.

Decode: for every shape of benchmarks/kernels.py, each (BLOCK_N, num_warps, num_stages) with the split
`split_plan` picks, then the best tile with every partition size. Prefill: each (BLOCK_M, BLOCK_N, warps,
stages) at 16K new tokens, then the best at every prefill shape. Prints markdown; JSON to --out.
`--small` sweeps only the partition size of short, small-batch decodes (the latency-bound end of
`pagedllm bench latency`). `--workload` sweeps the shapes of the throughput benchmark's workload instead
(Qwen3-0.6B heads): ragged decode batches in the order rows arrive and longest first, and the 8192-token
prefill chunk of short prompts: the measurements behind the engine's row order and the short-sequence tile
of `prefill._config`. `--profile decode|prefill` instead runs one shape a few times for Nsight Compute.

    python benchmarks/triton_tuning.py --out sweep.json
    ncu --clock-control none -k regex:_decode_kernel -s 3 -c 1 python benchmarks/triton_tuning.py --profile decode
"""
import argparse
import datetime
import json
import os
import random
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import (BLOCK, DECODE_SHAPES, DTYPE, HEAD, PREFILL_SHAPES, _paged_cache,  # noqa: E402
                     _time_graph_ms, _time_ms, prefill_flops)

from pagedllm.ops.reference import KV_CACHE_LAYOUTS  # noqa: E402
from pagedllm.ops.triton import _host, decode, prefill  # noqa: E402

DECODE_TILES = [(32, 2, 3), (32, 4, 3), (64, 2, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3),
                (128, 4, 3), (128, 8, 2), (128, 8, 3)]  # (BLOCK_N, num_warps, num_stages)
PART_TOKENS = [0, 256, 512, 1024, 2048, 4096]  # 0: single pass
SMALL_DECODE_SHAPES = [(16, 8, b, 1024) for b in (1, 4, 16, 64)]  # Qwen3-0.6B's heads at its bench context
SMALL_PART_TOKENS = [0, 128, 256, 512, 1024]
PREFILL_TILES = [(64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 4, 4),
                 (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 3)]  # (M, N, warps, stages)


def _decode_runner(heads, kv_heads, batch, context, layout, gen):
    kc, vc, tables = _paged_cache(batch, context, kv_heads, gen, layout)
    q = torch.randn(batch, heads, HEAD, device="cuda", dtype=DTYPE, generator=gen)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)

    def run(block_n, warps, stages, part_tokens=None):
        """part_tokens None: split_plan's choice; 0: single pass; else partitions of that many tokens."""
        if part_tokens is None:
            parts, part_tokens = decode.split_plan(batch, kv_heads, context, block_n, _host.num_sms(q.device))
        elif part_tokens == 0:
            parts, part_tokens = 1, triton.cdiv(context, block_n) * block_n
        else:
            parts = triton.cdiv(context, part_tokens)
        partials = None
        if parts > 1:
            stats = torch.empty((2, batch, heads, parts), dtype=torch.float32, device="cuda")
            tmp = torch.empty((batch, heads, parts, HEAD), dtype=torch.float32, device="cuda")
            partials = (stats[0], stats[1], tmp)
        return lambda: decode._launch(out, partials, q, kc, vc, kv_heads, HEAD ** -0.5, tables, lens, BLOCK, None,
                                      "auto", 1.0, 1.0, parts, part_tokens, block_n, warps, stages)
    return run, 2 * batch * context * kv_heads * HEAD * DTYPE.itemsize


def sweep_decode():
    rows = []
    for shape in DECODE_SHAPES:
        for layout in KV_CACHE_LAYOUTS:
            run, kv_bytes = _decode_runner(*shape, layout, torch.Generator(device="cuda").manual_seed(0))
            tiles = {t: _time_graph_ms(run(*t)) for t in DECODE_TILES}
            best = min(tiles, key=tiles.get)
            splits = {p: _time_graph_ms(run(*best, p)) for p in PART_TOKENS if p == 0 or p < shape[3]}
            best_split = min(splits, key=splits.get)
            row = {"shape": list(shape), "layout": layout,
                   "tiles_tbps": {str(t): kv_bytes / ms / 1e9 for t, ms in tiles.items()},
                   "best_tile": list(best), "split_tbps": {str(p): kv_bytes / ms / 1e9 for p, ms in splits.items()},
                   "best_part_tokens": best_split, "best_tbps": kv_bytes / splits[best_split] / 1e9}
            rows.append(row)
            print(f"| {shape} | {layout} | {row['tiles_tbps'][str(DECODE_TILES[4])]:.2f} | {best} "
                  f"{row['tiles_tbps'][str(best)]:.2f} | {best_split} {row['best_tbps']:.2f} |", flush=True)
            torch.cuda.empty_cache()
    return rows


def sweep_small_decode():
    """Partition sizes of short small-batch decodes at the configured tile, where launch and per-program
    latency, not bandwidth, set the time."""
    rows = []
    tile = decode._config(torch.empty(1, device="cuda"), HEAD, BLOCK)
    for shape in SMALL_DECODE_SHAPES:
        run, kv_bytes = _decode_runner(*shape, "hnd", torch.Generator(device="cuda").manual_seed(0))
        us = {p: 1e3 * _time_graph_ms(run(*tile, p)) for p in SMALL_PART_TOKENS if p < shape[3]}
        auto = 1e3 * _time_graph_ms(run(*tile))
        rows.append({"shape": list(shape), "tile": list(tile), "split_us": {str(p): t for p, t in us.items()},
                     "auto_us": auto})
        print(f"| {shape} | {auto:.1f} | " + " | ".join(f"{p}: {t:.1f}" for p, t in us.items()) + " |", flush=True)
    return rows


def _prefill_runner(length, cached, layout, gen, heads=32, kv_heads=8):
    new = length - cached
    kc, vc, tables = _paged_cache(1, length, kv_heads, gen, layout)
    q = torch.randn(new, heads, HEAD, device="cuda", dtype=DTYPE, generator=gen)
    out = torch.empty_like(q)
    lens = torch.tensor([length], device="cuda", dtype=torch.int32)
    qsl = torch.tensor([0, new], device="cuda", dtype=torch.int32)
    args = (q, kc, vc, kv_heads, HEAD ** -0.5, tables, lens, qsl, new, length, None, "auto", 1.0, 1.0)
    return (lambda cfg: lambda: prefill.paged_prefill(out, *args, config=cfg)), prefill_flops(length, cached, heads)


def sweep_prefill():
    rows = []
    for layout in KV_CACHE_LAYOUTS:
        run, flops = _prefill_runner(16384, 0, layout, torch.Generator(device="cuda").manual_seed(0))
        tiles = {t: flops / _time_ms(run(t)) / 1e9 for t in PREFILL_TILES}
        best = max(tiles, key=tiles.get)
        print(f"prefill 16K {layout}: " + ", ".join(f"{t}: {v:.0f}" for t, v in tiles.items()), flush=True)
        for length, cached in PREFILL_SHAPES:
            run, flops = _prefill_runner(length, cached, layout, torch.Generator(device="cuda").manual_seed(0))
            default = flops / _time_ms(run(None)) / 1e9
            tuned = flops / _time_ms(run(best)) / 1e9
            rows.append({"layout": layout, "length": length, "cached": cached, "default_tflops": default,
                         "best_tile": list(best), "best_tflops": tuned,
                         "tiles_16k_tflops": {str(t): v for t, v in tiles.items()}})
            print(f"| {length} | {cached} | {layout} | {default:.0f} | {best} {tuned:.0f} |", flush=True)
            torch.cuda.empty_cache()
    return rows


WORKLOAD_DECODE = [(256, 100, 2048), (128, 100, 2048), (64, 300, 2048)]  # (batch, shortest, longest context)
WORKLOAD_DECODE_TILES = [(64, 2, 3), (32, 2, 3), (64, 2, 2), (64, 4, 3)]
WORKLOAD_PREFILL = [(100, 1024), (1000, 4000)]  # prompt lengths of an 8192-token chunk
WORKLOAD_PREFILL_TILES = [None, (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 128, 8, 3)]


def _ragged_cache(lens, kv_heads, gen):
    """hnd caches holding one sequence per length, and the block table (pages numbered in order)."""
    pages = [triton.cdiv(n, BLOCK) for n in lens]
    kc, vc, _ = _paged_cache(1, BLOCK * sum(pages), kv_heads, gen, "hnd")
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    start = 0
    for i, p in enumerate(pages):
        table[i, :p] = torch.arange(start, start + p, device="cuda")
        start += p
    return kc, vc, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def sweep_workload(heads=16, kv_heads=8):
    rng, gen = random.Random(0), torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, lo, hi in WORKLOAD_DECODE:
        arrival = [rng.randint(lo, hi) for _ in range(batch)]
        for order, lens in (("arrival", arrival), ("longest first", sorted(arrival, reverse=True))):
            kc, vc, table, seq_lens = _ragged_cache(lens, kv_heads, gen)
            q = torch.randn(batch, heads, HEAD, device="cuda", dtype=DTYPE, generator=gen)
            out = torch.empty_like(q)
            tbps = {}
            for block_n, warps, stages in WORKLOAD_DECODE_TILES:
                part_tokens = triton.cdiv(hi, block_n) * block_n  # single pass, what split_plan picks here
                ms = _time_graph_ms(lambda: decode._launch(
                    out, None, q, kc, vc, kv_heads, HEAD ** -0.5, table, seq_lens, BLOCK, None, "auto", 1.0, 1.0,
                    1, part_tokens, block_n, warps, stages))
                tbps[str((block_n, warps, stages))] = 4 * sum(lens) * kv_heads * HEAD / ms / 1e9
            rows.append({"kind": "decode", "batch": batch, "lengths": [lo, hi], "order": order, "tbps": tbps})
            print(f"| decode {batch} x [{lo}, {hi}] | {order} | "
                  + " | ".join(f"{t}: {v:.2f}" for t, v in tbps.items()) + " |", flush=True)
    for lo, hi in WORKLOAD_PREFILL:
        lens = []
        while sum(lens) < 8192:
            lens.append(rng.randint(lo, hi))
        lens[-1] -= sum(lens) - 8192
        kc, vc, table, seq_lens = _ragged_cache(lens, kv_heads, gen)
        q = torch.randn(8192, heads, HEAD, device="cuda", dtype=DTYPE, generator=gen)
        out = torch.empty_like(q)
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        flops = sum(prefill_flops(n, 0, heads) for n in lens)
        tflops = {str(cfg): flops / _time_graph_ms(lambda: prefill.paged_prefill(
            out, q, kc, vc, kv_heads, HEAD ** -0.5, table, seq_lens, starts, max(lens), max(lens), None, "auto",
            1.0, 1.0, config=cfg)) / 1e9 for cfg in WORKLOAD_PREFILL_TILES}
        rows.append({"kind": "prefill", "prompts": [lo, hi], "num_prompts": len(lens), "tflops": tflops})
        print(f"| prefill 8192 of [{lo}, {hi}] | {len(lens)} prompts | "
              + " | ".join(f"{t}: {v:.0f}" for t, v in tflops.items()) + " |", flush=True)
    return rows


def profile(kind, layout):
    gen = torch.Generator(device="cuda").manual_seed(0)
    if kind == "decode":
        run, _ = _decode_runner(32, 8, 64, 8192, layout, gen)
        fn = run(*decode._config(torch.empty(1, device="cuda"), HEAD, BLOCK))
    else:
        run, _ = _prefill_runner(16384, 0, layout, gen)
        fn = run(None)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="triton_tuning.json")
    parser.add_argument("--profile", choices=["decode", "prefill"])
    parser.add_argument("--layout", choices=KV_CACHE_LAYOUTS, default="hnd")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--workload", action="store_true")
    args = parser.parse_args()
    if args.profile:
        return profile(args.profile, args.layout)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"date": now.isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__}
    if args.workload:
        print("| shape | order | TB/s (decode) or TFLOP/s (prefill) per tile (None: prefill._config) |\n|---|---|---|",
              flush=True)
        with open(args.out, "w") as f:
            json.dump({**meta, "workload": sweep_workload()}, f, indent=1)
        return print(f"wrote {args.out}")
    if args.small:
        print("| decode shape | auto us | us per partition size (0: single pass) |\n|---|---|---|", flush=True)
        with open(args.out, "w") as f:
            json.dump({**meta, "small_decode": sweep_small_decode()}, f, indent=1)
        return print(f"wrote {args.out}")
    print(f"| decode shape | layout | TB/s at {DECODE_TILES[4]} | best tile, TB/s | best partition, TB/s |\n"
          "|---|---|---|---|---|", flush=True)
    decode_rows = sweep_decode()
    print("\n| prefill tokens | cached | layout | default TFLOP/s | best tile, TFLOP/s |\n|---|---|---|---|---|")
    prefill_rows = sweep_prefill()
    with open(args.out, "w") as f:
        json.dump({**meta, "decode": decode_rows, "prefill": prefill_rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
