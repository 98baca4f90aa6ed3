"""Decode step time per batch size at a fixed context beside its roofline, with a PNG plot when matplotlib is
installed: the same code as `pagedllm bench latency` (pagedllm/bench/latency.py).

    python benchmarks/latency.py [--model qwen3-0.6b|llama3-8b|CONFIG] [--context 1024] [--output FILE.json]
"""
import sys

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    main(["bench", "latency", *sys.argv[1:]])
