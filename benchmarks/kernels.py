"""Kernel benchmarks on CUDA: paged decode (our Triton v1 / v2 / auto and our CUDA C++ auto, beside dense SDPA)
in achieved TB/s of K+V bytes, and paged prefill in TFLOP/s (with and without a cached prefix) beside dense causal SDPA.
bf16, head 128, block 16, random block tables. The Triton kernels read the engine's "hnd" cache (Triton auto is
also timed on vLLM's layout), the CUDA kernel vLLM's layout. Prints a markdown table; writes JSON to --out.

    python benchmarks/kernels.py [--out benchmarks/results/]
"""
import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

import pagedllm.ops.triton as ops
from pagedllm.ops import reference

DTYPE, HEAD, BLOCK = torch.bfloat16, 128, 16
# (query heads, kv heads, batch, context): DESIGN.md's eight shapes plus two extremes.
DECODE_SHAPES = [(32, 8, 1, 32768), (32, 8, 16, 4096), (32, 8, 64, 1024), (32, 8, 64, 8192), (32, 8, 256, 2048),
                 (32, 32, 1, 32768), (32, 32, 64, 1024), (32, 32, 256, 2048), (32, 8, 1, 131072),
                 (32, 8, 512, 512)]
PREFILL_SHAPES = [(4096, 0), (4096, 2048), (16384, 0), (16384, 8192), (65536, 0), (65536, 32768)]  # (len, cached)


def _time_ms(fn):
    # do_bench flushes L2 before every repetition, so each run streams its K/V from HBM.
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def _time_graph_ms(fn):
    # Decode kernels run for tens of microseconds, less than Python's launch cost: time CUDA-graph
    # replays (as the engine runs decode). No L2 flush here, but every shape's K/V exceeds the 50 MB L2.
    torch.cuda.synchronize()  # do_bench_cudagraph runs on a fresh stream that does not wait for the inputs
    return do_bench_cudagraph(fn, rep=40, return_mode="median")


def _paged_cache(batch, context, kv_heads, gen, layout):
    pages = triton.cdiv(context, BLOCK)
    kshape, vshape, _ = reference.kv_cache_shapes(batch * pages, BLOCK, kv_heads, HEAD, DTYPE, "auto", layout)
    kc = torch.randn(kshape, device="cuda", dtype=DTYPE, generator=gen)
    vc = torch.randn(vshape, device="cuda", dtype=DTYPE, generator=gen)
    tables = torch.randperm(batch * pages, device="cuda", generator=gen).view(batch, pages).to(torch.int32)
    return kc, vc, tables


def _load_cuda_ops():
    """Our CUDA C++ ops, or None (printed why) when they cannot be built here."""
    try:
        from pagedllm.ops import cuda
        cuda.load()
        return cuda
    except ImportError as e:
        print(f"CUDA C++ ops unavailable, no CUDA column: {e}", flush=True)
        return None


def bench_decode(heads, kv_heads, batch, context, gen, cuda_ops):
    q = torch.randn(batch, heads, HEAD, device="cuda", dtype=DTYPE, generator=gen)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    parts = triton.cdiv(context, reference.PARTITION_SIZE)
    ws = (torch.empty(batch, heads, parts, device="cuda"), torch.empty(batch, heads, parts, device="cuda"),
          torch.empty(batch, heads, parts, HEAD, device="cuda", dtype=DTYPE))
    times = {}
    for layout in ("hnd", "vllm"):
        kc, vc, tables = _paged_cache(batch, context, kv_heads, gen, layout)
        args = (q, kc, vc, kv_heads, HEAD ** -0.5, tables, lens, BLOCK, context, None, "auto", 1.0, 1.0)
        if layout == "hnd":
            times["v1"] = _time_graph_ms(lambda: ops.paged_attention_v1(out, *args))
            times["v2"] = _time_graph_ms(lambda: ops.paged_attention_v2(out, *ws, *args))
            times["auto"] = _time_graph_ms(lambda: ops.paged_attention(out, *args))
        else:
            times["auto_vllm_layout"] = _time_graph_ms(lambda: ops.paged_attention(out, *args))
            if cuda_ops is not None:
                times["cuda"] = _time_graph_ms(lambda: cuda_ops.paged_attention(out, *args))
        del kc, vc
    k = torch.randn(batch, kv_heads, context, HEAD, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)
    times["sdpa"] = _time_graph_ms(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
    kv_bytes = 2 * batch * context * kv_heads * HEAD * 2
    return {"shape": f"{heads}/{kv_heads}, {batch} x {context}", "kv_bytes": kv_bytes,
            **{f"{n}_ms": t for n, t in times.items()}, **{f"{n}_tbps": kv_bytes / t / 1e9 for n, t in times.items()}}


def prefill_flops(length, cached, heads):
    """Causal: the query at position p sees p + 1 keys; 2 matmuls x 2 flops per multiply-add."""
    return 4 * heads * HEAD * (length * (length + 1) - cached * (cached + 1)) // 2


def bench_prefill(length, cached, gen, heads=32, kv_heads=8):
    new = length - cached
    kc, vc, tables = _paged_cache(1, length, kv_heads, gen, "hnd")
    q = torch.randn(new, heads, HEAD, device="cuda", dtype=DTYPE, generator=gen)
    out = torch.empty_like(q)
    lens = torch.tensor([length], device="cuda", dtype=torch.int32)
    qsl = torch.tensor([0, new], device="cuda", dtype=torch.int32)
    args = (q, kc, vc, kv_heads, HEAD ** -0.5, tables, lens, qsl, new, length, None, "auto", 1.0, 1.0)
    ms = _time_ms(lambda: ops.paged_prefill(out, *args))
    flops = prefill_flops(length, cached, heads)
    row = {"shape": f"{heads}/{kv_heads}, {length} tokens, {cached} cached", "ours_ms": ms,
           "ours_tflops": flops / ms / 1e9}
    del kc, vc
    if cached == 0:  # dense causal SDPA only has a like-for-like case without a prefix
        qd = torch.randn(1, heads, length, HEAD, device="cuda", dtype=DTYPE, generator=gen)
        kd = torch.randn_like(qd)
        vd = torch.randn_like(qd)
        sdpa = _time_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True))
        row.update(sdpa_ms=sdpa, sdpa_tflops=flops / sdpa / 1e9)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                        help="JSON file, or a directory to write kernels_<date>.json into")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cuda_ops = _load_cuda_ops()
    decode = []
    print("| decode shape (q/kv heads, batch x context) | Triton v1 TB/s | Triton v2 TB/s | Triton auto TB/s |"
          " Triton auto, vLLM layout TB/s | CUDA auto TB/s | dense SDPA TB/s | Triton auto us |"
          "\n|---|---|---|---|---|---|---|---|", flush=True)
    for shape in DECODE_SHAPES:
        r = bench_decode(*shape, gen, cuda_ops)
        decode.append(r)
        cuda = f"{r['cuda_tbps']:.2f}" if "cuda_tbps" in r else "-"
        print(f"| {r['shape']} | {r['v1_tbps']:.2f} | {r['v2_tbps']:.2f} | {r['auto_tbps']:.2f} | "
              f"{r['auto_vllm_layout_tbps']:.2f} | {cuda} | "
              f"{r['sdpa_tbps']:.2f} | {1000 * r['auto_ms']:.1f} |", flush=True)
        torch.cuda.empty_cache()
    prefill = []
    print("\n| prefill (q/kv heads, prompt, cached prefix) | ours TFLOP/s | dense causal SDPA TFLOP/s | ours ms |"
          "\n|---|---|---|---|", flush=True)
    for length, cached in PREFILL_SHAPES:
        r = bench_prefill(length, cached, gen)
        prefill.append(r)
        sdpa = f"{r['sdpa_tflops']:.0f}" if "sdpa_tflops" in r else "-"
        print(f"| {r['shape']} | {r['ours_tflops']:.0f} | {sdpa} | {r['ours_ms']:.2f} |", flush=True)
        torch.cuda.empty_cache()
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"date": now.isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "dtype": "bfloat16", "head_size": HEAD,
              "block_size": BLOCK, "triton_cache_layout": "hnd", "decode": decode, "prefill": prefill}
    path = args.out
    if os.path.isdir(path) or path.endswith(os.sep):
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, f"kernels_{now:%Y%m%d_%H%M%S}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
