"""End-to-end benchmarks behind `pagedllm bench`: throughput (with a roofline estimate and a Hugging Face
baseline) and decode latency per batch size. Model shapes live in shapes.py, the cost model in roofline.py."""
