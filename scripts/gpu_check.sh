#!/usr/bin/env bash
# `make gpu-check`: on the GPU machine as it is (its own python3; no network, no pip): the GPU tests, then
# the kernel benchmarks. Full logs and JSON go under $OUT when set (else benchmarks/results/latest).
# The test files run as parallel processes (compiling Triton and CUDA kernels is CPU-bound and the machine
# has cores to spare); the benchmarks run after them, alone on the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/latest}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
pids=()
for f in tests/gpu/test_*.py; do
  name=$(basename "$f" .py)
  $PY -m pytest -q -p no:cacheprovider --durations=5 "$f" > "$OUT/$name.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
$PY benchmarks/kernels.py --out "$OUT" 2>&1 | tee "$OUT/kernels.log" || status=1
echo
echo "== summary =="
for log in "$OUT"/test_*.log; do echo "$(basename "$log" .log): $(tail -n 1 "$log")"; done
sed -n '/^|/p' "$OUT/kernels.log"
exit $status
