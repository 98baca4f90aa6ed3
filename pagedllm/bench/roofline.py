"""Roofline model: the fastest a workload could run on a device, from the device's measured rates.

The model (printed with every estimate):
- A decode step reads every weight once (the linear layers and the LM head; norms and the embedding rows it
  looks up are negligible) plus the K/V of every token of every running sequence, at the copy bandwidth of
  the device; or, if that is shorter, it takes its FLOPs (2 per weight per sequence, 4 * q_heads * head_dim
  per layer per K/V token read) at the matmul rate. On an H100 every step of the default workload is
  memory-bound, for Qwen3-0.6B and Llama-3-8B shapes alike; a CPU can be compute-bound.
- A prefill is compute-bound: 2 FLOPs per linear-layer weight per prompt token, causal attention (QK^T and
  PV: 4 * q_heads * head_dim FLOPs per layer per query-key pair, over L(L+1)/2 pairs), and the LM head on the
  last token only, at the measured matmul rate.
- The schedule is simulated, not measured: FIFO admission of up to max_num_seqs sequences; a request's prefill
  gives its first token, every later token takes one decode step that reads the K/V of its prompt and the
  tokens so far. The KV pool is assumed large enough that nothing is preempted (peak_kv_tokens says how much
  it needed).
The estimate is the sum of decode time and prefill time; a real engine cannot overlap them much, since both
run in the same forward passes.

Rates are measured in the same run, each from the fastest of several timed runs: bandwidth as (bytes read +
bytes written) / time of a large device-to-device copy, matmul rate as 2 n^3 / time of a large square matmul
in the model's dtype.
"""
from __future__ import annotations

import time
from collections import deque
from datetime import datetime, timezone
from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple

import torch

from pagedllm.worker.model_runner import head_size_of


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_stamp(device: torch.device | str) -> dict:
    """When (UTC) and on what a benchmark ran: the head of its JSON result."""
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device_name(device)}


def best_seconds(fn: Callable[[], object], device: torch.device | str, reps: int) -> float:
    """The fastest of `reps` timed runs after a warm-up: the rate the device can reach, which is what a roofline
    wants (the median of 10 moved by ~3% between runs on the H100, and the fraction of the roofline with it).
    On a GPU each run is timed with CUDA events, so no launch or synchronisation cost is counted."""
    fn()  # warm-up: allocations, kernel selection
    gpu = torch.device(device).type == "cuda"
    times = []
    for _ in range(reps):
        if gpu:
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(times)


@dataclass(frozen=True)
class DeviceRates:
    bandwidth: float     # bytes/s
    matmul_flops: float  # FLOP/s
    matmul_dtype: str


def measure_rates(device: torch.device | str, dtype: torch.dtype) -> DeviceRates:
    device = torch.device(device)
    return DeviceRates(_copy_bandwidth(device), _matmul_rate(device, dtype), str(dtype).removeprefix("torch."))


def _copy_bandwidth(device: torch.device) -> float:
    gpu = device.type == "cuda"
    # Well past the last-level cache: 1 GiB on a GPU, 256 MiB on a CPU (which copies far slower).
    src = torch.ones((1 << 30 if gpu else 1 << 28) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: dst.copy_(src), device, reps=30 if gpu else 5)


def _matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    gpu = device.type == "cuda"
    n = 8192 if gpu else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n ** 3 / best_seconds(lambda: a @ b, device, reps=30 if gpu else 3)


@dataclass(frozen=True)
class ModelCost:
    linear_params: int      # weights of the decoder layers' linear projections
    lm_head_params: int
    attn_width: int         # num_layers * q_heads * head_dim
    weight_bytes: int       # bytes a forward step reads from the weights
    kv_bytes_per_token: int  # K and V of one token over all layers

    @classmethod
    def from_hf_config(cls, hf_config, weight_elem_bytes: int, kv_elem_bytes: int) -> "ModelCost":
        hidden, layers = hf_config.hidden_size, hf_config.num_hidden_layers
        q_heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or q_heads
        head = head_size_of(hf_config)
        per_layer = (2 * hidden * q_heads * head          # q and o projections
                     + 2 * hidden * kv_heads * head       # k and v projections
                     + 3 * hidden * hf_config.intermediate_size)  # gate, up, down
        linear = layers * per_layer
        lm_head = hf_config.vocab_size * hidden
        return cls(linear_params=linear, lm_head_params=lm_head, attn_width=layers * q_heads * head,
                   weight_bytes=(linear + lm_head) * weight_elem_bytes,
                   kv_bytes_per_token=2 * layers * kv_heads * head * kv_elem_bytes)

    def prefill_flops(self, prompt_len: int) -> int:
        return (2 * self.linear_params * prompt_len
                + 2 * self.attn_width * prompt_len * (prompt_len + 1)
                + 2 * self.lm_head_params)

    def decode_step_bytes(self, kv_tokens: float) -> float:
        """A decode step reading kv_tokens tokens of K/V, summed over the batch."""
        return self.weight_bytes + kv_tokens * self.kv_bytes_per_token

    def decode_step_flops(self, batch_size: int, kv_tokens: float) -> float:
        return 2 * (self.linear_params + self.lm_head_params) * batch_size + 4 * self.attn_width * kv_tokens

    def decode_step_seconds(self, rates: DeviceRates, batch_size: int, kv_tokens: float) -> float:
        return max(self.decode_step_bytes(kv_tokens) / rates.bandwidth,
                   self.decode_step_flops(batch_size, kv_tokens) / rates.matmul_flops)


def model_cost_of(engine) -> ModelCost:
    elem = engine.dtype.itemsize
    kv_elem = 1 if engine.config.kv_cache_dtype.startswith("fp8") else elem
    return ModelCost.from_hf_config(engine.hf_config, elem, kv_elem)


class DecodeSchedule(NamedTuple):
    batch_sizes: list[int]  # sequences in each decode step
    kv_tokens: list[int]    # K/V tokens each step reads, summed over its sequences


def simulate_decode(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int) -> DecodeSchedule:
    waiting = deque(zip(prompt_lens, output_lens))
    running: list[list[int]] = []  # [tokens in the cache, decode steps left]
    sched = DecodeSchedule([], [])
    while True:
        while waiting and len(running) < max_num_seqs:
            prompt, output = waiting.popleft()
            if output > 1:  # the first token comes from the prefill
                running.append([prompt, output - 1])
        if not running:
            return sched
        for seq in running:
            seq[0] += 1  # the step writes the new token's K/V, then attends over all of them
            seq[1] -= 1
        sched.batch_sizes.append(len(running))
        sched.kv_tokens.append(sum(seq[0] for seq in running))
        running = [seq for seq in running if seq[1] > 0]


def estimate_throughput(cost: ModelCost, rates: DeviceRates, prompt_lens: list[int], output_lens: list[int],
                        max_num_seqs: int) -> dict:
    sched = simulate_decode(prompt_lens, output_lens, max_num_seqs)
    step_s = [cost.decode_step_seconds(rates, b, kv) for b, kv in zip(*sched)]
    memory_s = [cost.decode_step_bytes(kv) / rates.bandwidth for kv in sched.kv_tokens]
    decode_s = sum(step_s)
    prefill_flops = sum(cost.prefill_flops(p) for p in prompt_lens)
    prefill_s = prefill_flops / rates.matmul_flops
    total_s = decode_s + prefill_s
    return {
        **asdict(rates), "max_num_seqs": max_num_seqs, "num_steps": len(step_s),
        "kv_token_reads": sum(sched.kv_tokens), "peak_kv_tokens": max(sched.kv_tokens, default=0),
        "compute_bound_steps": sum(t > m for t, m in zip(step_s, memory_s)),
        "weight_bytes_per_step": cost.weight_bytes, "kv_bytes_per_token": cost.kv_bytes_per_token,
        "decode_weight_bytes": len(step_s) * cost.weight_bytes,
        "decode_kv_bytes": sum(sched.kv_tokens) * cost.kv_bytes_per_token, "decode_s": decode_s,
        "prefill_flops": prefill_flops, "prefill_s": prefill_s, "time_s": total_s,
        "output_tok_s": sum(output_lens) / total_s,
        "total_tok_s": (sum(prompt_lens) + sum(output_lens)) / total_s,
    }


def si(value: float, unit: str) -> str:
    """1.19e9, "B" -> "1.19 GB": three significant digits at any scale, tiny test models included."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def describe(est: dict) -> str:
    """The estimate and how it was reached, as printed lines."""
    return "\n".join([
        f"roofline on this device: copy bandwidth {si(est['bandwidth'], 'B/s')}, {est['matmul_dtype']} matmul "
        f"{si(est['matmul_flops'], 'FLOP/s')} (both measured in this run)",
        f"  decode: {est['num_steps']} steps (simulated FIFO schedule, max_num_seqs {est['max_num_seqs']}), "
        f"each reading the weights ({si(est['weight_bytes_per_step'], 'B')}) and the K/V of every running "
        f"sequence ({est['kv_bytes_per_token']} B/token) at the copy bandwidth, unless its FLOPs take longer",
        f"          {si(est['decode_weight_bytes'], 'B')} of weights + {si(est['decode_kv_bytes'], 'B')} of K/V "
        f"({est['kv_token_reads']:.3g} token reads; peak held {est['peak_kv_tokens']} tokens); "
        f"{est['compute_bound_steps']} steps compute-bound -> {est['decode_s']:.4g} s",
        f"  prefill: {si(est['prefill_flops'], 'FLOP')} (linear layers, causal attention, last-token logits) "
        f"-> {est['prefill_s']:.4g} s at the matmul rate",
        f"  estimate: {est['time_s']:.4g} s -> {est['output_tok_s']:.0f} output tok/s, "
        f"{est['total_tok_s']:.0f} total tok/s",
    ])
