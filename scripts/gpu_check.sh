#!/usr/bin/env bash
# `make gpu-check`: on the GPU machine as it is (its own python3; no network, no pip): the GPU tests, then
# the kernel benchmarks. Full logs and JSON go under $OUT when set (else benchmarks/results/latest).
# The tests run as parallel processes, one per file and the long Triton grid in three shards (compiling
# Triton and CUDA kernels is CPU-bound and the machine has cores to spare); the benchmarks run after them,
# alone on the GPU.
source "$(dirname "$0")/env.sh"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
pids=()
run_tests() {  # log name, then pytest arguments
  local name=$1; shift
  $PY -m pytest -q -p no:cacheprovider --durations=5 "$@" > "$OUT/$name.log" 2>&1 &
  pids+=($!)
}
for f in tests/gpu/test_*.py; do
  [ "$f" = tests/gpu/test_triton_gpu.py ] && continue
  run_tests "$(basename "$f" .py)" "$f"
done
for shard in decode prefill reshape; do
  run_tests "test_triton_gpu_$shard" tests/gpu/test_triton_gpu.py -k "$shard"
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
$PY benchmarks/kernels.py --out "$OUT" 2>&1 | tee "$OUT/kernels.log" || status=1
echo
echo "== summary =="
for log in "$OUT"/test_*.log; do echo "$(basename "$log" .log): $(tail -n 1 "$log")"; done
sed -n '/^|/p' "$OUT/kernels.log"
exit $status
