"""Offline throughput beside its roofline estimate (and, with --hf-baseline, Hugging Face transformers):
the same code as `pagedllm bench throughput` (pagedllm/bench/throughput.py, pagedllm/bench/roofline.py).

    python benchmarks/throughput.py [--model qwen3-0.6b|llama3-8b|CONFIG] [--hf-baseline] [--output FILE.json]
"""
import sys

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    main(["bench", "throughput", *sys.argv[1:]])
