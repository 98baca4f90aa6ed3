#!/bin/bash
# The next GPU visit for issue 4, as two calls of at most 600 s on one warm H100 (chain the second within the 30 s
# the machine stays warm):
#   bash benchmarks/results/session51_next.sh tests1   # decoder-layer, engine, graph, uploader, sampler GPU tests
#   bash benchmarks/results/session51_next.sh tests2   # the other GPU test files, then the greedy-head sweep below
# Why: no full tests/gpu pass has run since the forty-eighth session (f0f21b3); the fiftieth and fifty-first ran
# subsets only. The sweep: HEAD_CONFIGS' K < 4096 row (8x2x16x5) was measured at K = 1024 only; Llama 3.2's heads
# (K = 2048 / 3072) may want the pick's 4 tiles a program, as K = 4096 did.
# Pytest's -k and node ids do not combine (the fifty-first session's tests never started): pass files and -k only.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/session51_next_$1.log") 2>&1
nvidia-smi -L; date
case "$1" in
  tests1) timeout 580 python -m pytest -q tests/gpu/test_decode_layer_gpu.py tests/gpu/test_engine_gpu.py \
            tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_uploader_gpu.py tests/gpu/test_sampler_gpu.py ;;
  tests2) timeout 420 python -m pytest -q tests/gpu/test_fused_gpu.py tests/gpu/test_triton_gpu.py \
            tests/gpu/test_cuda_ops.py tests/gpu/test_xattention_gpu.py tests/gpu/test_greedy_head_gpu.py
          timeout 150 python benchmarks/greedy_head.py --heads llama3.2-1b llama3.2-3b --trials 10 --engine-steps 0 \
            --configs 8x2x16x5 8x2x4x5 16x4x4x5 16x4x16x5 ;;
  *) echo "usage: $0 tests1|tests2"; exit 2 ;;
esac
date
