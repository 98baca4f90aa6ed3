"""Fused elementwise kernels (pagedllm.ops.triton.fused) against the layers' PyTorch code they replace, on
CUDA in bf16: RMSNorm with the residual add, SiLU-and-mul, and RoPE (with Qwen3's per-head q/k RMSNorm at
hidden 1024, Qwen3-0.6B's shapes; plain at hidden 4096, Llama 3 8B's). Time per call from CUDA-graph replays
(as decode steps run) and achieved GB/s of the bytes each op must move at least. The "+cache write" rows set
the RoPE kernel followed by the paged-cache write (two Triton kernels: the "PyTorch" column there) against the
one kernel doing both (bf16 "hnd" cache, block 16). Prints a markdown table; writes JSON to --out, else to
$OUT/fused.json when OUT is set.

    python benchmarks/fused.py [--out FILE]
    python benchmarks/fused.py --cpu-smoke   # tiny shapes under the Triton interpreter: the script runs
"""
import argparse
import datetime
import json
import os
import time

import torch

# hidden -> (intermediate size, q heads, kv heads, head size, per-head q/k norm)
MODELS = {1024: (3072, 16, 8, 128, True), 4096: (14336, 32, 8, 128, False)}
TOKENS = (1, 64, 256, 8192)
SMOKE_MODELS = {64: (96, 4, 2, 32, True)}
SMOKE_TOKENS = (1, 5)


def _ops(hidden, tokens, dtype, device, gen, models):
    """{op name: (PyTorch layer call, fused kernel call, bytes moved)} on fresh random inputs."""
    from pagedllm.layers.activation import SiluAndMul
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.layers.rotary import RotaryEmbedding
    from pagedllm.ops import reference
    from pagedllm.ops import triton as triton_ops
    from pagedllm.ops.triton import fused

    inter, heads, kv_heads, head_size, qk_norm = models[hidden]
    size = torch.finfo(dtype).bits // 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    norm = RMSNorm(hidden).to(device, dtype)
    x, residual = rand(tokens, hidden), rand(tokens, hidden)
    gate_up = rand(tokens, 2 * inter)
    act = SiluAndMul()
    rope = RotaryEmbedding(head_size, 8192, 1e6).to(device)
    norms = (RMSNorm(head_size).to(device, dtype), RMSNorm(head_size).to(device, dtype)) if qk_norm else None
    norm_args = (norms[0].weight, norms[1].weight, norms[0].eps) if qk_norm else None
    positions = torch.randint(0, 8192, (tokens,), generator=gen, device=device)
    q_size, kv_size = heads * head_size, kv_heads * head_size
    q, k, v = rand(tokens, q_size + 2 * kv_size).split([q_size, kv_size, kv_size], dim=-1)
    # RoPE rotates in place, so repeated calls keep working on the same buffers; the values stay bounded.
    rope_bytes = 2 * tokens * (q_size + kv_size) * size + tokens * (head_size * 4 + 8)
    cache_shapes = reference.kv_cache_shapes(tokens // 16 + 1, 16, kv_heads, head_size, dtype, "auto", "hnd")[:2]
    key_cache, value_cache = (torch.zeros(shape, dtype=dtype, device=device) for shape in cache_shapes)
    slots = torch.arange(tokens, device=device)

    def rope_then_cache():
        fused.rotary_embedding(positions, q, k, head_size, rope.cos_sin_cache, norm_args)
        triton_ops.reshape_and_cache(k.view(tokens, kv_heads, head_size), v.view(tokens, kv_heads, head_size),
                                     key_cache, value_cache, slots, "auto", 1.0, 1.0)
    return {
        "add+rmsnorm": (lambda: norm(x, residual), lambda: fused.rms_norm(x, norm.weight, norm.eps, residual),
                        (4 * tokens + 1) * hidden * size),
        "silu_and_mul": (lambda: act(gate_up), lambda: fused.silu_and_mul(gate_up), 3 * tokens * inter * size),
        ("qknorm+rope" if qk_norm else "rope"): (
            lambda: rope(positions, q, k, norms),
            lambda: fused.rotary_embedding(positions, q, k, head_size, rope.cos_sin_cache, norm_args),
            rope_bytes),
        ("qknorm+rope+cache write" if qk_norm else "rope+cache write"): (
            rope_then_cache,
            lambda: fused.rope_and_cache(positions, q, k, v, head_size, rope.cos_sin_cache, norm_args, key_cache,
                                         value_cache, slots, "auto", 1.0, 1.0),
            rope_bytes + 2 * tokens * kv_size * size),
    }


def _time_graph_ms(fn):
    from triton.testing import do_bench_cudagraph
    fn()  # compile outside the capture
    torch.cuda.synchronize()  # do_bench_cudagraph runs on a fresh stream that does not wait for the inputs
    return do_bench_cudagraph(fn, rep=40, return_mode="median")


def _time_cpu_ms(fn, reps=3):
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON file (default: $OUT/fused.json when OUT is set, else none)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny fp16 shapes on CPU under TRITON_INTERPRET=1, to check the script runs")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        device, dtype, models, tokens_list, timer = "cpu", torch.float16, SMOKE_MODELS, SMOKE_TOKENS, _time_cpu_ms
    else:
        device, dtype, models, tokens_list, timer = "cuda", torch.bfloat16, MODELS, TOKENS, _time_graph_ms
    import triton
    from pagedllm.layers.norm import set_fused

    set_fused(False)  # the layers run their PyTorch code: the unfused side
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    print("| op | hidden | tokens | PyTorch us | fused us | speedup | PyTorch GB/s | fused GB/s |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    with torch.inference_mode():
        for hidden in models:
            for tokens in tokens_list:
                for op, (unfused, fused, nbytes) in _ops(hidden, tokens, dtype, device, gen, models).items():
                    ms_unfused, ms_fused = timer(unfused), timer(fused)
                    r = {"op": op, "hidden": hidden, "tokens": tokens, "bytes": nbytes,
                         "pytorch_us": 1e3 * ms_unfused, "fused_us": 1e3 * ms_fused,
                         "pytorch_gbps": nbytes / ms_unfused / 1e6, "fused_gbps": nbytes / ms_fused / 1e6}
                    rows.append(r)
                    print(f"| {op} | {hidden} | {tokens} | {r['pytorch_us']:.1f} | {r['fused_us']:.1f} | "
                          f"{ms_unfused / ms_fused:.2f}x | {r['pytorch_gbps']:.0f} | {r['fused_gbps']:.0f} |",
                          flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    set_fused(None)
    path = args.out or (os.path.join(os.environ["OUT"], "fused.json") if os.environ.get("OUT") else None)
    if path is None:
        return
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"date": now.isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype).removeprefix("torch."),
              "timing": "CUDA-graph replays, median" if device == "cuda" else "wall clock, interpreter",
              "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
