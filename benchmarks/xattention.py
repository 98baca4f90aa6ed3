"""XAttention prefill vs dense causal SDPA on one GPU (batch 1, bf16, block 128).

(a) Random Q/K/V, 32 query / 8 kv heads, head 128, per length and stride: dense SDPA time; XAttention's
    estimation (block selection included) and sparse-attention times at threshold 0.9, and the density it
    chose; --selections per-head per-kv-head also times the selection shared by a kv head's query heads
    (share_kv_heads), here and in (c). Random Q/K attend almost uniformly, so that density says nothing about
    real prompts. --fp8-estimate: every estimate (here and in (c)) scores fp8 Q and K (``fp8_estimate``).
(b) The sparse attention alone at fixed densities (random masks that keep the sink and the diagonal), same
    shapes, so the speed-up can be read off at the density a real model produces. --head-masks picks how the
    query heads' masks relate: drawn per query head ("independent", the default) or per kv head and shared
    by its query heads ("group"). Real heads of a group largely agree, and the kernel runs them side by side,
    so their K/V blocks come from the L2: the two bracket the reuse real masks give. Each row also prints the
    K/V bytes of its visited blocks over its time, as if no block were read twice: near the HBM's ~3 TB/s the
    kernel is bound by reading K/V, not by its arithmetic.
(c) Real data: SmolLM2-135M-Instruct (9 query / 3 kv heads, head 64, 30 layers) prefills the first N tokens
    of the Python language reference (the text and Q/K/V capture of benchmarks/xattention_fidelity.py);
    its per-layer Q/K/V (after RoPE) are replayed per stride and threshold: the density XAttention picks
    per layer and overall, and estimate + sparse attention vs dense causal SDPA summed over all layers.
    SmolLM2's context is 8K, so real densities exist here for 2K-8K only: the script prints how they move
    with length and which (b) rows they point at; 64K/128K on real data is not measured.
Dense SDPA gets K/V already repeated to the query heads (outside the timing), the fastest dense baseline. Each op
is timed in its own steady state, dense SDPA and the XAttention calls of a length taking turns (bench_many); (a)
also times the estimate and the sparse attention in one call, as a prefill runs them.
Prints markdown tables and writes one JSON (date, device, versions, all rows) to --out: a .json path, or a
directory (default benchmarks/results/) that receives xattention_<date>.json.

    python benchmarks/xattention.py [--sections a b c] [--out DIR_OR_FILE]   (pagedllm installed or on
                                                                             PYTHONPATH)
    python benchmarks/xattention.py --cpu-smoke --out /tmp/x   (every section tiny, on CPU, reference ops)
"""
import argparse
import datetime
import functools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xattention_fidelity import MODEL, TEXT_SOURCE, captured_qkv, load_text_model, prefill_hidden  # noqa: E402

from pagedllm.ops import xattention as xa  # noqa: E402
from pagedllm.ops.xattention import reference as ref  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 128
THRESHOLD = 0.9  # section (a)'s
SELECTION = {False: "per-head", True: "per-kv-head"}  # share_kv_heads
LENGTHS = [8192, 16384, 32768, 65536, 131072]
TEXT_LENGTHS = [2048, 4096, 8192]
SMOKE_LENGTHS = [512, 1024]
SMOKE_LAYERS = 4  # reference ops on CPU: a few layers exercise every code path


def bench_many(fns, reps, device, rounds=2, warm_ms=200):
    """Median time in ms of each function of the dict fns, on the GPU by CUDA events. Each is timed in its own
    steady state, as triton.testing.do_bench times: ~warm_ms of calls first (one on the CPU), then ``reps``
    timed calls back to back. The functions take turns, ``rounds`` times over, and each median is over all its
    rounds. On the H100 long calls run into the 700 W power cap (dense SDPA at 128K at 1.3-1.7 GHz instead of
    1.98): a call timed right after another function's heavy calls starts at the clock they left."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            until = time.perf_counter() + (warm_ms / 1e3 if device.type == "cuda" else 0)
            fn()
            _sync(device)
            while time.perf_counter() < until:
                fn()
                _sync(device)
            for _ in range(reps):
                if device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    torch.cuda.synchronize()
                    times[name].append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, reps, device):
    return bench_many({"fn": fn}, reps, device, rounds=1)["fn"]


def repetitions(n, smoke):
    """Timed calls per measurement at length n: few at long lengths (128K dense SDPA is ~0.25 s a call)."""
    if smoke:
        return 2
    return 10 if n <= 32768 else 3


def random_mask(n, density, seed, device, head_masks="independent"):
    """Causal block mask with about ``density`` of the visible blocks, sink and diagonal always kept; one draw per
    query head ("independent") or per kv head, shared by its query heads ("group")."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = -(-n // BLOCK)
    draws = HEADS if head_masks == "independent" else KV_HEADS
    mask = torch.rand(1, draws, blocks, blocks, device=device, generator=g) < density
    mask = mask.repeat_interleave(HEADS // draws, 1)
    idx = torch.arange(blocks, device=device)
    mask[..., 0] = True
    mask[..., idx, idx] = True
    return mask & ref.visible_blocks(0, blocks, blocks, True, device)


def causal_density(mask):
    blocks = mask.shape[-1]
    return mask.sum().item() / (mask.shape[1] * blocks * (blocks + 1) / 2)


def kv_bytes(mask):
    """Bytes of K and V (bf16) the mask's visited blocks hold, each (query head, block pair) counted once."""
    return mask.sum().item() * BLOCK * HEAD_DIM * 2 * 2


def random_data_rows(estimate, lengths, strides, selections, densities, head_masks, sections, reps, device, dtype):
    """Rows of sections (a) and (b) on random Q/K/V of the 32/8-head, head-128 shape; ``estimate`` is
    xattn_estimate with the run's options. Per length, dense SDPA and the XAttention calls take turns
    (bench_many)."""
    rows_a, rows_b = [], []
    for n in lengths:
        q = torch.randn(1, HEADS, n, HEAD_DIM, device=device, dtype=dtype)
        k = torch.randn(1, KV_HEADS, n, HEAD_DIM, device=device, dtype=dtype)
        v = torch.randn_like(k)
        k_rep, v_rep = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        fns = {"dense": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)}
        # (b) adds each stride's estimate time, so (a) runs whenever (b) does
        configs = [(st, sh) for st in strides for sh in selections]
        density = {}
        for stride, share in configs:
            est = functools.partial(estimate, q, k, BLOCK, stride, THRESHOLD, share_kv_heads=share)
            mask, density[stride, share] = est()
            fns["estimate", stride, share] = est
            fns["sparse", stride, share] = functools.partial(xa.block_sparse_attention, q, k, v, mask, BLOCK)
            # both in one call, as a prefill runs them: the host prepares the attention while the estimate's
            # kernels run
            fns["together", stride, share] = lambda est=est: xa.block_sparse_attention(q, k, v, est()[0], BLOCK)
        b_masks = {}
        if "b" in sections:
            for d, kind in ((d, kind) for d in densities for kind in head_masks):
                b_masks[d, kind] = random_mask(n, d, seed=n, device=device, head_masks=kind)
                fns["b", d, kind] = functools.partial(xa.block_sparse_attention, q, k, v, b_masks[d, kind], BLOCK)
        t = bench_many(fns, reps(n), device)
        dense = t["dense"]
        for stride, share in configs:
            est, sparse, both = (t[name, stride, share] for name in ("estimate", "sparse", "together"))
            rows_a.append(dict(seq_len=n, stride=stride, share_kv_heads=share, dense_ms=dense, estimate_ms=est,
                               sparse_ms=sparse, density=float(density[stride, share]), speedup=dense / (est + sparse),
                               together_ms=both, speedup_together=dense / both))
            print(f"(a) {n} stride {stride} {SELECTION[share]}: dense {dense:.2f} ms, estimate {est:.2f} ms, "
                  f"sparse {sparse:.2f} ms, together {both:.2f} ms, density {float(density[stride, share]):.3f}",
                  flush=True)
        est_ms = {st: t["estimate", st, selections[0]] for st in strides}  # (b) adds the first selection's
        for (d, kind), mask in b_masks.items():
            sparse = t["b", d, kind]
            rows_b.append(dict(seq_len=n, target_density=d, head_masks=kind, density=causal_density(mask),
                               sparse_ms=sparse, kv_tb_per_s=kv_bytes(mask) / sparse / 1e9,
                               dense_ms=dense, speedup_sparse=dense / sparse,
                               speedup_with_estimate={st: dense / (sparse + e) for st, e in est_ms.items()}))
        q = k = v = k_rep = v_rep = mask = fns = b_masks = None  # free this length's tensors before the next one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows_a, rows_b


def real_data_rows(estimate, lengths, strides, selections, thresholds, max_layers, reps, device, dtype):
    """Section (c): ``(shape, rows)``, one row per (length, stride, threshold), times summed over layers."""
    model, _, ids = load_text_model(dtype, device)
    rows, shape = [], None
    for n in lengths:
        with captured_qkv(model) as qkv:
            prefill_hidden(model, ids[:n], None)
        qkv = qkv[:max_layers]
        q0, k0 = qkv[0][0], qkv[0][1]
        shape = dict(heads=q0.shape[1], kv_heads=k0.shape[1], head_dim=q0.shape[3], layers=len(qkv))
        group = shape["heads"] // shape["kv_heads"]
        rep = [(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for q, k, v in qkv]
        dense = bench_ms(lambda: [F.scaled_dot_product_attention(*x, is_causal=True) for x in rep], reps(n), device)
        for stride, share in ((st, sh) for st in strides for sh in selections):
            for thr in thresholds:
                picks = [estimate(q, k, BLOCK, stride, thr, share_kv_heads=share) for q, k, _ in qkv]
                est = bench_ms(lambda: [estimate(q, k, BLOCK, stride, thr, share_kv_heads=share) for q, k, _ in qkv],
                               reps(n), device)
                sparse = bench_ms(lambda: [xa.block_sparse_attention(q, k, v, mask, BLOCK)
                                           for (q, k, v), (mask, _) in zip(qkv, picks)], reps(n), device)
                # every layer has the same heads and blocks, so the overall density is the layers' mean
                layer_density = [float(d) for _, d in picks]
                density = sum(layer_density) / len(layer_density)
                rows.append(dict(seq_len=n, stride=stride, share_kv_heads=share, threshold=thr, density=density,
                                 layer_density=layer_density, dense_ms=dense, estimate_ms=est, sparse_ms=sparse,
                                 speedup=dense / (est + sparse)))
                print(f"(c) {n} stride {stride} {SELECTION[share]} threshold {thr}: density {density:.3f} (layers "
                      f"{min(layer_density):.3f}-{max(layer_density):.3f}), dense {dense:.2f} ms, estimate "
                      f"{est:.2f} ms, sparse {sparse:.2f} ms", flush=True)
    return shape, rows


def print_random_tables(rows_a, rows_b, strides, device_name, dtype, estimate_name):
    if rows_a:
        print(f"\n## (a) XAttention vs dense causal SDPA ({device_name}, {HEADS}/{KV_HEADS} heads, head "
              f"{HEAD_DIM}, {dtype}, block {BLOCK}, threshold {THRESHOLD}, {estimate_name}, random data)\n")
        print("| seq len | stride | selection | dense SDPA ms | estimate ms | sparse attn ms | density | speedup | "
              "both in one call ms | its speedup |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows_a:
            print(f"| {r['seq_len']} | {r['stride']} | {SELECTION[r['share_kv_heads']]} | {r['dense_ms']:.2f} | "
                  f"{r['estimate_ms']:.2f} | {r['sparse_ms']:.2f} | {r['density']:.3f} | {r['speedup']:.2f}x | "
                  f"{r['together_ms']:.2f} | {r['speedup_together']:.2f}x |")
    if rows_b:
        print("\n## (b) Sparse attention at fixed densities (random masks); speedup over dense SDPA of the "
              "attention alone and with each stride's estimate (from (a)) added\n")
        print("| seq len | head masks | density | sparse attn ms | K/V TB/s, no reuse | dense SDPA ms | "
              "speedup (attn) | " + " | ".join(f"speedup (+estimate s{st})" for st in strides) + " |")
        print("|---|---|---|---|---|---|---|" + "---|" * len(strides))
        for r in rows_b:
            print(f"| {r['seq_len']} | {r['head_masks']} | {r['density']:.3f} | {r['sparse_ms']:.2f} | "
                  f"{r['kv_tb_per_s']:.2f} | {r['dense_ms']:.2f} | {r['speedup_sparse']:.2f}x | "
                  + " | ".join(f"{x:.2f}x" for x in r["speedup_with_estimate"].values()) + " |")


def print_real_tables(shape, rows_c, rows_b, device_name, dtype, estimate_name):
    lengths = sorted({r["seq_len"] for r in rows_c})
    configs = list(dict.fromkeys((r["stride"], r["share_kv_heads"], r["threshold"]) for r in rows_c))
    by_key = {(r["seq_len"], r["stride"], r["share_kv_heads"], r["threshold"]): r for r in rows_c}
    print(f"\n## (c) Real data: {MODEL} ({shape['heads']} query / {shape['kv_heads']} kv heads, head "
          f"{shape['head_dim']}, {shape['layers']} layers; {device_name}, {dtype}, block {BLOCK}, "
          f"{estimate_name}); times summed over the layers\n\nText: {TEXT_SOURCE}, the first N tokens.\n")
    print("| seq len | stride | selection | threshold | density | dense SDPA ms | estimate ms | sparse attn ms | "
          "speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows_c:
        print(f"| {r['seq_len']} | {r['stride']} | {SELECTION[r['share_kv_heads']]} | {r['threshold']} | "
              f"{r['density']:.3f} | {r['dense_ms']:.2f} | {r['estimate_ms']:.2f} | {r['sparse_ms']:.2f} | "
              f"{r['speedup']:.2f}x |")
    print("\n### Density vs length (kept fraction of the causal blocks, all layers)\n")
    print("| stride | selection | threshold | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---|---|---|" + "---|" * len(lengths))
    for st, sh, thr in configs:
        print(f"| {st} | {SELECTION[sh]} | {thr} | "
              + " | ".join(f"{by_key[n, st, sh, thr]['density']:.3f}" for n in lengths) + " |")
    print("\n### Density per layer\n")
    cols = [(n, *c) for n in lengths for c in configs]
    print("| layer | " + " | ".join(f"{n} s{st}{' kv' if sh else ''} t{thr}" for n, st, sh, thr in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for layer in range(shape["layers"]):
        print(f"| {layer} | " + " | ".join(f"{by_key[c]['layer_density'][layer]:.3f}" for c in cols) + " |")
    if rows_b:
        # The speed at a real density on long prompts, as far as it can be read without long real data: the
        # (b) row whose fixed density is nearest the density measured at the longest text length.
        longest = lengths[-1]
        b_lengths = sorted({r["seq_len"] for r in rows_b})
        print(f"\n### Curve (b) read at the real density of {longest} tokens: speedup with estimate (fixed density "
              "used). Random masks, not a measurement on real data; the density at these lengths is unknown "
              "(see its trend with length above)\n")
        print("| stride | selection | threshold | head masks | density at " + f"{longest} | "
              + " | ".join(str(n) for n in b_lengths) + " |")
        print("|---|---|---|---|---|" + "---|" * len(b_lengths))
        for (st, sh, thr), kind in ((c, kind) for c in configs for kind in sorted({r["head_masks"] for r in rows_b})):
            d = by_key[longest, st, sh, thr]["density"]
            cells = []
            for n in b_lengths:
                near = min((r for r in rows_b if r["seq_len"] == n and r["head_masks"] == kind),
                           key=lambda r: abs(r["density"] - d))
                cells.append(f"{near['speedup_with_estimate'][st]:.2f}x ({near['density']:.2f})")
            print(f"| {st} | {SELECTION[sh]} | {thr} | {kind} | {d:.3f} | " + " | ".join(cells) + " |")


def out_path(out, smoke):
    name = f"xattention_{'cpu_smoke_' if smoke else ''}{datetime.date.today():%Y%m%d}.json"
    out = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    return out if out.endswith(".json") else os.path.join(out, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=["a", "b", "c"], default=["a", "b", "c"])
    parser.add_argument("--lengths", type=int, nargs="+", help=f"(a), (b); default {LENGTHS}")
    parser.add_argument("--strides", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--selections", nargs="+", choices=list(SELECTION.values()), default=[SELECTION[False]],
                        help="(a), (c): XAttention's block selection per query head (the seed's) or one per kv "
                             "head (share_kv_heads)")
    parser.add_argument("--fp8-estimate", action="store_true", help="(a), (c): estimates score fp8 Q and K")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3, 0.5], help="(b)")
    parser.add_argument("--head-masks", nargs="+", choices=["independent", "group"], default=["independent"],
                        help="(b): a mask per query head, or one per kv head shared by its query heads")
    parser.add_argument("--text-lengths", type=int, nargs="+", help=f"(c); default {TEXT_LENGTHS}")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.9, 0.95], help="(c)")
    parser.add_argument("--out", default=None, help="a .json file or a directory (default benchmarks/results)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help=f"tiny run of every section on CPU (float32, reference ops, lengths {SMOKE_LENGTHS}, "
                             f"{SMOKE_LAYERS} layers in (c)) to check the code paths")
    args = parser.parse_args()
    start = time.time()
    if args.cpu_smoke:
        device, dtype, device_name = torch.device("cpu"), torch.float32, "CPU (smoke run)"
        lengths, text_lengths = args.lengths or SMOKE_LENGTHS, args.text_lengths or SMOKE_LENGTHS
        max_layers = SMOKE_LAYERS
    else:
        device, dtype, device_name = torch.device("cuda"), torch.bfloat16, torch.cuda.get_device_name()
        lengths, text_lengths, max_layers = args.lengths or LENGTHS, args.text_lengths or TEXT_LENGTHS, None
    reps = functools.partial(repetitions, smoke=args.cpu_smoke)
    selections = [name == SELECTION[True] for name in args.selections]
    estimate = functools.partial(xa.xattn_estimate, fp8_estimate=args.fp8_estimate)
    estimate_name = "fp8 estimate" if args.fp8_estimate else f"{dtype} estimate"
    torch.manual_seed(0)

    rows_a, rows_b, shape, rows_c = [], [], None, []
    if "a" in args.sections or "b" in args.sections:
        rows_a, rows_b = random_data_rows(estimate, lengths, args.strides, selections, args.densities, args.head_masks,
                                          args.sections, reps, device, dtype)
        print(f"random data done ({time.time() - start:.0f} s)", flush=True)
    if "c" in args.sections:
        shape, rows_c = real_data_rows(estimate, text_lengths, args.strides, selections, args.thresholds, max_layers,
                                       reps, device, dtype)
        print(f"real data done ({time.time() - start:.0f} s)", flush=True)

    print_random_tables(rows_a, rows_b, args.strides, device_name, dtype, estimate_name)
    if rows_c:
        print_real_tables(shape, rows_c, rows_b, device_name, dtype, estimate_name)

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # the CPU smoke run needs no Triton
        triton_version = None
    out = out_path(args.out, args.cpu_smoke)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=device_name,
                       torch=torch.__version__, triton=triton_version, dtype=str(dtype), block_size=BLOCK,
                       cpu_smoke=args.cpu_smoke, fp8_estimate=args.fp8_estimate, wall_s=round(time.time() - start),
                       random=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, threshold=THRESHOLD,
                                   estimate=rows_a, fixed_density=rows_b),
                       real=dict(model=MODEL, text=TEXT_SOURCE, **(shape or {}), rows=rows_c)), f, indent=1)
    print(f"\nwrote {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
