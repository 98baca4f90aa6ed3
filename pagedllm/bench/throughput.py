"""Offline throughput: a batch of random-token requests through LLM.generate, beside its roofline estimate
(roofline.py) and optionally beside Hugging Face transformers on a subset of the same prompts.

The default workload is the one nano-vllm publishes: 256 requests, prompt and output lengths each uniform in
[100, 1024], random token ids in [0, 10000], ignore_eos, max_model_len 4096, seed 0; greedy here."""
from __future__ import annotations

import gc
import random
import time

import torch

from pagedllm.bench import hf_baseline
from pagedllm.bench.shapes import model_dir_for
from pagedllm.bench.roofline import (describe, estimate_throughput, measure_rates, model_cost_of, run_stamp,
                                     synchronize)
from pagedllm.sampling_params import SamplingParams


def make_workload(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    high = min(vocab_size - 1, 10000)
    prompts = [[rng.randint(0, high) for _ in range(rng.randint(*input_range))] for _ in range(num_requests)]
    output_lens = [rng.randint(*output_range) for _ in range(num_requests)]
    return prompts, output_lens


# Decode-only steps are grouped by batch size into these ranges (upper bounds) in the step breakdown.
BATCH_BUCKETS = (8, 32, 64, 128, 192, 256, 512)


class StepLog:
    """Records when each step was scheduled and what it held, by wrapping the engine's scheduler. Steps
    overlap with asynchronous scheduling, so a step's time is taken as the interval to the next schedule()
    call: in steady state that is the period at which the device finishes steps."""

    def __init__(self, engine) -> None:
        self.scheduler = engine.scheduler
        # (start time, decode rows, K/V tokens they read, prefill chunks as (first, end) positions)
        self.steps: list[tuple[float, int, int, list[tuple[int, int]]]] = []
        schedule = self.scheduler.schedule

        def logged():
            out = schedule()
            decodes = [it.num_computed_tokens + 1 for it in out.scheduled if it.num_new_tokens == 1]
            chunks = [(it.num_computed_tokens, it.num_computed_tokens + it.num_new_tokens)
                      for it in out.scheduled if it.num_new_tokens > 1]
            self.steps.append((time.perf_counter(), len(decodes), sum(decodes), chunks))
            return out

        self.scheduler.schedule = logged

    def close(self, start: float, end: float) -> None:
        """The run's start and end: the first step's interval starts with the run (taking in the requests' intake,
        which on a short run was 10 ms of 65), the last one ends with it."""
        del self.scheduler.schedule  # back to the class's method
        self.start, self.end = start, end

    def breakdown(self, cost, rates) -> list[dict]:
        """Wall time against the roofline per kind of step: steps with prefill tokens, then decode-only steps
        by batch size."""
        rows: dict[str, dict] = {}
        starts = [self.start] + [t for t, *_ in self.steps[1:]]
        for (_, decodes, kv, chunks), start, end in zip(self.steps, starts, starts[1:] + [self.end]):
            if chunks:
                kind = "with prefill"
                # A chunk's FLOPs: the prompt's up to its end minus those up to its start.
                flops = sum(cost.prefill_flops(b) - (cost.prefill_flops(a) if a else 0) for a, b in chunks)
                ideal = (cost.decode_step_seconds(rates, decodes, kv) if decodes else 0.0) + \
                    flops / rates.matmul_flops
            elif decodes:
                kind = next((f"decode <= {b}" for b in BATCH_BUCKETS if b >= decodes),
                            f"decode > {BATCH_BUCKETS[-1]}")
                ideal = cost.decode_step_seconds(rates, decodes, kv)
            else:
                continue
            row = rows.setdefault(kind, {"steps": 0, "wall_s": 0.0, "roofline_s": 0.0})
            row["steps"] += 1
            row["wall_s"] += end - start
            row["roofline_s"] += ideal
        order = ["with prefill", *(f"decode <= {b}" for b in BATCH_BUCKETS), f"decode > {BATCH_BUCKETS[-1]}"]
        return [{"kind": k, **rows[k]} for k in order if k in rows]


def run_ours(llm, prompts: list[list[int]], output_lens: list[int], use_tqdm: bool, rates=None) -> dict:
    """With rates (DeviceRates), also the per-step breakdown against the roofline."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    device = llm.engine.config.device
    # Each timed run starts from an empty prefix cache: none gets an earlier run's prompts for free.
    llm.engine.kv_cache_manager.reset_prefix_cache()
    log = StepLog(llm.engine)
    synchronize(device)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    synchronize(device)
    elapsed = time.perf_counter() - t0
    log.close(t0, t0 + elapsed)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "num_requests": len(prompts), "input_tokens": sum(map(len, prompts)),
            "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs), "output_tokens": generated,
            "requests_per_s": len(prompts) / elapsed,
            "output_tok_s": generated / elapsed,
            "total_tok_s": (sum(map(len, prompts)) + generated) / elapsed,
            "steps": log.breakdown(model_cost_of(llm.engine), rates) if rates is not None else None}


def run_throughput(model: str, engine_options: dict, num_requests: int, input_range: tuple[int, int],
                   output_range: tuple[int, int], use_tqdm: bool, hf_subset: tuple[int, int, int] | None) -> dict:
    """hf_subset = (num_requests, output_len, generate batch size) runs the HF baseline on the first
    num_requests prompts, each producing output_len tokens, and ours on the same subset."""
    from pagedllm import LLM

    # Only this function holds the engine, so it can free the engine's memory before transformers runs.
    model_dir = model_dir_for(model)
    llm = LLM(model_dir, **engine_options)
    engine = llm.engine
    seed = engine.config.seed
    prompts, output_lens = make_workload(num_requests, input_range, output_range, engine.hf_config.vocab_size,
                                         seed)
    device, dtype = engine.config.device, engine.dtype
    rates = measure_rates(device, dtype)
    estimate = estimate_throughput(model_cost_of(engine), rates, list(map(len, prompts)), output_lens,
                                   engine.config.max_num_seqs)
    # Warm-up: kernel compilation and first-call allocations stay out of the timed run.
    llm.generate([[0] * 32], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    ours = run_ours(llm, prompts, output_lens, use_tqdm, rates)
    result = {
        **run_stamp(device), "model": model, "model_dir": model_dir,
        "dtype": str(dtype).removeprefix("torch."),
        "engine": {k: v for k, v in vars(engine.config).items() if isinstance(v, (int, float, str, type(None)))},
        "workload": {"num_requests": num_requests, "input_len": list(input_range),
                     "output_len": list(output_range), "seed": seed, "greedy": True, "ignore_eos": True},
        "ours": ours, "roofline": estimate,
        "fraction_of_roofline": ours["output_tok_s"] / estimate["output_tok_s"],
    }
    if hf_subset is not None:
        count, output_len, batch_size = hf_subset
        subset = prompts[:count]
        ours_subset = run_ours(llm, subset, [output_len] * len(subset), use_tqdm)
        del engine, llm
        _release_device_memory(device)
        hf_model = hf_baseline.load_hf_model(model_dir, dtype, device, seed)
        hf_gen = hf_baseline.hf_generate(hf_model, subset, output_len, batch_size, use_tqdm)
        hf_cb = hf_baseline.hf_continuous_batching(hf_model, subset, output_len, use_tqdm)
        result["baseline"] = {
            "subset": {"num_requests": len(subset), "input_tokens": sum(map(len, subset)),
                       "output_len": output_len},
            "ours": ours_subset, "hf_generate": hf_gen, "hf_continuous_batching": hf_cb,
            "speedup_vs_hf_generate": ours_subset["output_tok_s"] / hf_gen["output_tok_s"],
            "speedup_vs_hf_continuous_batching": ours_subset["output_tok_s"] / hf_cb["output_tok_s"],
        }
    return result


def _release_device_memory(device: str) -> None:
    # Our KV pool takes most of a GPU's memory; transformers needs it back.
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def format_report(r: dict) -> str:
    w, ours = r["workload"], r["ours"]
    lines = [
        f"device {r['device']}, model {r['model']}, {r['dtype']}, max_num_seqs {r['engine']['max_num_seqs']}",
        f"workload: {w['num_requests']} requests, prompt {w['input_len'][0]}-{w['input_len'][1]} tokens, output "
        f"{w['output_len'][0]}-{w['output_len'][1]} tokens (uniform, seed {w['seed']}), greedy, ignore_eos",
        f"pagedllm: {ours['elapsed_s']:.2f} s, {ours['requests_per_s']:.2f} requests/s, "
        f"{ours['output_tok_s']:.1f} output tok/s, {ours['total_tok_s']:.1f} total tok/s",
        describe(r["roofline"]),
        f"pagedllm reaches {r['fraction_of_roofline']:.1%} of the roofline's output tok/s",
        "where the time went (a step lasts until the next is scheduled; roofline as above, per step):",
        f"  {'steps':>24} {'count':>6} {'wall s':>8} {'roofline s':>11} {'of roofline':>12}",
    ]
    for row in ours["steps"]:
        lines.append(f"  {row['kind']:>24} {row['steps']:6d} {row['wall_s']:8.3f} {row['roofline_s']:11.3f} "
                     f"{row['roofline_s'] / row['wall_s']:12.1%}")
    if "baseline" in r:
        b = r["baseline"]
        s = b["subset"]
        lines += [
            f"baseline subset (same for all three): the first {s['num_requests']} prompts ({s['input_tokens']} "
            f"tokens), {s['output_len']} output tokens each; transformers uses its own random weights",
            f"  pagedllm                          {b['ours']['output_tok_s']:10.1f} output tok/s",
            f"  HF generate (batch {b['hf_generate']['batch_size']}, left pad)  "
            f"{b['hf_generate']['output_tok_s']:10.1f} output tok/s   speed-up {b['speedup_vs_hf_generate']:.2f}x",
            f"  HF continuous batching            {b['hf_continuous_batching']['output_tok_s']:10.1f} output tok/s"
            f"   speed-up {b['speedup_vs_hf_continuous_batching']:.2f}x (its time includes its warm-up)",
        ]
    return "\n".join(lines)
