"""Prometheus text exposition (format 0.0.4) written by hand: a few gauges, counters and two histograms."""
from __future__ import annotations

import bisect

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
        self.buckets = sorted(buckets)
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


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self.time_to_first_token = Histogram(
            "pagedllm:time_to_first_token_seconds", "Time from request arrival to its first generated token.",
            [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
             20.0, 40.0, 80.0])
        self.inter_token_latency = Histogram(
            "pagedllm:inter_token_latency_seconds", "Time between consecutive generated tokens of a request.",
            [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0])

    def render(self, stats: dict[str, float]) -> str:
        lines = []
        for key, kind, help in _ENGINE_METRICS:
            name = f"pagedllm:{key}"
            sample = f"{name}_total" if kind == "counter" else name
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}",
                      f"{sample}{{{self.labels}}} {float(stats[key])!r}"]
        lines += self.time_to_first_token.render(self.labels)
        lines += self.inter_token_latency.render(self.labels)
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
