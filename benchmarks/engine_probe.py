"""Where the throughput workload's GPU time goes, probed on the H100 (fifth session; results/README.md):

- ``steps``: per step of the workload (Qwen3-0.6B shape, bf16, random weights), the host's time in schedule
  / execute (of which graph replay calls) / processing, the GPU time between CUDA events around each step's
  work, and the GPU's idle time between steps, by kind of step.
- ``trace``: the same run under torch.profiler: GPU time by kernel kind and the gaps between kernels (the
  profiler slows the host, so its gaps overstate those of an unprofiled run: compare with ``steps``).
- ``decode``: decode attention on the engine's own step inputs (block tables, lengths, layer 0's cache) at
  several batch sizes of the run: as the engine plans it, with the pages renumbered contiguously, and with
  every partition size, planned for max_model_len as the decode graphs plan it.
- ``argmax``: the greedy sampler's Triton argmax against torch.argmax on Qwen3's vocabulary.
- ``gemm-layout``: cuBLAS on the decode projections with nn.Linear's [N, K] weight against the same weight
  stored [K, N], weights rotated through 8 copies so they come from DRAM.
- ``graph-launch``: host time of a freshly captured decode graph's first three launches (the first uploads it).
- ``batch1``: batch-1 decode steps as `bench latency` runs them (LLM defaults, one 1024-token prompt or --context
  tokens), 300 (or --steps) timed after 30: the wall period, and from CUDA events around each step's launches the
  GPU's period, its span and its idle time between steps (medians). Separate processes of `bench latency` on one
  H100 varied by up to 25% at batch 1 (fourteenth session); the GPU span is the step's own time.
- ``batch1-kernels``: the same steps under torch.profiler: each step's GPU work in order, the decoder-layer kernel's
  launches summed into one line, every other kernel and copy with its time and the gap before it.

    python benchmarks/engine_probe.py steps|trace|decode|argmax|gemm-layout|graph-launch|batch1|batch1-kernels
        [--max-num-seqs N] [--context TOKENS] (the batch1 probes) [--steps N] (batch1)

Variants against each other: benchmarks/alternate.py.
"""
import argparse
import collections
import json
import time

import torch
import triton
from triton.testing import do_bench_cudagraph

from pagedllm import LLM, SamplingParams
from pagedllm.bench.shapes import model_dir_for
from pagedllm.bench.throughput import make_workload

MAX_MODEL_LEN = 4096
BUCKETS = (8, 32, 64, 128, 192, 256)


def _engine():
    """An engine like the throughput benchmark's, warmed up, and the workload's prompts and sampling params."""
    llm = LLM(model_dir_for("qwen3-0.6b"), load_format="dummy", dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
              max_num_seqs=256)
    prompts, outs = make_workload(256, (100, 1024), (100, 1024), llm.engine.hf_config.vocab_size, 0)
    llm.generate([[0] * 32], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    return llm, prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]


def _kind(step: dict) -> str:
    if step["prefill"]:
        return "prefill"
    return next(f"decode<={b}" for b in BUCKETS if step["decodes"] <= b)


def _timed(execute, record):
    """execute wrapped: record(start, end, host seconds) gets CUDA events around the work it queues and its host
    time."""
    def timed(*args):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        out = execute(*args)
        end.record()
        record(start, end, time.perf_counter() - t)
        return out
    return timed


def probe_steps():
    llm, prompts, params = _engine()
    eng = llm.engine
    steps, cur = [], {}
    schedule, execute, process = eng.scheduler.schedule, eng.runner.execute, eng._process

    def timed_schedule():
        t = time.perf_counter()
        out = schedule()
        cur.clear()
        cur.update(sched=time.perf_counter() - t, t0=t, replay=0.0, prefill=any(
            it.num_new_tokens > 1 for it in out.scheduled), decodes=sum(it.num_new_tokens == 1 for it in out.scheduled))
        return out

    timed_execute = _timed(execute, lambda start, end, host: steps.append(dict(cur, exec=host, events=(start, end))))

    def timed_process(*args):
        t = time.perf_counter()
        out = process(*args)
        if steps:
            steps[-1]["proc"] = steps[-1].get("proc", 0.0) + time.perf_counter() - t
        return out

    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph):
        t = time.perf_counter()
        replay(graph)
        cur["replay"] += time.perf_counter() - t

    eng.scheduler.schedule, eng.runner.execute, eng._process = timed_schedule, timed_execute, timed_process
    torch.cuda.CUDAGraph.replay = timed_replay
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        torch.cuda.CUDAGraph.replay = replay
    print(f"wall {wall:.3f} s, steps {len(steps)}")
    rows = collections.defaultdict(lambda: collections.defaultdict(float))
    for step, after in zip(steps, steps[1:] + [None]):
        row = rows[_kind(step)]
        row["n"] += 1
        for f in ("sched", "exec", "replay", "proc"):
            row[f] += step.get(f, 0.0)
        row["gpu"] += step["events"][0].elapsed_time(step["events"][1]) / 1e3
        if after is not None:
            row["idle"] += max(0.0, step["events"][1].elapsed_time(after["events"][0]) / 1e3)
            row["period"] += after["t0"] - step["t0"]
    print(f"{'kind':12s} {'n':>5s} {'period':>8s} {'sched':>7s} {'exec':>7s} {'replay':>7s} {'proc':>7s} "
          f"{'host sum':>8s} {'gpu ev':>7s} {'idle':>7s}  (ms per step)")
    for kind, r in sorted(rows.items()):
        n = r["n"]
        host = (r["sched"] + r["exec"] + r["proc"]) / n
        print(f"{kind:12s} {int(n):5d} {r['period'] / n * 1e3:8.3f} {r['sched'] / n * 1e3:7.3f} "
              f"{r['exec'] / n * 1e3:7.3f} {r['replay'] / n * 1e3:7.3f} {r['proc'] / n * 1e3:7.3f} {host * 1e3:8.3f} "
              f"{r['gpu'] / n * 1e3:7.3f} {r['idle'] / n * 1e3:7.3f}   total idle {r['idle']:.3f} s")


KERNEL_KINDS = (("_decode_kernel", "decode attn"), ("_reduce_kernel", "decode reduce"),
                ("_prefill_kernel", "prefill attn"), ("nvjet", "gemm"), ("gemm", "gemm"), ("cublas", "gemm"),
                ("_rms_norm", "rmsnorm"), ("_rope", "rope"), ("_silu", "silu"), ("argmax", "argmax"),
                ("Memcpy", "memcpy"), ("Memset", "memset"))


def probe_trace():
    from torch.profiler import ProfilerActivity, profile
    llm, prompts, params = _engine()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    path = "/tmp/engine_probe_trace.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])

    def kind(name):
        return next((k for key, k in KERNEL_KINDS if key in name), "other: " + name[:40])
    busy, gaps = collections.Counter(), collections.Counter()
    end, idle = events[0]["ts"], 0.0
    for e in events:
        busy[kind(e["name"])] += e["dur"]
        gap = e["ts"] - end
        if gap > 0:
            idle += gap
            gaps[next(b for b in (2, 5, 20, 100, 1000, float("inf")) if gap <= b)] += gap
        end = max(end, e["ts"] + e["dur"])
    print(f"wall {wall:.3f} s (profiled), GPU span {(end - events[0]['ts']) / 1e6:.3f} s, idle {idle / 1e6:.3f} s, "
          f"kernels {len(events)}")
    for k, t in busy.most_common(15):
        print(f"  busy {k:40s} {t / 1e6:8.3f} s")
    for b, t in sorted(gaps.items()):
        print(f"  gaps <= {b:>8} us: {t / 1e6:.3f} s")


def probe_decode():
    from pagedllm import ops
    from pagedllm.ops.triton import _host, decode
    llm, prompts, params = _engine()
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    graphs = eng.runner.decode_graphs
    targets, snaps, run = [256, 200, 150, 110, 90, 74, 60, 45, 32, 24, 18, 12, 8, 4, 2, 1], {}, graphs.run

    def snapshot_run(size, max_seq_len):
        inputs = graphs.inputs[size]
        seq_lens, block_tables = inputs["decode_seq_lens"], inputs["decode_block_tables"]
        n = int((seq_lens > 0).sum())
        for t in targets:
            if n <= t and t not in snaps:
                snaps[t] = (seq_lens[:n].clone(), block_tables[:n].clone())
        return run(size, max_seq_len=max_seq_len)

    graphs.run = snapshot_run
    while eng.has_unfinished_requests():
        eng.step()
    layer = eng.runner.attn_layers[0]
    kc, vc, bs = layer.key_cache, layer.value_cache, layer.block_size
    heads, kv_heads, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    block_n, warps, stages = decode._config(kc, d, bs)
    sms = _host.num_sms(kc.device)
    for t in targets:
        if t not in snaps:
            continue
        lens, table = snaps[t]
        n = lens.shape[0]
        q = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        nbytes = 4 * int(lens.sum()) * kv_heads * d

        def ms(fn):
            fn()
            torch.cuda.synchronize()
            return do_bench_cudagraph(fn, rep=30, return_mode="min")
        # As the engine runs it eagerly (planned for the actual longest sequence), then on contiguous pages.
        max_len = int(lens.max())
        eager = ms(lambda: ops.paged_attention(out, q, kc, vc, kv_heads, d ** -0.5, table, lens, bs, max_len,
                                               None, "auto", 1.0, 1.0))
        pages = [-(-int(n_) // bs) for n_ in lens]
        k2 = torch.empty((sum(pages) + 1, *kc.shape[1:]), dtype=kc.dtype, device="cuda")
        v2, table2, s = torch.empty_like(k2), torch.zeros_like(table), 1
        for r, p in enumerate(pages):
            k2[s:s + p], v2[s:s + p] = kc[table[r, :p].long()], vc[table[r, :p].long()]
            table2[r, :p] = torch.arange(s, s + p, device="cuda")
            s += p
        contiguous = ms(lambda: ops.paged_attention(out, q, k2, v2, kv_heads, d ** -0.5, table2, lens, bs,
                                                    max_len, None, "auto", 1.0, 1.0))
        # Every partition size, planned for max_model_len as the decode graphs plan it.
        times = {}
        for part in (None, 128, 256, 384, 512, 768, 1024, 2048):
            parts, part_tokens = (1, MAX_MODEL_LEN) if part is None else (triton.cdiv(MAX_MODEL_LEN, part), part)
            partials = None
            if parts > 1:
                stats = torch.empty((2, n, heads, parts), dtype=torch.float32, device="cuda")
                partials = (stats[0], stats[1], torch.empty((n, heads, parts, d), dtype=torch.float32, device="cuda"))
            times[part or "single"] = ms(lambda: decode._launch(
                out, partials, q, kc, vc, kv_heads, d ** -0.5, table, lens, bs, None, "auto", 1.0, 1.0, parts,
                part_tokens, block_n, warps, stages))
        best = min(times, key=times.get)
        print(f"{n:4d} seqs, len {int(lens.min())}-{max_len} mean {float(lens.float().mean()):.0f}: "
              f"eager plan {nbytes / eager / 1e9:.2f} TB/s, contiguous pages {nbytes / contiguous / 1e9:.2f} | "
              f"planned for {MAX_MODEL_LEN} (us): " + " ".join(f"{k}:{v * 1e3:.1f}" for k, v in times.items())
              + f" | best {best} {nbytes / times[best] / 1e9:.2f} TB/s; graph plan "
              f"{decode.split_plan(n, kv_heads, MAX_MODEL_LEN, block_n, sms)}", flush=True)


def probe_argmax():
    from pagedllm.ops.triton import fused
    vocab, default = 151936, fused.ARGMAX_CHUNK
    for rows in (1, 4, 16, 64, 128, 256):
        xs = [torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        ours = {}
        t_torch = do_bench_cudagraph(lambda: [x.argmax(-1) for x in xs], rep=30, return_mode="min") * 1e3 / 4
        for chunk in (1024, 2048, 4096, 8192):
            fused.ARGMAX_CHUNK = chunk
            assert all(torch.equal(fused.argmax(x), x.argmax(-1)) for x in xs)
            ours[chunk] = do_bench_cudagraph(lambda: [fused.argmax(x) for x in xs], rep=30,
                                             return_mode="min") * 1e3 / 4
        fused.ARGMAX_CHUNK = default
        print(f"argmax M={rows:4d} torch {t_torch:6.2f} us  triton "
              + "  ".join(f"{c}:{t:6.2f}" for c, t in ours.items())
              + f"  (copy-bound at 3 TB/s {rows * vocab * 2 / 3.0e6:6.2f} us)")


def probe_gemm_layout():
    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
    copies, total = 8, collections.defaultdict(lambda: [0.0, 0.0])
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        transposed = [w.t().contiguous() for w in weights]
        for m in (1, 8, 32, 64, 128, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a = do_bench_cudagraph(lambda: [torch.nn.functional.linear(x, w) for w in weights], rep=30,
                                   return_mode="min") * 1e3 / copies
            b = do_bench_cudagraph(lambda: [x @ w for w in transposed], rep=30, return_mode="min") * 1e3 / copies
            total[m][0] += a
            total[m][1] += b
            print(f"{name:8s} M={m:4d} linear [N,K] {a:6.2f} us   mm [K,N] {b:6.2f} us  {a / b:5.2f}x", flush=True)
    for m, (a, b) in total.items():
        print(f"M={m:4d} per layer: linear {a:6.2f} us, mm {b:6.2f} us, per 28 layers saving {(a - b) * 28:7.1f} us")


def probe_graph_launch():
    from pagedllm.layers.attention import set_forward_context
    llm, _, _ = _engine()
    graphs, model = llm.engine.runner.decode_graphs, llm.engine.runner.model
    with torch.inference_mode():
        for bs, bound in ((8, 2048), (16, 1024), (256, 4096)):
            with set_forward_context(graphs._metadata(bs, bound)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=graphs.graphs[bs, bound].pool()):
                    model(graphs.inputs[bs]["input_ids"], graphs.inputs[bs]["positions"])
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                graph.replay()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                times.append((round((t1 - t0) * 1e3, 3), round((time.perf_counter() - t0) * 1e3, 3)))
            print(f"bs {bs} bound {bound}: (launch ms, launch+run ms) for replays 1..3: {times}", flush=True)


def _batch1_engine(max_num_seqs: int | None, context: int):
    """An engine with defaults (but max_num_seqs, where given), 30 steps into decoding one prompt of context
    tokens."""
    import random
    extra = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    eng = LLM(model_dir_for("qwen3-0.6b"), load_format="dummy", dtype="bfloat16", **extra).engine
    rng = random.Random(0)
    eng.add_request("batch1", [rng.randint(0, 10000) for _ in range(context)],
                    SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    for _ in range(30):
        eng.step()
    return eng


def probe_batch1(max_num_seqs: int | None = None, context: int = 1024, steps: int = 300):
    import statistics
    eng = _batch1_engine(max_num_seqs, context)
    events = []
    eng.runner.execute = _timed(eng.runner.execute, lambda *record: events.append(record))
    torch.cuda.synchronize()
    events.clear()
    walls, last = [], time.perf_counter()
    for _ in range(steps):
        eng.step()
        now = time.perf_counter()
        walls.append(now - last)
        last = now
    torch.cuda.synchronize()
    pairs = list(zip(events, events[1:]))
    med = statistics.median
    print(f"batch 1, context {context + 30}-{context + 30 + steps}: wall period {1e3 * med(walls):.3f} ms; "
          f"GPU period {med(a[0].elapsed_time(b[0]) for a, b in pairs):.3f} ms, span "
          f"{med(s.elapsed_time(e) for s, e, _ in events):.3f} ms, idle between steps "
          f"{med(a[1].elapsed_time(b[0]) for a, b in pairs):.3f} ms; host in execute "
          f"{1e3 * med(h for *_, h in events):.3f} ms (medians)")


def probe_batch1_kernels(max_num_seqs: int | None = None, context: int = 1024, steps: int = 4):
    from torch.profiler import ProfilerActivity, profile
    eng = _batch1_engine(max_num_seqs, context)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps + 2):
            eng.step()
        torch.cuda.synchronize()
    path = "/tmp/engine_probe_batch1.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])
    # A step starts with the upload of its inputs: a host-to-device copy, or with zero-copy transfers (every decode
    # step's token a placeholder) the upload kernel. The first and last steps may be cut.
    starts = [i for i, e in enumerate(events) if "HtoD" in e["name"] or "_upload_kernel" in e["name"]]
    for a, b in list(zip(starts, starts[1:]))[1:steps + 1]:
        step, end, layer = events[a:b], events[a]["ts"], None
        print(f"step: {(events[b]['ts'] - events[a]['ts']):.1f} us from upload to the next upload")
        for e in step:
            gap, end = e["ts"] - end, max(end, e["ts"] + e["dur"])
            if "_decoder_layer_kernel" in e["name"]:
                if layer is None:
                    layer = [0, 0.0, e["ts"], gap]
                layer[0] += 1
                layer[1] += e["dur"]
                last = e["ts"] + e["dur"]
                continue
            if layer is not None:
                print(f"  {'decoder-layer kernel x' + str(layer[0]):60s} gap {layer[3]:7.1f}  span "
                      f"{last - layer[2]:8.1f} us (busy {layer[1]:.1f})")
                layer = None
            print(f"  {e['name'][:60]:60s} gap {gap:7.1f}  time {e['dur']:8.1f} us")


PROBES = {"steps": probe_steps, "trace": probe_trace, "decode": probe_decode, "argmax": probe_argmax,
          "gemm-layout": probe_gemm_layout, "graph-launch": probe_graph_launch, "batch1": probe_batch1,
          "batch1-kernels": probe_batch1_kernels}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--max-num-seqs", type=int, help="the batch1 probes' engine's (2: it captures the decode "
                        "graphs of one and two sequences only, minutes less on a cold machine)")
    parser.add_argument("--context", type=int, help="the batch1 probes' prompt length (default 1024)")
    parser.add_argument("--steps", type=int, help="the batch1 probe's timed steps, after 30 untimed (default 300)")
    args = parser.parse_args()
    if args.probe == "batch1":
        probe_batch1(args.max_num_seqs, args.context or 1024, args.steps or 300)
    elif args.probe == "batch1-kernels" and args.steps is None:
        probe_batch1_kernels(args.max_num_seqs, args.context or 1024)
    elif args.max_num_seqs is not None or args.context is not None or args.steps is not None:
        parser.error(f"--max-num-seqs and --context are for the batch1 probes, --steps for batch1, not {args.probe}")
    else:
        PROBES[args.probe]()
