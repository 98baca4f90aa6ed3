"""Decode latency: the time of one engine step (schedule, batch tensors, forward, sampling) when the batch is
b sequences decoding at a given context length, for a range of b, beside the roofline of that step: the
weights plus the batch's K/V read at the measured copy bandwidth, or its FLOPs at the measured matmul rate
where that takes longer (roofline.py).

A step is timed as the interval between successive engine.step() calls returning, in steady state: with
asynchronous scheduling the host prepares one step while the device runs the one before, so a step timed
alone between two synchronizations would add the two up instead of overlapping them."""
from __future__ import annotations

import random
import statistics
import time

from pagedllm.bench.roofline import measure_rates, model_cost_of, run_stamp, si, synchronize
from pagedllm.bench.shapes import model_dir_for
from pagedllm.sampling_params import SamplingParams


def _all_decoding(scheduler, batch_size: int) -> bool:
    # A decoding request has exactly one token (the one just sampled, maybe still on the device) not yet in
    # its KV cache.
    return (scheduler.num_running == batch_size and not scheduler.num_waiting
            and all(r.num_scheduled_tokens - r.num_computed_tokens == 1 for r in scheduler.running))


def _check_resident(scheduler, batch_size: int, preemptions: int) -> None:
    if scheduler.num_preemptions != preemptions or scheduler.num_running + scheduler.num_waiting != batch_size:
        raise ValueError(f"a batch of {batch_size} did not stay resident (preempted or cut at max_model_len): "
                         f"give it more KV blocks (--num-kv-blocks / --gpu-memory-utilization), a larger "
                         f"--max-model-len or a shorter --context")


def time_decode_steps(engine, prompts: list[list[int]], num_steps: int,
                      warmup_steps: int) -> tuple[list[float], list[int]]:
    """Prefill the prompts as one batch, run warmup_steps decode steps, then time num_steps decode steps.
    Returns each timed step's seconds and the K/V tokens it read, summed over the batch."""
    scheduler, device = engine.scheduler, engine.config.device
    batch_size = len(prompts)
    ids = [f"latency-{batch_size}-{i}" for i in range(batch_size)]
    # No output cap: while the last prompts of a large batch prefill (chunked by the token budget), the first
    # ones already decode, so how many tokens they need before the timing starts is not known in advance.
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    preemptions = scheduler.num_preemptions
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    try:
        while not _all_decoding(scheduler, batch_size):
            engine.step()
            _check_resident(scheduler, batch_size, preemptions)
        for _ in range(warmup_steps):
            engine.step()
        times, kv_tokens = [], []
        synchronize(device)
        last = time.perf_counter()
        for _ in range(num_steps):
            # The step writes each sequence's newest token, then reads all num_scheduled_tokens of its K/V.
            kv_tokens.append(sum(r.num_scheduled_tokens for r in scheduler.running))
            engine.step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        _check_resident(scheduler, batch_size, preemptions)
    finally:
        engine.abort_request(ids)
    return times, kv_tokens


def run_latency(model: str, engine_options: dict, batch_sizes: list[int], context: int, num_steps: int,
                warmup_steps: int) -> dict:
    from pagedllm import LLM

    model_dir = model_dir_for(model)
    llm = LLM(model_dir, **engine_options)
    engine = llm.engine
    cost = model_cost_of(engine)
    rates = measure_rates(engine.config.device, engine.dtype)
    rng = random.Random(engine.config.seed)
    high = min(engine.hf_config.vocab_size - 1, 10000)
    # The larger batches reuse the smaller ones' prompts, so prefix caching shortens their prefill.
    prompts = [[rng.randint(0, high) for _ in range(context)] for _ in range(max(batch_sizes))]
    weight_read_s = cost.decode_step_bytes(0) / rates.bandwidth
    rows = []
    for b in batch_sizes:
        times, kv_tokens = time_decode_steps(engine, prompts[:b], num_steps, warmup_steps)
        # The mean is the steady-state period; single intervals jitter (one step's host work may end early
        # and the next one's wait for the device the longer).
        mean = statistics.fmean(times)
        kv_mean = statistics.fmean(kv_tokens)
        roofline = cost.decode_step_seconds(rates, b, kv_mean)
        rows.append({"batch_size": b, "mean_ms": 1e3 * mean, "median_ms": 1e3 * statistics.median(times),
                     "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times), "output_tok_s": b / mean,
                     "mean_kv_len": kv_mean / b, "roofline_ms": 1e3 * roofline,
                     "fraction_of_roofline": roofline / mean})
    return {
        **run_stamp(engine.config.device), "model": model, "model_dir": model_dir,
        "dtype": str(engine.dtype).removeprefix("torch."), "context": context, "num_steps": num_steps,
        "warmup_steps": warmup_steps,
        "bandwidth": rates.bandwidth, "matmul_flops": rates.matmul_flops, "weight_bytes": cost.weight_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token, "weight_read_ms": 1e3 * weight_read_s, "results": rows,
    }


def format_report(r: dict) -> str:
    lines = [
        f"decode step latency: {r['model']}, {r['dtype']} on {r['device']}, prompts of {r['context']} tokens, "
        f"mean of {r['num_steps']} timed steps after {r['warmup_steps']} untimed ones",
        f"copy bandwidth {si(r['bandwidth'], 'B/s')} (measured); reading the weights "
        f"({si(r['weight_bytes'], 'B')}) takes {r['weight_read_ms']:.4g} ms; "
        f"roofline = (weights + the K/V the timed steps read, {r['kv_bytes_per_token']} B/token) / bandwidth, "
        f"or the step's FLOPs / matmul rate ({si(r['matmul_flops'], 'FLOP/s')}) where longer",
        f"{'batch':>6} {'K/V len':>8} {'mean ms':>8} {'median ms':>10} {'tok/s':>10} {'roofline ms':>12} "
        f"{'of roofline':>12}",
    ]
    for row in r["results"]:
        lines.append(f"{row['batch_size']:>6} {row['mean_kv_len']:>8.1f} {row['mean_ms']:>8.3f} "
                     f"{row['median_ms']:>10.3f} {row['output_tok_s']:>10.1f} {row['roofline_ms']:>12.3f} "
                     f"{row['fraction_of_roofline']:>12.1%}")
    return "\n".join(lines)


def plot(r: dict, path: str) -> bool:
    """Step time and roofline against batch size as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [row["batch_size"] for row in r["results"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(batches, [row["mean_ms"] for row in r["results"]], "o-", label="pagedllm step (mean)")
    ax.plot(batches, [row["roofline_ms"] for row in r["results"]], "--",
            label="roofline: weights + K/V read (or FLOPs)")
    ax.axhline(r["weight_read_ms"], color="gray", linestyle=":", label="weight read alone")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (sequences decoding)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{r['dtype']} decode at context {r['context']} on {r['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
