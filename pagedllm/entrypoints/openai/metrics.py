"""Prometheus text exposition (format 0.0.4) written by hand: a few gauges, counters and histograms."""
from __future__ import annotations

import bisect

from pagedllm.outputs import RequestStateStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (stats key, type, help). Counters are exposed as key_total, the Prometheus convention vLLM's counters follow
# (vllm:prompt_tokens_total, ...).
_ENGINE_METRICS = [
    ("num_requests_running", "gauge", "Requests currently scheduled (prefill or decode)."),
    ("num_requests_waiting", "gauge", "Requests waiting to be scheduled, preempted ones included."),
    ("kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks held by requests (1 = full)."),
    ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "counter", "Requests preempted because the KV cache ran out of blocks."),
    ("prompt_tokens", "counter", "Prompt tokens of all requests added."),
    ("generation_tokens", "counter", "Tokens generated."),
]


class Histogram:
    """Cumulative-bucket histogram as Prometheus exposes it (le buckets, +Inf, _sum, _count)."""

    def __init__(self, name: str, help: str, buckets: list[float]) -> None:
        self.name = name
        self.help = help
        self.buckets = sorted(map(float, buckets))  # le="1.0", as prometheus_client writes integer bounds
        self.counts = [0] * (len(self.buckets) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += count
        self.sum += value * count

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for le, count in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum!r}")
        lines.append(f"{self.name}_count{{{labels}}} {cumulative}")
        return lines


class LabelledCounter:
    """A counter with one series per value of one label. The values given up front are exposed at 0 from the start,
    as vLLM creates request_success's series for every finish reason."""

    def __init__(self, name: str, help: str, label: str, values: list[str]) -> None:
        self.name = name
        self.help = help
        self.label = label
        self.counts = dict.fromkeys(values, 0)

    def inc(self, value: str) -> None:
        self.counts[value] = self.counts.get(value, 0) + 1

    def render(self, labels: str) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter",
                *(f'{self.name}_total{{{labels},{self.label}="{_escape(value)}"}} {float(count)!r}'
                  for value, count in self.counts.items())]


# vLLM v1's (its loggers.py): a dashboard's quantiles then read the same from both servers
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0]
INTER_TOKEN_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]


class ServerMetrics:
    """What the server observes itself: TTFT and inter-token latency as tokens arrive, and vLLM's per-request
    metrics once per finished sequence (each of n samples counts, as vLLM runs them as child requests), with vLLM's
    names, help texts and buckets. A sequence aborted because its client went away is in none of the per-request
    metrics, as in vLLM, whose client aborts skip its finished-request stats (its abort series stays at 0,
    vllm-project/vllm#31503): dashboards then read the same numbers from both servers."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self.time_to_first_token = Histogram(
            "pagedllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS)
        self.inter_token_latency = Histogram(
            "pagedllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_BUCKETS)
        self.request_success = LabelledCounter(
            "pagedllm:request_success", "Count of successfully processed requests.", "finished_reason",
            ["stop", "length", "abort"])
        self.e2e_request_latency = Histogram(
            "pagedllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
        # the phases of a finished sequence, from the engine's RequestStateStats
        self.phases = {phase: Histogram(f"pagedllm:request_{phase}_time_seconds",
                                        f"Histogram of time spent in {state} phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
                       for phase, state in (("queue", "WAITING"), ("inference", "RUNNING"), ("prefill", "PREFILL"),
                                            ("decode", "DECODE"))}
        self.time_per_output_token = Histogram(
            "pagedllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "pagedllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = Histogram(
            "pagedllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.request_params_n = Histogram(
            "pagedllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.request_params_max_tokens = Histogram(
            "pagedllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets)

    def request_finished(self, finish_reason: str, e2e_latency: float, prompt_tokens: int, generation_tokens: int,
                         max_tokens: int, stats: RequestStateStats) -> None:
        """One finished sequence. max_tokens: its effective limit (with max_tokens unset, what the context leaves),
        the value vLLM's server puts in SamplingParams. stats: its request's, as the engine output it when the
        sequence finished (so its last token is the sequence's), its phases computed as vLLM v1 computes them."""
        self.request_success.inc(finish_reason)
        self.e2e_request_latency.observe(e2e_latency)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.request_params_max_tokens.observe(max_tokens)
        decode = stats.last_token_ts - stats.first_token_ts
        for phase, seconds in (("queue", stats.scheduled_ts - stats.queued_ts),
                               ("inference", stats.last_token_ts - stats.scheduled_ts),
                               ("prefill", stats.first_token_ts - stats.scheduled_ts), ("decode", decode)):
            self.phases[phase].observe(seconds)
        self.time_per_output_token.observe(decode / (generation_tokens - 1) if generation_tokens > 1 else 0.0)

    def render(self, stats: dict[str, float]) -> str:
        lines = []
        for key, kind, help in _ENGINE_METRICS:
            name = f"pagedllm:{key}"
            sample = f"{name}_total" if kind == "counter" else name
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}",
                      f"{sample}{{{self.labels}}} {float(stats[key])!r}"]
        for metric in (self.time_to_first_token, self.inter_token_latency, self.request_success,
                       self.e2e_request_latency, *self.phases.values(), self.time_per_output_token,
                       self.request_prompt_tokens, self.request_generation_tokens, self.request_params_n,
                       self.request_params_max_tokens):
            lines += metric.render(self.labels)
        return "\n".join(lines) + "\n"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's bounds for its token-count histograms."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
