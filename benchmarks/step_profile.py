"""Where one engine step's time goes on the GPU: the throughput workload's decode steps under torch.profiler.

Runs the nano-vllm workload (benchmarks/throughput.py) on a random-weight model until every request is in
decode (or, with --phase prefill, from its first step), then profiles --steps engine steps: wall time per
step, GPU-busy time per step (sum of kernel times), and the top kernels and host functions. Prints tables;
JSON to --out.

    python benchmarks/step_profile.py --model qwen3-0.6b --steps 20 --out step_profile.json
    python benchmarks/step_profile.py --phase prefill --steps 5 --trace prefill_trace.json.gz
"""
import argparse
import gzip
import json
import os
import shutil
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams
from pagedllm.bench.shapes import model_dir_for
from pagedllm.bench.throughput import make_workload


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                        help="profile decode-only steps once every prompt is in, or the first steps (prefills)")
    parser.add_argument("--out", default="step_profile.json")
    parser.add_argument("--trace", help="also write the profiler's Chrome trace, gzipped, to this path")
    args = parser.parse_args()
    llm = LLM(model_dir_for(args.model), load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=args.num_requests, enforce_eager=args.enforce_eager,
              async_scheduling=not args.no_async_scheduling)
    engine = llm.engine
    prompts, _ = make_workload(args.num_requests, (100, 1024), (100, 1024), engine.hf_config.vocab_size, 0)
    if args.phase == "prefill":
        # Compile the prefill path on other prompts first, as the throughput benchmark's warm-up does.
        llm.generate([p[::-1] for p in prompts[:16]], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True))
    if args.phase == "decode":
        while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        for _ in range(5):  # warm decode steps (graph replay paths)
            engine.step()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        # Steady state: with asynchronous scheduling a step's host work overlaps the previous step on the
        # GPU, so a step is the interval between successive returns, not one step between two syncs.
        last = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
            now = time.perf_counter()
            walls.append(now - last)
            last = now
        torch.cuda.synchronize()
    if args.trace:
        raw = args.trace.removesuffix(".gz")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(raw)
    events = prof.key_averages()
    # Self device time is charged to the kernels themselves, so its sum is the GPU-busy time.
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 / args.steps
    top = sorted(((e.key, e.self_device_time_total / 1e3 / args.steps) for e in events
                  if e.self_device_time_total > 0), key=lambda kv: -kv[1])
    wall_ms = 1e3 * sum(walls) / len(walls)
    print(f"running sequences: {len(engine.scheduler.running)}; per step: wall {wall_ms:.2f} ms "
          f"(min {1e3 * min(walls):.2f}), GPU kernels {gpu_ms:.2f} ms")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "running": len(engine.scheduler.running),
                   "wall_ms": [1e3 * w for w in walls], "gpu_kernel_ms_per_step": gpu_ms,
                   "top_kernels_ms_per_step": top[:40]}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
